"""Logistic regression on UCI Adult with 10 clients (Sharma et al. 2019, Table 5; Heikkila et al. 2023, §5).

Table 5 reports 85.2 % / -0.318 (balanced, data set A) and 85.1 % (data set C: rho 0.7, kappa -3) for
non-private PVI. The thresholds (0.84, -0.33) sit about one percentage point below the paper; across
seeds our runs land at 0.848-0.853 accuracy and -0.318 to -0.323 log-likelihood, so these bounds leave
a margin of ~0.008 for Monte Carlo and batch noise while a broken update (e.g. a lost prior or wrong
cavity) drops accuracy below 0.83.
"""

import jax
import optax
import pytest

import numpyro_dppvi as dppvi

from .conftest import logistic

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("rho,kappa", [(0.0, 0.0), (0.7, -3.0)], ids=["balanced", "unbalanced"])
def test_pvi_adult_reaches_paper_accuracy(adult, rho, kappa):
    x, y, x_test, y_test = adult
    clients = dppvi.partition((x, y), num_clients=10, rho=rho, kappa=kappa, labels=y, seed=0)
    result = dppvi.fit_dppvi(logistic, clients, schedule="sequential", rounds=10, local_steps=50, batch_size=100,
                             optimizer=optax.adam(1e-2), damping=1.0, rng_key=jax.random.key(0),
                             eval_data=(x_test, y_test))
    last = result.history[-1]
    assert last["accuracy"] >= 0.84, last
    if rho == 0.0:
        assert last["log_lik"] >= -0.33, last
    assert last["communications"] == 100


def test_synchronous_balanced(adult):
    x, y, x_test, y_test = adult
    clients = dppvi.partition((x, y), num_clients=10, seed=0)
    result = dppvi.fit_dppvi(logistic, clients, schedule="synchronous", rounds=10, local_steps=50, batch_size=100,
                             optimizer=optax.adam(1e-2), damping=0.2, rng_key=jax.random.key(0),
                             eval_data=(x_test, y_test))
    assert result.history[-1]["accuracy"] >= 0.84
    assert result.history[-1]["log_lik"] >= -0.33


def test_baselines_adult(adult):
    x, y, x_test, y_test = adult
    clients = dppvi.partition((x, y), num_clients=10, seed=0)
    g = dppvi.fit_global_vi(logistic, clients, steps=500, steps_per_round=100, rng_key=jax.random.key(0),
                            eval_data=(x_test, y_test))
    assert g.history[-1]["accuracy"] >= 0.84 and g.history[-1]["communications"] == 5000
    same = dppvi.fit_bcm(logistic, clients, prior="same", local_steps=500, eval_data=(x_test, y_test))
    assert same.history[-1]["accuracy"] >= 0.84 and same.history[-1]["communications"] == 10


@pytest.mark.parametrize("rho,kappa,acc,ll", [(0.0, 0.0, 0.835, -0.36), (0.7, -3.0, 0.825, -0.40)],
                         ids=["balanced", "unbalanced"])
def test_dp_optimisation_adult_epsilon_1(adult, rho, kappa, acc, ll):
    """Issue 3 targets at epsilon = 1, delta = 1e-5 (the 2019 paper: 85.0 % / -0.333 and 82.5 % / -0.407).

    Measured with these settings and seed: 0.846 / -0.329 (balanced), 0.835 / -0.353 (unbalanced).
    """
    from numpyro_dppvi.privacy import Privacy

    x, y, x_test, y_test = adult
    clients = dppvi.partition((x, y), num_clients=10, rho=rho, kappa=kappa, labels=y, seed=0)
    result = dppvi.fit_dppvi(logistic, clients, method="dp_optimisation",
                             privacy=Privacy(epsilon=1.0, delta=1e-5, clip=2.0), schedule="sequential", rounds=5,
                             local_steps=20, batch_size=100, optimizer=optax.adam(1e-2), damping=0.5,
                             rng_key=jax.random.key(0), eval_data=(x_test, y_test))
    last = result.history[-1]
    assert result.privacy.epsilon <= 1.0
    assert last["accuracy"] >= acc and last["log_lik"] >= ll, last


@pytest.mark.parametrize("trusted,threshold", [(False, 0.82), (True, 0.835)], ids=["sequential", "trusted"])
def test_virtual_clients_adult_epsilon_1(adult, trusted, threshold):
    """Issue 4 targets on the balanced split at epsilon = 1 with the settings of examples/adult_dppvi.py
    (one row per virtual client, natural-gradient local steps, precision floor 10). Measured with seeds
    0 and 1: 0.840 / 0.841 (sequential, one round) and 0.842 / 0.842 (trusted aggregator, 5 rounds)."""
    from numpyro_dppvi.optim import natural_gradient
    from numpyro_dppvi.privacy import Privacy

    x, y, x_test, y_test = adult
    clients = dppvi.partition((x, y), num_clients=10, seed=0)
    schedule, rounds, damping = ("synchronous", 5, 0.1) if trusted else ("sequential", 1, 0.15)
    result = dppvi.fit_dppvi(logistic, clients, method="virtual_clients", privacy=Privacy(epsilon=1.0, clip=1.0),
                             schedule=schedule, trusted_aggregator=trusted, rounds=rounds, local_steps=10,
                             optimizer=natural_gradient(0.5), damping=damping, shards=lambda n: n,
                             invalid="floor", precision_floor=10.0, rng_key=jax.random.key(0),
                             eval_data=(x_test, y_test))
    assert result.privacy.epsilon <= 1.0
    assert result.history[-1]["accuracy"] >= threshold, result.history[-1]


def test_dp_bcm_same_resets_coordinates_less_certain_than_the_prior(adult):
    """DP BCM (same prior) on Adult at epsilon 1: ``sum_k eta_qk - 9 eta_p`` falls below the prior's precision
    on rarely seen one-hot coordinates (measured: 12-22 of 109 with keys 0-5, one of them improper for keys
    1 and 5, the key used here). ``invalid="raise"`` refuses; the default resets those coordinates to the prior,
    counts them, warns, and the rest of the posterior still predicts (measured 0.820-0.824; bound 0.80 leaves the
    key-to-key spread of DP noise)."""
    x, y, x_test, y_test = adult
    clients = dppvi.partition((x, y), num_clients=10, labels=y, seed=0)
    settings = dict(prior="same", local_steps=100, optimizer=optax.adam(1e-2), rng_key=jax.random.key(1),
                    privacy=dppvi.Privacy(epsilon=1.0, clip=2.0, adaptive_clip=None))  # the measured, fixed clip
    with pytest.raises(ValueError, match="not a proper Gaussian.*invalid='prior'"):
        dppvi.fit_bcm(logistic, clients, invalid="raise", **settings)
    with pytest.warns(dppvi.diagnostics.PosteriorRuleWarning, match="reset to the prior"):
        result = dppvi.fit_bcm(logistic, clients, eval_data=(x_test, y_test), **settings)
    reset = result.history[0]["reset_to_prior"]
    assert 1 <= reset <= 109 // 3, reset
    assert result.history[0]["accuracy"] >= 0.80
    prior_precision = 1.0
    precision = -2.0 * jax.numpy.asarray(result.q.eta2)
    assert int(jax.numpy.sum(precision == prior_precision)) >= reset
    assert bool(jax.numpy.all(precision >= prior_precision))
