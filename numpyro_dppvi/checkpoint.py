"""Saving and loading: a pytree of arrays plus JSON metadata in one ``.npz`` file, never pickle.

The file holds every leaf under its pytree path and a ``__meta__`` JSON record with a digest over
all leaves (names, dtypes, shapes, bytes) and the metadata itself. Loading recomputes it.

* Without a key the digest is SHA-256: it detects a truncated or damaged file, **not tampering**
  (anyone who edits a file can recompute a plain hash, e.g. to empty a ledger).
* With ``hmac_key`` (bytes, kept by whoever must trust the file) the digest is HMAC-SHA256: a file
  edited without the key is refused. A file saved with a key cannot be loaded without it, and a key
  given for a file saved without one is refused (it cannot be authenticated).

Loading never runs code: ``np.load(..., allow_pickle=False)`` and ``json``.

Two kinds of files are written by the package: published results (``result.save``; only
differentially private outputs, see docs/privacy.md "What a saved result holds") and **private
checkpoints** (``fit_dppvi(checkpoint=...)``): the fit's whole state, including its secret key and
every client's private state, for resuming. A private checkpoint is written with permissions 0600
and its metadata says ``"private": true``; it must never be published.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import os
import zipfile

import jax
import numpy as np

_META = "__meta__"


def _digest(arrays: dict[str, np.ndarray], meta_json: str, hmac_key: bytes | None) -> str:
    h = hashlib.sha256() if hmac_key is None else hmac.new(_check_key(hmac_key), digestmod=hashlib.sha256)
    h.update(meta_json.encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _check_key(hmac_key) -> bytes:
    if not isinstance(hmac_key, (bytes, bytearray)) or len(hmac_key) < 16:
        raise TypeError("hmac_key must be bytes of length >= 16 (e.g. secrets.token_bytes(32)), kept secret by "
                        "whoever needs to trust the file")
    return bytes(hmac_key)


def flatten(tree) -> dict[str, np.ndarray]:
    """``{keystr(path): leaf}`` for every array leaf of ``tree``."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def with_added_leaves(template, arrays: dict[str, np.ndarray], added) -> tuple[dict[str, np.ndarray], list[str]]:
    """``arrays`` (:func:`flatten` output of a save) with every leaf of ``template`` that the save lacks and whose
    last key is one of ``added`` (state a later version of the package added) set to zeros of the template's shape
    and dtype, and the paths so filled. Any other difference is left for :func:`unflatten_like` to refuse."""
    filled = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(template)[0]:
        name = jax.tree_util.keystr(path)
        if name not in arrays and path and getattr(path[-1], "key", None) in added:
            filled[name] = np.zeros(np.shape(leaf), np.asarray(leaf).dtype)
    return {**arrays, **filled}, sorted(filled)


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


def save(path, tree, meta: dict, hmac_key: bytes | None = None, private: bool = False) -> None:
    """Write ``tree`` and ``meta`` to ``path`` atomically; ``private=True`` makes the file 0600."""
    arrays = flatten(tree)
    if _META in arrays:
        raise ValueError(f"{_META} is reserved")
    meta = dict(meta, private=bool(private))
    meta_json = json.dumps(meta, sort_keys=True)
    field = "sha256" if hmac_key is None else "hmac_sha256"
    record = json.dumps({"meta": meta_json, field: _digest(arrays, meta_json, hmac_key)})
    buffer = io.BytesIO()
    np.savez(buffer, **arrays, **{_META: np.frombuffer(record.encode(), np.uint8)})
    write_atomically(path, buffer.getvalue(), private)


def write_atomically(path, data: bytes, private: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part:
    a temporary file of this process, flushed to disk, then renamed. ``private``: mode 0600."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if private:
            os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load(path, hmac_key: bytes | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """Return ``(arrays, meta)``; raises ``ValueError`` for a corrupted, truncated or edited file, or
    one whose authentication does not match ``hmac_key`` (module docstring)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{path} is not a readable numpyro_dppvi save file (truncated or corrupted): {exc}") from exc
    if _META not in arrays:
        raise ValueError(f"{path} is not a numpyro_dppvi save file (no metadata record)")
    try:
        record = json.loads(arrays.pop(_META).tobytes().decode())
        meta_json = record["meta"]
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} has an unreadable metadata record (corrupted)") from exc
    if "hmac_sha256" in record:
        if hmac_key is None:
            raise ValueError(f"{path} is authenticated with an HMAC key: pass hmac_key=... to load it")
        if not hmac.compare_digest(_digest(arrays, meta_json, hmac_key), str(record["hmac_sha256"])):
            raise ValueError(f"{path} failed its HMAC check: it was edited, or hmac_key is not the one it was "
                             "saved with; refusing to load it")
    else:
        if hmac_key is not None:
            raise ValueError(f"{path} was saved without an HMAC key, so it cannot be authenticated; "
                             "load it without hmac_key (its checksum detects damage only)")
        if _digest(arrays, meta_json, None) != record.get("sha256"):
            raise ValueError(f"{path} failed its checksum: the file was edited or damaged; refusing to load it")
    return arrays, json.loads(meta_json)
