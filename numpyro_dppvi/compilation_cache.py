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
would put them there).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from .privacy import accounting_memo

CACHE_ENV = "NUMPYRO_DPPVI_CACHE"


def default_cache_dir() -> Path:
    """``$NUMPYRO_DPPVI_CACHE`` if set and non-empty, else ``~/.cache/numpyro_dppvi/jax``."""
    configured = os.environ.get(CACHE_ENV, "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "numpyro_dppvi" / "jax"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Turn on JAX's persistent compilation cache in ``path`` (default :func:`default_cache_dir`) for
    every program, however quick to compile; returns the folder. Safe to call more than once."""
    folder = Path(path) if path is not None else default_cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # this user's: the accountant memo needs it so
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    accounting_memo.use(folder)
    return folder
