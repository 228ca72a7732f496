"""Noise-aware federated VIPS (issue 23): the sum of the clients' released factors carries the noise
``released_sum_noise_variance`` says, the noise-aware posterior is post-processing of it (same ledger, the fitted
parameters kept), and models without it fit as before."""

import jax
import numpy as np
import pytest

from numpyro_dppvi import Privacy, fit_dppvi
from numpyro_dppvi.vips import BayesianLinearRegression, PolyaGammaLogisticRegression
from numpyro_dppvi.vips.federated_fit import fit_federated_vips, released_sum_noise_variance

MODEL = BayesianLinearRegression(3, 1.0, feature_bound=2.0 * np.sqrt(3), target_bound=6.0)


def clients(n=300, num_clients=3, seed=0):
    rng = np.random.default_rng(seed)
    x = np.clip(rng.normal(size=(n, 3)), -2.0, 2.0)
    y = np.clip(x @ rng.normal(size=3) + rng.normal(size=n), -6.0, 6.0)
    return [(x[i::num_clients], y[i::num_clients]) for i in range(num_clients)]


def test_released_sum_noise_variance_follows_the_damping():
    """One undamped round: each of M clients' noise once, ``M (C_b s)^2``. Two rounds at damping 1/2: weights
    ``w = (1/4, 1/2)``, ``a = 3/4``, so ``M (C_b s)^2 (1/16 + 1/4) / (9/16) = M (C_b s)^2 5/9``."""
    one = released_sum_noise_variance(1.0, 1, 4, 0.5, {"xy": 3.0})["xy"]
    assert one == pytest.approx(4 * (3.0 * 0.5) ** 2)
    two = released_sum_noise_variance(0.5, 2, 4, 0.5, {"xy": 3.0})["xy"]
    assert two == pytest.approx(one * 5.0 / 9.0)


def test_the_reported_noise_variance_is_the_noise_in_the_released_sum():
    """The linear statistics do not depend on q, so across keys the fitted ``eta`` (prior + ``sum_m t_m``: the
    ``X^T y`` block, which the per-round projection of ``X^T X`` leaves alone) varies by the release noise alone, and
    ``sum_m t_m = a E`` with ``a = 1 - (1 - rho)^R``: its variance per coordinate must be ``a^2`` times the reported
    variance of ``E``. 60 keys x 3 coordinates (3 clients, 3 rounds at damping 1/2): the pooled ratio of sample to
    reported variance has a standard error of sqrt(2 / 177) = 0.11; the tolerance 0.35 is three of them."""
    data = clients()
    privacy = Privacy(noise_multiplier=2.0, accountant="rdp")
    fits = [fit_federated_vips(MODEL, data, privacy=privacy, rounds=3, damping=0.5, rng_key=jax.random.key(k),
                               noise_aware=False) for k in range(60)]
    etas = np.stack([np.asarray(f.params["eta"], np.float64) for f in fits])
    coverage = 1.0 - 0.5 ** 3
    ratio = np.mean(np.var(etas, axis=0, ddof=1)) / (coverage ** 2 * fits[0].info["release_noise_variance"]["xy"])
    assert abs(ratio - 1.0) < 0.35, ratio


@pytest.mark.parametrize("trusted", [False, True], ids=["local", "trusted"])
def test_the_noise_aware_step_is_post_processing(trusted):
    """Same key with and without the step: the same ledger, and ``params_fitted`` is the plain fit's ``params``;
    the noise-aware posterior is wider (it adds the noise's variance). A trusted aggregator's shares add up to one
    client's noise: the reported variance is ``1 / M`` of the clients' own noise."""
    data = clients()
    privacy = Privacy(epsilon=1.0, delta=1e-5)
    kwargs = dict(privacy=privacy, method="vips", rng_key=jax.random.key(1), trusted_aggregator=trusted)
    aware = fit_dppvi(MODEL, data, **kwargs)
    plain = fit_dppvi(MODEL, data, noise_aware=False, **kwargs)
    assert aware.noise_aware and not plain.noise_aware and plain.params_fitted is None
    assert aware.privacy == plain.privacy
    for name in ("eta", "precision"):
        np.testing.assert_array_equal(np.asarray(aware.params_fitted[name]), np.asarray(plain.params[name]))
    var = lambda p: np.diag(np.linalg.inv(np.asarray(p["precision"], np.float64)))  # noqa: E731
    assert np.all(var(aware.params) > var(plain.params))
    local = fit_dppvi(MODEL, data, noise_aware=False, **dict(kwargs, trusted_aggregator=False))
    expected = local.info["release_noise_variance"]["xy"] / (len(data) if trusted else 1)
    assert aware.info["release_noise_variance"]["xy"] == pytest.approx(expected, rel=1e-6)


def test_models_without_the_step_fit_as_before_and_refuse_it():
    """Polya-Gamma logistic regression's statistics depend on q: no noise-aware step by default, an error when
    asked for; a non-private fit refuses it too."""
    rng = np.random.default_rng(0)
    x = np.clip(rng.normal(size=(120, 2)), -2.0, 2.0)
    y = (rng.random(120) < 0.5).astype(np.float32)
    model = PolyaGammaLogisticRegression(2, feature_bound=2.0 * np.sqrt(2))
    data = [(x[:60], y[:60]), (x[60:], y[60:])]
    privacy = Privacy(epsilon=1.0, delta=1e-5)
    fit = fit_federated_vips(model, data, privacy=privacy, rng_key=jax.random.key(0))
    assert not fit.noise_aware and fit.params_fitted is None
    with pytest.raises(ValueError, match="noise_aware=True needs a private fit"):
        fit_federated_vips(model, data, privacy=privacy, rng_key=jax.random.key(0), noise_aware=True)
    with pytest.raises(ValueError, match="non-private"):
        fit_federated_vips(MODEL, clients(), noise_aware=True)
