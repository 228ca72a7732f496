"""Reuse of traced models and compiled programs across fits with the same static structure.

A fit's jitted programs take the data as arguments (never as closed-over constants), so that a
second fit with the same model, settings and array shapes (the same fit again, the next fold of a
cross-validation, a resume) reuses the compiled program instead of tracing and compiling it again.
The key holds only static things: settings, names, shapes and dtypes, and the model, the optax optimiser
and the other functions by what determines their behaviour (:func:`~numpyro_dppvi.program_key.structural_key`:
code, closure values, the globals they read), so that ``optax.adam(1e-2)`` written afresh, a model re-defined
by the same ``def`` and settings objects built again reuse the program, while a changed body, closure value or
optimiser kind builds a new one. An object the key cannot read (an instance of an unknown class) counts by
identity: mutated in place between fits, it must be passed as a new object. Used by ``pvi`` (model adapters, round programs) and ``vfl``. Host values enter through
:func:`to_device`, which needs no program at all. Every program of the package is jitted by :func:`jit` (or
:func:`jitted`), which compiles it with the package's XLA options (:data:`CPU_COMPILER_OPTIONS`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Callable

import jax
import numpy as np

from .program_key import structural_key

_MAX_ENTRIES = 64
_PROGRAMS: OrderedDict = OrderedDict()


def shapes(tree) -> tuple:
    """Static description of a pytree of arrays: structure, shapes and dtypes."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (str(treedef),) + tuple(
        (tuple(np.shape(a)), str(getattr(a, "dtype", np.asarray(a).dtype))) for a in leaves
    )


def to_device(x, dtype=None) -> jax.Array:
    """``jnp.asarray(x, dtype)`` of a host value, without a compiled program.

    ``jnp.asarray`` of a NumPy array runs a copy program compiled per shape and dtype
    (``jit(stage)``; in a new process each is compiled or read from the persistent cache, about
    10 ms, dozens in a fit's set-up); ``jax.device_put`` copies the buffer, in JAX's canonical
    dtype, with none. A JAX array without a ``dtype`` to change is returned as it is.
    """
    if isinstance(x, jax.Array) and (dtype is None or x.dtype == dtype):
        return x
    return jax.device_put(np.asarray(x) if dtype is None else np.asarray(x, dtype))


def committed(tree):
    """``tree`` committed to the default device (no copy for arrays already there): a jitted program's outputs are
    committed when an input is, and JAX compiles a program once for committed and once for uncommitted arguments,
    so a state read from a checkpoint and one a round returned must be alike. A ``jax.ShapeDtypeStruct`` leaf (an
    abstract argument to ``lower`` a program ahead of its first call) takes the default device's sharding, which
    lowers the program its committed arrays will call."""
    device = jax.devices()[0]
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        return jax.device_put(tree, device)
    sharding = jax.sharding.SingleDeviceSharding(device)
    return treedef.unflatten([
        jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type)
        if isinstance(leaf, jax.ShapeDtypeStruct) else jax.device_put(leaf, device) for leaf in leaves])


#: XLA:CPU options of this package's programs. XLA's MLIR fusion emitters (its CPU default) took 0.45 s more
#: (median, 6 interleaved processes; 2.6-3.2 s against 1.9-2.8 s of wall time, about 0.9 s more CPU) to compile the
#: Adult DP round's lowering than its elemental emitters, which ran the round as fast (41.4 ms against 42.8 ms, 40
#: interleaved calls) to the same values bit for bit; a new process's first fit is mostly that compilation
#: (``benchmarks/fit_overhead.py``, ``fresh_process``). Set per program (``jax.jit``'s ``compiler_options``), so a
#: user's own programs are compiled as they would be.
CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def xla_options_probe(x):
    """The one-operation program :func:`compiler_options` compiles to learn whether XLA knows the options."""
    return x + 1


@functools.cache
def compiler_options() -> dict | None:
    """:data:`CPU_COMPILER_OPTIONS` on the CPU backend of an XLA that knows them (:func:`xla_options_probe` is
    compiled with them once a process: XLA checks option names only when it compiles); None otherwise (another
    backend, or an XLA without the option: its own defaults)."""
    if jax.default_backend() != "cpu":
        return None
    try:
        jax.jit(xla_options_probe, compiler_options=CPU_COMPILER_OPTIONS).lower(np.float32(0)).compile()
    except Exception:  # noqa: BLE001 - an unknown option (INVALID_ARGUMENT) or a JAX without compiler_options
        return None
    return dict(CPU_COMPILER_OPTIONS)


def jit(fn: Callable, **kwargs) -> Callable:
    """``jax.jit(fn, **kwargs)`` compiled with this package's :func:`compiler_options`."""
    return jax.jit(fn, compiler_options=compiler_options(), **kwargs)


def jitted(**kwargs) -> Callable[[Callable], Callable]:
    """Decorator of a module-level program: ``fn`` compiled by :func:`jit` with ``kwargs`` (``static_argnums``,
    ...), built on its first call, so that importing the package reads no backend and compiles nothing."""
    def decorate(fn: Callable) -> Callable:
        program = []

        @functools.wraps(fn)
        def call(*args, **kw):
            if not program:
                program.append(jit(fn, **kwargs))
            return program[0](*args, **kw)
        return call
    return decorate


def cached(key: tuple, build: Callable[[], Callable]) -> Callable:
    """The program stored under ``key`` (compared by :func:`~numpyro_dppvi.program_key.structural_key`), built (and
    stored) on first use."""
    key = structural_key(key)
    try:
        program = _PROGRAMS.pop(key)
    except KeyError:
        program = build()
    except TypeError:  # unhashable part in the key: no reuse
        return build()
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _MAX_ENTRIES:
        _PROGRAMS.popitem(last=False)
    return program


def clear() -> None:
    """Drop every stored program and traced model: the next fit traces and compiles afresh. For what a key cannot
    see, such as a library function patched at run time (``monkeypatch.setattr(jax.random, "normal", ...)``). The
    programs kept across processes (:class:`~numpyro_dppvi.persistent_cache.ExportedProgram`) are not served
    either."""
    from .persistent_cache import forget_exported_programs  # it builds on this module

    _PROGRAMS.clear()
    forget_exported_programs()
