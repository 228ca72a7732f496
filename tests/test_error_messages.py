"""Every error message names the function the user called and an option it really takes (issue 14)."""

import inspect
import math
import re
import time

import jax
import numpy as np
import optax
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi.privacy import Privacy

from .pvi.conftest import logistic


def clients(m=3, n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m * n, 2)).astype(np.float32)
    y = (rng.uniform(size=m * n) < 0.5).astype(np.float32)
    return dppvi.partition((x, y), num_clients=m, seed=seed)


def named_options(message: str) -> set[str]:
    """The ``option`` / ``option=`` names a message puts in backquotes or before ``=``."""
    return set(re.findall(r"`(\w+)`", message)) | set(re.findall(r"\b(\w+)=", message))


def assert_options_exist(message: str, function) -> None:
    taken = set(inspect.signature(function).parameters)
    named = named_options(message) - {"epsilon", "delta", "clip", "noise_multiplier"}  # Privacy(...) fields
    assert named, message
    assert named <= taken, (named - taken, message)


@pytest.mark.parametrize("caller,function", [("fit_global_vi", dppvi.fit_global_vi), ("fit_dppvi", dppvi.fit_dppvi),
                                             ("fit_bcm", dppvi.fit_bcm)])
def test_divergence_advice_names_the_callers_own_options(caller, function):
    """fit_global_vi has no damping or local_steps: its advice names the learning rate and steps_per_round;
    each entry point's advice names options it takes (a state whose cavity is improper cannot continue)."""
    from numpyro_dppvi.factors import Gaussian

    driver = dppvi.DPPVI(logistic, local_steps=2, family="mean_field")  # whose step needs a proper cavity
    driver.caller = caller
    state = driver.init(jax.random.key(0), clients())
    state = state._replace(factors=Gaussian(state.factors.eta1, state.factors.eta2.at[0].set(-50.0)))
    with pytest.raises(FloatingPointError) as info:
        driver.round(state)
    message = str(info.value)
    assert caller in message and ("damping" in message) == (caller == "fit_dppvi")
    assert_options_exist(message, function)


def test_bcm_invalid_posterior_advice_names_its_own_options():
    with pytest.raises(ValueError) as info:
        dppvi.fit_bcm(logistic, clients(), local_steps=20, batch_size=20, optimizer=optax.sgd(1e6),
                      rng_key=jax.random.key(0))
    message = str(info.value)
    assert "fit_bcm" in message and "damping" not in message
    assert_options_exist(message, dppvi.fit_bcm)


def test_a_budget_passed_to_fit_dppvi_points_to_privacy():
    with pytest.raises(TypeError, match=r"fit_dppvi\(\).*privacy=dppvi\.Privacy\(epsilon="):
        dppvi.fit_dppvi(logistic, clients(), method="dp_optimisation", batch_size=5, epsilon=1.0)


def test_a_nan_names_the_client_the_array_and_the_row():
    data = clients()
    data[1][0][7, 1] = math.nan
    with pytest.raises(ValueError, match=r"array 0 of client 1 contains NaN or inf in 1 row\(s\) \(7\)"):
        dppvi.fit_dppvi(logistic, data, rounds=1, rng_key=jax.random.key(0))


def test_a_batch_as_large_as_a_client_is_refused_at_once_with_a_working_size():
    """Names the clients, their sizes and a batch size that works; before the model is traced."""
    data = clients(n=40)
    data[2] = tuple(a[:3] for a in data[2])
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        dppvi.fit_dppvi(logistic, data, method="dp_optimisation", batch_size=10,
                        privacy=Privacy(noise_multiplier=1.0), rng_key=jax.random.key(0))
    assert time.perf_counter() - start < 2.0
    message = str(info.value)
    assert message.startswith("fit_dppvi: batch_size=10") and "client(s) [2]" and "sizes [3]" in message
    assert "batch_size <= 1" in message
    assert_options_exist(message, dppvi.fit_dppvi)


def test_local_averaging_without_shards_or_batch_size_names_both():
    with pytest.raises(ValueError) as info:
        dppvi.fit_dppvi(logistic, clients(), method="local_averaging", privacy=Privacy(noise_multiplier=1.0))
    assert "shards=" in str(info.value) and "batch_size" in str(info.value)
    result = dppvi.fit_dppvi(logistic, clients(), method="local_averaging", batch_size=10, rounds=1,
                             privacy=Privacy(noise_multiplier=1.0), rng_key=jax.random.key(0))
    assert result.config["shards"] == [4, 4, 4]  # ceil(40 / 10): the papers' default


def test_a_non_private_result_says_so():
    result = dppvi.fit_dppvi(logistic, clients(), rounds=1, rng_key=jax.random.key(0))
    assert not result.is_private
    assert "NOT differentially private" in result.privacy.report()


def test_fit_dppvi_vips_names_the_options_it_takes():
    from numpyro_dppvi.vips import BayesianLinearRegression

    model = BayesianLinearRegression(2, noise_scale=1.0)
    data = [(c[0], c[1]) for c in clients()]
    with pytest.raises(TypeError, match=r"fit_dppvi\(method='vips'\) does not take \['local_steps'\]; it takes"):
        dppvi.fit_dppvi(model, data, method="vips", local_steps=5)
