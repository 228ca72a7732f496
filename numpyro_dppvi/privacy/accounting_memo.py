"""Accountant results kept across processes: a signed memo on disk (opt-in).

The PLD accountant is exact and slow: one epsilon of the Adult plan (a Poisson-subsampled Gaussian
at rate 0.025, 100 compositions, on the ledger's 1e-4 grid) takes about 0.5 s, as long as the rest
of a fit's set-up. Within a process :mod:`.backends` and :mod:`.calibration` memoise their answers;
with :func:`use` (called by :func:`numpyro_dppvi.enable_compilation_cache`) they also keep them in
``accounting.json`` in the cache folder, so a new process asking the same question reads the
answer instead of computing it again.

An answer is a pure function of its question, so a kept value is exactly the value the accountant
would return (a float written with ``repr`` reads back bit for bit): the ledger's epsilon is the
same to the last digit whether computed or read. Each entry is bound to its question, to the
versions of the accountant libraries and of this package, the source of its privacy code
(:func:`_versions`) and :data:`FORMAT` by an HMAC-SHA256 under a secret of 32
random bytes in ``accounting.key`` (created with mode 0600 in a folder of mode 0700; a secret or a
folder that another user owns, may write or may read turns the memo off). An entry
that does not verify (edited, copied from another folder or user, written by another version) is
ignored and the answer computed again; a folder that cannot be written leaves the memo in the
process. Anyone who can read the secret can also replace the compiled programs that JAX loads from
the same folder, so this memo is trusted exactly as far as JAX's compilation cache is.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
import os
import secrets
from importlib import metadata
from pathlib import Path

from ..checkpoint import write_atomically

#: Bumped whenever what a question means changes (units, defaults of the accountant calls).
FORMAT = "numpyro_dppvi accounting memo 1"
MEMO_FILE = "accounting.json"
KEY_FILE = "accounting.key"
MAX_ENTRIES = 4096

_folder: Path | None = None


def use(folder: str | os.PathLike | None) -> None:
    """Keep answers in ``folder`` from now on (``None``: in this process only)."""
    global _folder
    _folder = None if folder is None else Path(folder)


@functools.lru_cache(maxsize=1)
def _versions() -> str:
    """What an answer depends on besides its question: the versions of the accountant libraries and of
    this package, and a digest of the source of this package's privacy code (a development checkout
    keeps its version while its accountant code changes). Issue 24: bound to the libraries' versions only,
    an answer written by another version of this package (another calibration rule, another grid)
    was served as this code's answer."""
    out = []
    for package in ("dp-accounting", "autodp", "numpyro_dppvi"):
        try:
            out.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            out.append(f"{package} absent")
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    out.append(f"privacy code {digest.hexdigest()}")
    return "; ".join(out)


def _private(path: Path, forbidden_mode: int) -> bool:
    """``path`` belongs to this user and grants nobody else ``forbidden_mode``. Without POSIX owners
    (Windows) the folder's access control lists decide."""
    if not hasattr(os, "getuid"):
        return True
    status = path.stat()
    return status.st_uid == os.getuid() and not status.st_mode & forbidden_mode


def _secret(create: bool) -> bytes | None:
    """The memo's secret; ``None`` (no memo on disk) unless the folder is writable by this user only
    and the secret readable by this user only: else another user could swap in a secret of theirs
    and sign any answer."""
    path = _folder / KEY_FILE
    try:
        if not _private(_folder, 0o022) or not _private(path, 0o077):
            return None
        data = path.read_bytes()
        return data if len(data) == 32 else None
    except FileNotFoundError:
        if not create:
            return None
    except OSError:
        return None
    try:
        _folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return _secret(create=False)
    except OSError:
        return None
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return _secret(create=False)


def _tag(secret: bytes, question: str, value: float) -> str:
    message = f"{FORMAT}\n{_versions()}\n{question}\n{value!r}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _entries() -> dict:
    try:
        entries = json.loads((_folder / MEMO_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def load(question: str) -> float | None:
    """The kept answer to ``question`` if one verifies, else ``None``."""
    if _folder is None:
        return None
    entry = _entries().get(question)
    secret = _secret(create=False)
    if secret is None or not isinstance(entry, dict):
        return None
    value, tag = entry.get("value"), entry.get("hmac")
    if not isinstance(value, float) or not math.isfinite(value) or not isinstance(tag, str):
        return None
    return value if hmac.compare_digest(tag, _tag(secret, question, value)) else None


def store(question: str, value: float) -> None:
    """Keep ``value`` as the answer to ``question`` (silently in-process only if the folder is read-only)."""
    if _folder is None or not math.isfinite(value):
        return
    secret = _secret(create=True)
    if secret is None:
        return
    entries = _entries()
    entries.pop(question, None)
    entries[question] = {"value": float(value), "hmac": _tag(secret, question, float(value))}
    for oldest in list(entries)[:-MAX_ENTRIES]:  # a bounded file: the oldest answers go first
        del entries[oldest]
    try:
        write_atomically(_folder / MEMO_FILE, json.dumps(entries).encode(), private=True)
    except OSError:
        pass
