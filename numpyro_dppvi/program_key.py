"""Keys of compiled programs by what determines the program, not by object identity (issue 25).

A user's script builds its arguments afresh on every call: ``optimizer=optax.adam(1e-2)`` written twice
gives two ``GradientTransformation`` objects whose ``init``/``update`` are new closures over equal values;
a model re-defined by the same ``def`` is a new function object with the same code. Keyed by identity,
each such call traced and compiled the whole fit again. :func:`structural_key` gives two such objects one
key, so that :func:`numpyro_dppvi.program_cache.cached` returns the program built for the first:

* numbers, strings, bytes, ``None``: their type and value;
* tuples (named tuples such as optax's transformations included), lists, dicts: their type and the keys of
  their items; frozen and mutable dataclasses alike: their type and the keys of their fields;
* Python functions: their code object (bytecode, constants, names and first line: a changed body is another
  key), defaults, the keys of their closure's values, and the keys of the module globals their code (and the
  code of the functions and lambdas defined in it) reads; ``functools.partial``: its function and arguments;
  bound methods: their function and the key of the object they are bound to;
* NumPy and JAX arrays up to :data:`MAX_ARRAY_BYTES`: shape, dtype and the bytes themselves;
* anything else (modules, classes, builtins, jitted functions, other objects, larger arrays): the object
  itself, by identity, as before.

Across processes (:func:`persistent_digest`, the name of a program in the persistent cache) identity means nothing,
so the digest reads the same things by content and names the rest by where its code comes from: a class, module or
builtin of an installed library by its name and the library's version, of this package by a hash of the package's
source, of the user's own files by a hash of that file; anything it can only know by identity (an instance of an
unknown class, a larger array, a class defined where no file says what it is) makes the digest ``None``: that
program is not kept across processes.

**Never stale.** Two equal keys mean equal behaviour at trace time as far as the key can see: every value a
program can close over is in the key, by value where the key knows how to read it and by identity otherwise.
What identity does not cover is what it never covered: an object of an unknown class mutated in place
between two fits keeps its key (pass a new object). A global the function reads is keyed by its value when
the key is computed, so rebinding it gives a new key.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import sys
import types
from pathlib import Path

import numpy as np

#: Arrays up to this size are keyed by their bytes; larger ones by identity (hashing them would cost more
#: than the compilation it saves).
MAX_ARRAY_BYTES = 1 << 16
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


class Identity:
    """Key of an object compared by identity (it keeps the object alive while the key is in use)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, Identity) and other.obj is self.obj

    def __repr__(self):
        return f"Identity({type(self.obj).__name__} at {id(self.obj):#x})"


def structural_key(obj, _active=None):
    """A hashable key, equal for two objects that behave alike in a traced program (module docstring)."""
    active = set() if _active is None else _active
    if isinstance(obj, _SCALARS):
        return (type(obj), obj)
    if id(obj) in active:  # a cycle (a recursive function, a self-referencing container): the code is keyed above
        return ("cycle", Identity(type(obj)))
    active.add(id(obj))
    try:
        return _key(obj, active)
    finally:
        active.discard(id(obj))


def _key(obj, active):
    key = lambda x: structural_key(x, active)
    if isinstance(obj, (tuple, list)):
        return (type(obj),) + tuple(key(x) for x in obj)
    if isinstance(obj, dict):
        try:
            items = sorted(obj.items(), key=lambda kv: repr(kv[0]))
        except Exception:  # noqa: BLE001 - keys whose repr fails: identity
            return Identity(obj)
        return (dict,) + tuple((key(k), key(v)) for k, v in items)
    if isinstance(obj, types.FunctionType):
        return _function_key(obj, key)
    if isinstance(obj, functools.partial):
        return (functools.partial, key(obj.func), key(obj.args), key(obj.keywords))
    if isinstance(obj, types.MethodType):
        return (types.MethodType, key(obj.__func__), key(obj.__self__))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj),) + tuple((f.name, key(getattr(obj, f.name))) for f in dataclasses.fields(obj))
    if _is_array(obj) and np.dtype(obj.dtype).kind in "biufc":
        if int(np.prod(obj.shape)) * np.dtype(obj.dtype).itemsize <= MAX_ARRAY_BYTES:  # read before any host copy
            array = np.asarray(obj)
            return ("array", type(obj), array.shape, str(array.dtype), array.tobytes())
    return Identity(obj)


def _is_array(obj) -> bool:
    return isinstance(obj, np.ndarray) or (type(obj).__module__.startswith("jax") and hasattr(obj, "shape")
                                           and hasattr(obj, "dtype") and not callable(obj))


def _function_key(fn: types.FunctionType, key):
    try:
        closure = tuple(cell.cell_contents for cell in fn.__closure__ or ())
    except ValueError:  # an empty cell (a name assigned after the function was made): identity
        return Identity(fn)
    names = sorted(_global_names(fn.__code__) & fn.__globals__.keys())
    used = tuple((name, key(fn.__globals__[name])) for name in names)
    return (types.FunctionType, fn.__code__, key(fn.__defaults__), key(fn.__kwdefaults__), key(closure), used,
            fn.__globals__.get("__name__"))


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> frozenset:
    """Names ``code`` (and the code objects defined in it) may read as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)


# --------------------------------------------------------------------------- across processes


class _Unknowable(Exception):
    """A part of the key known only by identity: no digest across processes."""


def persistent_digest(obj) -> str | None:
    """A digest of ``obj`` that is equal in two processes exactly when :func:`structural_key` would be equal in one,
    with identity replaced by provenance (module docstring); ``None`` when some part is known only by identity.

    It digests the structural key itself: its values, types and code objects by content, and of what the key holds
    by identity, modules, classes and builtins by where their code comes from and objects that carry their own
    construction key (``persistent_key``, e.g. a model adapter: the model and the row shapes it was traced on)
    through that key. Never uses ``hash()`` or ``id()``, which differ between processes.
    """
    digest = hashlib.sha256()
    try:
        _feed(structural_key(obj), digest)
    except _Unknowable:
        return None
    return digest.hexdigest()


def _put(out, tag: str, data: bytes = b"") -> None:
    out.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)


def _feed(key, out) -> None:
    """One part of a structural key."""
    if isinstance(key, tuple):
        _put(out, "tuple", str(len(key)).encode())
        for part in key:
            _feed(part, out)
    elif isinstance(key, _SCALARS):
        _put(out, type(key).__name__, key if isinstance(key, bytes) else repr(key).encode())
    elif isinstance(key, type):
        _put(out, "type", _type_token(key).encode())
    elif isinstance(key, types.CodeType):
        _feed_code(key, out)
    elif isinstance(key, Identity):
        _feed_identity(key.obj, out)
    else:
        raise _Unknowable(type(key))


def _feed_identity(obj, out) -> None:
    if isinstance(obj, type):
        _put(out, "type", _type_token(obj).encode())
    elif isinstance(obj, types.ModuleType):
        _put(out, "module", (obj.__name__ + "@" + _module_token(obj.__name__)).encode())
    elif isinstance(obj, (types.BuiltinFunctionType, np.ufunc)):
        module = getattr(obj, "__module__", None) or type(obj).__module__
        _put(out, "builtin", f"{module}.{getattr(obj, '__qualname__', obj.__name__)}@{_module_token(module)}".encode())
    elif hasattr(obj, "persistent_key"):
        _put(out, "constructed", _type_token(type(obj)).encode())
        _feed(structural_key(obj.persistent_key), out)
    else:
        raise _Unknowable(type(obj))


def _feed_code(code: types.CodeType, out) -> None:
    """A code object by what its equality compares (bytecode, constants, names, first line), nested code
    objects included (``marshal`` output depends on reference counts, so it is not used)."""
    _put(out, "code", code.co_code)
    _feed((code.co_name, code.co_firstlineno, code.co_flags, code.co_argcount, code.co_posonlyargcount,
           code.co_kwonlyargcount, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars), out)
    for const in code.co_consts:
        _feed_constant(const, out)
    _put(out, "end code")


def _feed_constant(const, out) -> None:
    """A constant of a code object: a scalar, a code object, or a tuple or frozenset of constants."""
    if isinstance(const, types.CodeType):
        _feed_code(const, out)
    elif isinstance(const, (tuple, frozenset)):
        _put(out, type(const).__name__, str(len(const)).encode())
        for item in (const if isinstance(const, tuple) else sorted(const, key=repr)):
            _feed_constant(item, out)
    elif const is Ellipsis:
        _put(out, "ellipsis")
    else:
        _feed(const, out)


def _type_token(cls: type) -> str:
    """A class by where its code and its bases' code come from: ``module.qualname@`` the module's token, for each
    class of its method resolution order (a base class in another file may change while the class's file does not)."""
    return " < ".join(f"{c.__module__}.{c.__qualname__}@{_module_token(c.__module__)}" for c in cls.__mro__)


@functools.lru_cache(maxsize=None)
def _module_token(name: str) -> str:
    """What determines the code of module ``name``: the Python version (standard library), the installed
    distribution's version, this package's source hash, or the hash of the user's file that holds it."""
    top = name.split(".")[0]
    if top == "builtins" or top in sys.stdlib_module_names:
        return "python " + sys.version
    if top == __package__.split(".")[0]:
        return "source " + _package_source_hash()
    try:  # the distribution is usually named as its top-level module (jax, jaxlib, numpyro, optax, numpy)
        return f"{top} {importlib.metadata.version(top)}"
    except importlib.metadata.PackageNotFoundError:
        pass
    distributions = _distributions().get(top)
    if distributions:
        return " ".join(sorted(f"{d} {importlib.metadata.version(d)}" for d in set(distributions)))
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path is None or not Path(path).is_file():
        raise _Unknowable(name)
    return "file " + hashlib.sha256(Path(path).read_bytes()).hexdigest()


@functools.lru_cache(maxsize=1)
def _distributions() -> dict:
    return importlib.metadata.packages_distributions()  # reads every installed distribution: only when needed


@functools.lru_cache(maxsize=1)
def _package_source_hash() -> str:
    """A hash of every Python file of this package (an editable install changes without a new version)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
