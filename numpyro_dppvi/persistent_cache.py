"""An opt-in persistent cache of compiled programs (JAX's compilation cache on disk).

Within one process the package reuses its traced models and compiled rounds (:mod:`.cache`). Across
processes, :func:`enable_compilation_cache` makes JAX write every compiled program to a folder and
read it back in later processes, so a fresh process that runs a fit of a structure seen before skips
XLA compilation (tracing still runs). The accountant's answers (epsilons and solved noise
calibrations) are kept there too, signed (:mod:`numpyro_dppvi.privacy.accounting_memo`). The ``dppvi``
command turns it on; libraries and notebooks opt in.

The folder: ``path``, else ``$NUMPYRO_DPPVI_CACHE``, else ``~/.cache/numpyro_dppvi/jax``: the cache
folder beside the default data home, never inside a shared data home such as
``NUMPYRO_DPPVI_DATA`` (which may be read-only or shared between users). Compiled programs hold no
data and no keys: the data and keys are arguments of the programs, not constants folded into them
(tested by searching every entry for planted rows; a model that closes over data rows itself
would put them there). A folder another local user could write to is refused
(:func:`check_private_folder`): JAX runs whatever program it finds there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import jax

from .privacy import accounting_memo

CACHE_ENV = "NUMPYRO_DPPVI_CACHE"


def default_cache_dir() -> Path:
    """``$NUMPYRO_DPPVI_CACHE`` if set and non-empty, else ``~/.cache/numpyro_dppvi/jax``."""
    configured = os.environ.get(CACHE_ENV, "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "numpyro_dppvi" / "jax"


def _unsafe(path: Path, uid: int, sticky_ok: bool = True) -> str | None:
    """Why another user could have written ``path`` (``None``: nobody but ``uid`` and root could)."""
    status = path.lstat()
    if status.st_uid not in (uid, 0):
        return f"{path} belongs to user {status.st_uid}"
    sticky = sticky_ok and stat.S_ISDIR(status.st_mode) and status.st_mode & stat.S_ISVTX
    if status.st_mode & 0o022 and not sticky:
        return f"{path} is writable by other users (mode {stat.S_IMODE(status.st_mode):o})"
    return None


def check_private_folder(folder: Path) -> None:
    """Refuse (``PermissionError``) a cache folder that another local user could have written to.

    JAX loads whatever compiled program it finds under a program's key: a local user who can write the
    folder (or a file in it, or replace the folder through a writable parent) can swap a fit's round
    for a build without noise, which then releases the data unnoised while the ledger counts the noise
    (issue 24, finding 3). Required: the folder and every parent owned by this user or root and not
    writable by others (a parent with the sticky bit, such as ``/tmp``, is fine: others cannot rename
    what is in it); every entry owned by this user, and, when others may enter the folder, not
    writable by them. The folder's real path is checked (links resolved). Without POSIX owners (Windows)
    nothing is checked.
    """
    if not hasattr(os, "getuid"):
        return
    uid = os.getuid()
    folder = Path(os.path.realpath(folder))  # every component checked, none a link
    problems = [_unsafe(folder, uid, sticky_ok=False)] + [_unsafe(p, uid) for p in folder.parents]
    enterable = folder.lstat().st_mode & 0o011
    for entry in folder.iterdir():
        status = entry.lstat()
        if status.st_uid != uid:
            problems.append(f"{entry} belongs to user {status.st_uid}")
        elif enterable and status.st_mode & 0o022:
            problems.append(f"{entry} is writable by other users (mode {stat.S_IMODE(status.st_mode):o})")
    problems = [p for p in problems if p]
    if problems:
        raise PermissionError(
            f"refusing the compilation cache in {folder}: another user could replace the compiled programs a fit "
            f"runs (e.g. with a build that adds no noise): {'; '.join(problems[:3])}. Use a folder of your own "
            f"(the default {default_cache_dir()} or ${CACHE_ENV}), e.g. `mkdir -m 700 <folder>`, or remove what "
            "others wrote and `chmod go-w` it.")


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Turn on JAX's persistent compilation cache in ``path`` (default :func:`default_cache_dir`) for
    every program, however quick to compile; returns the folder. Safe to call more than once.

    Raises ``PermissionError`` for a folder another user could write to (:func:`check_private_folder`)."""
    folder = Path(path) if path is not None else default_cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # this user's: the accountant memo needs it so
    check_private_folder(folder)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    accounting_memo.use(folder)
    return folder
