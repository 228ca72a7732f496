"""Reuse of traced models and compiled programs across fits with the same static structure.

A fit's jitted programs take the data as arguments (never as closed-over constants), so that a
second fit with the same model, settings and array shapes (the same fit again, the next fold of a
cross-validation, a resume) reuses the compiled program instead of tracing and compiling it again.
The key holds only static, hashable things: functions by identity (the model, an optax optimiser's
functions), settings, names, shapes and dtypes. A model is traced once per key, so a function whose
behaviour changes between fits (e.g. through a mutated global) must be passed as a new function
object. Used by ``pvi`` (model adapters, round programs) and ``vfl``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import jax
import numpy as np

_MAX_ENTRIES = 64
_PROGRAMS: OrderedDict = OrderedDict()


def shapes(tree) -> tuple:
    """Static description of a pytree of arrays: structure, shapes and dtypes."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (str(treedef),) + tuple(
        (tuple(np.shape(a)), str(getattr(a, "dtype", np.asarray(a).dtype))) for a in leaves
    )


def cached(key: tuple, build: Callable[[], Callable]) -> Callable:
    """The program stored under ``key``, built (and stored) on first use."""
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
