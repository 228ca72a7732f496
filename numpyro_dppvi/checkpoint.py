"""Saving and loading fits: a pytree of arrays plus JSON metadata in one ``.npz`` file.

The file holds every leaf under its pytree path and a ``__meta__`` JSON record with a SHA-256 digest
over all leaves (names, dtypes, shapes, bytes) and the metadata itself. Loading recomputes the digest:
a truncated or edited file is refused with a clear error instead of being half-loaded. No pickle is
used, so loading a file never runs code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile

import jax
import numpy as np

_META = "__meta__"


def _digest(arrays: dict[str, np.ndarray], meta_json: str) -> str:
    h = hashlib.sha256(meta_json.encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def flatten(tree) -> dict[str, np.ndarray]:
    """``{keystr(path): leaf}`` for every array leaf of ``tree``."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def unflatten_like(template, arrays: dict[str, np.ndarray]):
    """Rebuild a pytree shaped like ``template`` from :func:`flatten` output, checking every path, shape and dtype."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    missing = [jax.tree_util.keystr(p) for p, _ in leaves if jax.tree_util.keystr(p) not in arrays]
    if missing or len(leaves) != len(arrays):
        raise ValueError(
            "saved state does not match this fit's configuration (different method, model or clients?): "
            f"missing {missing[:3]}, {len(arrays)} saved leaves vs {len(leaves)} expected"
        )
    out = []
    for path, leaf in leaves:
        a = arrays[jax.tree_util.keystr(path)]
        if a.shape != np.shape(leaf) or a.dtype != np.asarray(leaf).dtype:
            raise ValueError(f"saved leaf {jax.tree_util.keystr(path)} has shape {a.shape}/{a.dtype}, "
                             f"expected {np.shape(leaf)}/{np.asarray(leaf).dtype}")
        out.append(a)
    return jax.tree_util.tree_unflatten(treedef, out)


def save(path, tree, meta: dict) -> None:
    arrays = flatten(tree)
    if _META in arrays:
        raise ValueError(f"{_META} is reserved")
    meta_json = json.dumps(meta, sort_keys=True)
    record = json.dumps({"meta": meta_json, "sha256": _digest(arrays, meta_json)})
    buffer = io.BytesIO()
    np.savez(buffer, **arrays, **{_META: np.frombuffer(record.encode(), np.uint8)})
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(buffer.getvalue())
    os.replace(tmp, path)


def load(path) -> tuple[dict[str, np.ndarray], dict]:
    """Return ``(arrays, meta)``; raises ``ValueError`` for a corrupted, truncated or edited file."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{path} is not a readable numpyro_dppvi save file (truncated or corrupted): {exc}") from exc
    if _META not in arrays:
        raise ValueError(f"{path} is not a numpyro_dppvi save file (no metadata record)")
    record = json.loads(arrays.pop(_META).tobytes().decode())
    if _digest(arrays, record["meta"]) != record["sha256"]:
        raise ValueError(f"{path} failed its checksum: the file was edited or damaged; refusing to load it")
    return arrays, json.loads(record["meta"])
