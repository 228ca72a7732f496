"""Federated VIPS through fit_dppvi(method="vips") (issue 5 item 4)."""

import jax
import numpy as np
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi.vips import BayesianLinearRegression


def data(n=300, m=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(n, 2)).astype(np.float32) / np.sqrt(2)
    y = np.clip(x @ np.array([1.0, -0.5]) + 0.3 * rng.normal(size=n), -1, 1).astype(np.float32)
    return x, y, dppvi.partition((x, y), num_clients=m, seed=seed)


def test_non_private_synchronous_round_is_the_pooled_closed_form():
    x, y, clients = data()
    model = BayesianLinearRegression(2, noise_scale=0.3, feature_bound=1.0, target_bound=1.0)
    result = dppvi.fit_dppvi(model, clients, method="vips", rounds=1, schedule="synchronous", damping=1.0)
    precision = np.eye(2) + x.T @ x / 0.09
    mean = np.linalg.solve(precision, x.T @ y / 0.09)
    draws = result.model.sample_posterior(result.params, jax.random.key(0), 20000)
    w = np.asarray(next(iter(draws.values())))
    # 20000 exact posterior draws: the Monte Carlo sd of the mean is sd / 141 ~ 1e-4 here
    np.testing.assert_allclose(w.mean(0), mean, atol=5 * np.sqrt(np.diag(np.linalg.inv(precision))).max() / 141)
    assert result.history[-1]["communications"] == 3


def test_private_federated_vips_meets_the_budget_with_a_trusted_aggregator():
    _, _, clients = data()
    model = BayesianLinearRegression(2, noise_scale=0.3, feature_bound=1.0, target_bound=1.0)
    privacy = dppvi.Privacy(epsilon=1.0, delta=1e-5, clip=1.0)
    result = dppvi.fit_dppvi(model, clients, method="vips", privacy=privacy, rounds=2, trusted_aggregator=True,
                             rng_key=jax.random.key(1))
    eps = result.privacy.epsilon_per_client
    assert eps.shape == (3,) and np.all(eps <= 1.0) and np.all(eps > 0.98)
    assert result.privacy.trusted_aggregator and result.privacy.num_releases(0) == 2
    with pytest.raises(TypeError, match="does not take"):
        dppvi.fit_dppvi(model, clients, method="vips", shards=3)


def test_sequential_schedule_matches_synchronous_for_exact_local_steps():
    """Linear regression has no local latents: each client's exact factor does not depend on q, so one
    undamped round gives the same posterior under both schedules."""
    _, _, clients = data()
    model = BayesianLinearRegression(2, noise_scale=0.3, feature_bound=1.0, target_bound=1.0)
    seq = dppvi.fit_dppvi(model, clients, method="vips", rounds=1, schedule="sequential")
    syn = dppvi.fit_dppvi(model, clients, method="vips", rounds=1, schedule="synchronous")
    for a, b in zip(jax.tree_util.tree_leaves(seq.params), jax.tree_util.tree_leaves(syn.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
