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

**Never stale.** Two equal keys mean equal behaviour at trace time as far as the key can see: every value a
program can close over is in the key, by value where the key knows how to read it and by identity otherwise.
What identity does not cover is what it never covered: an object of an unknown class mutated in place
between two fits keeps its key (pass a new object). A global the function reads is keyed by its value when
the key is computed, so rebinding it gives a new key.
"""

from __future__ import annotations

import dataclasses
import functools
import types

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
