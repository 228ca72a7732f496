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

JAX's cache starts after tracing and lowering, which cost a new process more than loading the compiled program
(the Adult DP fit's round: 1.0 s tracing and 0.55 s lowering against 0.44 s loading). So a fit's round program is
also kept in the folder as a serialized ``jax.export.Exported`` (:class:`ExportedProgram`), named by the
:func:`~numpyro_dppvi.program_key.persistent_digest` of what determines it (the round's settings, model, optimiser
and argument shapes, the versions of the libraries and of this package's source, JAX's configuration): a later
process that runs a fit of the same structure deserializes it and skips tracing and lowering. A program whose key
holds something known only by identity is not kept.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

import jax
import numpy as np
from jax import export

from .checkpoint import write_atomically
from .privacy import accounting_memo
from .program_cache import committed, jit
from .program_key import persistent_digest

CACHE_ENV = "NUMPYRO_DPPVI_CACHE"
PROGRAM_PREFIX = "dppvi-program-"
_log = logging.getLogger(__name__)
_state = {"folder": None, "salt": ""}  # the folder enable_compilation_cache set; clear()'s salt


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
        try:
            status = entry.lstat()
        except FileNotFoundError:  # gone since the listing (a writer's temporary file renamed into place): nothing
            continue               # under that name can be loaded; the name it took is checked when next listed
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
    """Turn on JAX's persistent compilation cache in ``path`` for every program, however quick to compile;
    returns the folder. Safe to call more than once.

    Raises ``PermissionError`` for a folder another user could write to
    (:func:`~numpyro_dppvi.persistent_cache.check_private_folder`), and ``ValueError`` for an empty ``path``
    (``Path("")`` is the working directory: the cache would fill it).

    Args:
      path: the cache folder, created (mode 0700) if missing. None (the default): ``$NUMPYRO_DPPVI_CACHE`` if
        set, else ``~/.cache/numpyro_dppvi/jax`` (:func:`~numpyro_dppvi.persistent_cache.default_cache_dir`).
    """
    if path is not None and not str(os.fspath(path)).strip():
        raise ValueError("enable_compilation_cache: the path is empty. Pass a folder, or None for the default "
                         f"({default_cache_dir()}, or ${CACHE_ENV} if set).")
    folder = Path(path) if path is not None else default_cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # this user's: the accountant memo needs it so
    check_private_folder(folder)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    accounting_memo.use(folder)
    _state["folder"] = folder
    return folder


def forget_exported_programs() -> None:
    """Serve no exported program written before this call, in this process (``program_cache.clear``: something the
    digest cannot see changed, such as a library function patched at run time); what is exported after it is named
    with a random salt, so that no other process is served it either."""
    _state["salt"] = os.urandom(16).hex()


class ExportedProgram:
    """``jit(fn)`` kept across processes as a serialized ``jax.export.Exported`` (module docstring).

    ``key``: the static part of the program, as for :func:`~numpyro_dppvi.program_cache.cached`; ``name``: the
    program's name in JAX's logs (its function's). Called (or
    ``lower``-ed) like the jitted function. Without :func:`enable_compilation_cache`, or when ``key`` has no
    :func:`~numpyro_dppvi.program_key.persistent_digest`, it is the jitted function. On the first call for an argument
    signature the exported program is read from the folder, or exported there (one trace and lowering, as the jitted
    function would do), and the call runs ``jit(exported.call)``; its XLA compilation is JAX's cache's.
    """

    def __init__(self, jitted, key, name: str = "program"):
        self._jitted, self._key, self._name = jitted, key, name
        self._programs = {}
        self._lock = threading.Lock()

    def __call__(self, *args):
        program, args = self._program(args)
        return program(*args)

    def lower(self, *args):
        program, args = self._program(args)
        return program.lower(*args)

    def _program(self, args):
        """``(program, args)``: the program for these arguments' signature and the arguments to call it with, every
        one committed to the default device (:func:`~numpyro_dppvi.program_cache.committed`): an exported program
        returns committed arrays, so the first round, whose state may come from the host, a checkpoint or the
        compile-ahead's placeholders, and the later ones share one compiled program."""
        args = committed(args)
        folder = _state["folder"]
        if folder is None:
            return self._jitted, args
        leaves, treedef = jax.tree_util.tree_flatten(args)
        signature = (str(treedef),) + tuple(  # a Python number is a leaf too: its type stands for its dtype
            (tuple(np.shape(a)), str(getattr(a, "dtype", type(a).__name__)), bool(getattr(a, "weak_type", False)))
            for a in leaves)
        with self._lock:  # the compile-ahead thread and the fit's first round may both ask
            if signature not in self._programs:
                self._programs[signature] = self._resolve(folder, args, signature)
            program = self._programs[signature]
        return program, args

    def _resolve(self, folder: Path, args, signature):
        digest = persistent_digest((self._key, signature, _environment(), _state["salt"]))
        if digest is None:
            return self._jitted
        path = folder / (PROGRAM_PREFIX + digest)
        try:
            _register_node_types(jax.tree_util.tree_structure(args))
            exported = _read(path)
            if exported is None:
                exported = export.export(self._jitted)(*args)
                _register_node_types(exported.out_tree)
                write_atomically(path, bytes(exported.serialize()), private=True)
        except Exception as error:  # noqa: BLE001 - not exportable (a callback, an unregistered node type)
            _log.debug("program not kept across processes: %r", error)
            return self._jitted
        return jit(_named(exported.call, self._name))


def _named(fn, name: str):
    """``fn`` under ``name``: the compiled program keeps its function's name in JAX's logs and profiles."""
    def program(*args):
        return fn(*args)
    program.__name__ = program.__qualname__ = name
    return program


def _environment() -> tuple:
    """What besides the key decides a traced program: Python, the backend and JAX's configuration (the library
    versions enter through the modules and classes of the key)."""
    skip = ("jax_compilation_cache", "jax_persistent_cache", "jax_log", "jax_explain")
    config = tuple(sorted((k, repr(v)) for k, v in jax.config.values.items() if not k.startswith(skip)))
    return (jax.__version__, jax.default_backend(), config)


_REGISTERED: set = set()


def _register_node_types(treedef) -> None:
    """Register this package's named tuples in ``treedef`` for ``Exported`` serialization (by module and name)."""
    stack = [treedef]
    while stack:
        node = stack.pop()
        data = node.node_data()
        if data is not None:
            kind = data[0]
            if (kind not in _REGISTERED and issubclass(kind, tuple) and hasattr(kind, "_fields")
                    and kind.__module__.startswith(__package__.split(".")[0] + ".")):
                export.register_namedtuple_serialization(kind, serialized_name=f"{kind.__module__}.{kind.__qualname__}")
                _REGISTERED.add(kind)
        stack.extend(node.children())


def _read(path: Path):
    """The exported program at ``path``, or None (absent, unreadable, not this user's, or from another JAX)."""
    try:
        status = path.lstat()
    except FileNotFoundError:
        return None
    if hasattr(os, "getuid") and (status.st_uid != os.getuid() or status.st_mode & 0o022 or not stat.S_ISREG(status.st_mode)):
        return None
    try:
        return export.deserialize(bytearray(path.read_bytes()))
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file: export afresh
        _log.debug("exported program %s not read: %r", path.name, error)
        return None
