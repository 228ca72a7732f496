"""Clients, node configs and run configs for the Flower tests (every module skips without flwr).

The clients are small (three features, a few dozen rows) and the settings are shared across
modules, so the compiled local updates are reused from test to test.
"""

import os

import numpy as np
import pytest

MODEL = "numpyro_dppvi.flower.models:logistic_regression"
SIZES = (48, 64, 64)


def synthetic_clients(sizes=SIZES, seed=0):
    """Logistic-regression data with three features, one client per size."""
    rng = np.random.default_rng(seed)
    w = np.array([1.0, -1.0, 0.5])
    out = []
    for n in sizes:
        x = rng.normal(size=(n, 3)).astype(np.float32)
        y = (rng.uniform(size=n) < 1 / (1 + np.exp(-x @ w))).astype(np.float32)
        out.append((x, y))
    return out


def node_config(folder, m, client, method="dp_optimisation", **extra):
    """A node config for client ``m`` whose data are written to ``folder/c<m>/data.npz``."""
    folder = os.fspath(folder)
    state = os.path.join(folder, f"c{m}")
    os.makedirs(state, exist_ok=True)
    data = os.path.join(state, "data.npz")
    if not os.path.exists(data):
        np.savez(data, x=client[0], y=client[1])
    config = {"client-id": f"client-{m}", "state-dir": state, "data-file": data, "model": MODEL}
    if method == "pvi":
        config["allow-non-private"] = True
    else:
        config.update({"epsilon": 2.0, "delta": 1e-5})
    config.update(extra)
    return config


def run_config(method="dp_optimisation", schedule="synchronous", rounds=2, **extra):
    config = {"model": MODEL, "method": method, "schedule": schedule, "rounds": rounds, "local-steps": 5,
              "batch-size": 16, "learning-rate": 0.01, "damping": 0.5, "clip": 1.0, "poll-interval": 0.002}
    config.update(extra)
    return config


@pytest.fixture
def clients():
    return synthetic_clients()
