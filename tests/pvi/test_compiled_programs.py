"""Compiled programs are reused across fits of the same structure (issue 13).

JAX reports every compilation through ``jax.monitoring`` (``/jax/core/compile/...`` events); a
second ``fit_dppvi`` of the same model, settings and data shapes (and a resume, or another
``init``) must trigger none: the model is traced once per model and row shapes, and each round
program is built once per structure (``numpyro_dppvi.cache``).
"""

import jax
import numpy as np
import pytest
from jax import monitoring

import numpyro_dppvi as dppvi
from numpyro_dppvi.privacy import Privacy

from .conftest import logistic

COMPILE_EVENTS = []
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kwargs: COMPILE_EVENTS.append(name) if "/compile/" in name else None)


def clients(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(150, 3)).astype(np.float32)
    y = (rng.uniform(size=150) < 1 / (1 + np.exp(-x @ np.array([1.0, -1.0, 0.5])))).astype(np.float32)
    return dppvi.partition((x, y), num_clients=3, seed=seed)


@pytest.mark.parametrize("options", [
    dict(),
    dict(method="dp_optimisation", batch_size=10, privacy=Privacy(noise_multiplier=1.0, clip=1.0)),
    dict(method="virtual_clients", privacy=Privacy(noise_multiplier=1.0, clip=1.0)),
], ids=["pvi", "dp_optimisation", "virtual_clients"])
def test_a_second_fit_of_the_same_structure_compiles_nothing(options, tmp_path):
    kwargs = dict(schedule="synchronous", rounds=2, local_steps=3, num_samples=2, **options)
    first = dppvi.fit_dppvi(logistic, clients(0), checkpoint=tmp_path / "fit.ckpt", **kwargs)
    COMPILE_EVENTS.clear()
    second = dppvi.fit_dppvi(logistic, clients(1), **kwargs)  # other data, same shapes
    resumed = dppvi.fit_dppvi(logistic, clients(0), resume=tmp_path / "fit.ckpt", **dict(kwargs, rounds=3))
    assert COMPILE_EVENTS == []
    assert second.rounds == 2 and resumed.rounds == 3 and first.rounds == 2
    # a different structure (more clients) does compile: the check can fail
    dppvi.fit_dppvi(logistic, clients(0) + clients(1), **kwargs)
    assert COMPILE_EVENTS
