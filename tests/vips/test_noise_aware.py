"""Noise-aware VIPS (issue 23): the noise the releases leave in the final natural parameters has the variance
``release_noise_variance`` says, and the noise-aware step is post-processing (same ledger, the fitted parameters
kept as they are)."""

import jax
import numpy as np
import pytest

from numpyro_dppvi import Privacy, load
from numpyro_dppvi.vips import fit_vips
from numpyro_dppvi.vips.fit import release_noise_variance
from numpyro_dppvi.vips import BayesianLinearRegression, PolyaGammaLogisticRegression


def data(n=200, dim=3, seed=0):
    rng = np.random.default_rng(seed)
    x = np.clip(rng.normal(size=(n, dim)), -2.0, 2.0)
    y = np.clip(x @ rng.normal(size=dim) + rng.normal(size=n), -6.0, 6.0)
    return x, y


MODEL = BayesianLinearRegression(3, 1.0, feature_bound=2.0 * np.sqrt(3), target_bound=6.0)


def test_the_reported_noise_variance_is_the_noise_in_the_fitted_parameters():
    """A full batch (rate 1: every row in every step) makes ``eta``'s data part the same sum at every step, so
    across keys the fitted ``eta`` varies by the release noise alone: its variance per coordinate must be
    ``release_noise_variance(...)["xy"]``. 60 keys x 3 coordinates: the pooled ratio of sample to reported
    variance has a standard error of sqrt(2 / 177) = 0.11; the tolerance 0.35 is three of them."""
    x, y = data()
    privacy = Privacy(noise_multiplier=2.0, accountant="rdp")
    fits = [fit_vips(MODEL, (x, y), privacy=privacy, steps=10, rng_key=jax.random.key(k)) for k in range(60)]
    etas = np.stack([np.asarray(f.params_fitted["eta"], np.float64) for f in fits])
    ratio = np.mean(np.var(etas, axis=0, ddof=1)) / fits[0].info["release_noise_variance"]["xy"]
    assert abs(ratio - 1.0) < 0.35, ratio


def test_release_noise_variance_follows_the_blending():
    """One step of size 1 keeps only its own release; two steps of 1/2 after a first of 1: weights (1/4, 1/4,
    1/2) after blending, so the variance is ``(1/16 + 1/16 + 1/4)`` of one release's."""
    one = release_noise_variance(np.asarray([1.0]), 2.0, 0.5, {"xy": 3.0})["xy"]
    assert one == pytest.approx((2.0 * 3.0 * 0.5) ** 2)
    three = release_noise_variance(np.asarray([1.0, 0.5, 0.5]), 2.0, 0.5, {"xy": 3.0})["xy"]
    assert three == pytest.approx(one * (1 / 16 + 1 / 16 + 1 / 4))


def test_the_noise_aware_step_is_post_processing(tmp_path):
    """Same key with and without the step: the same ledger, and ``params_fitted`` is the plain fit's ``params``
    (the step only reads them, with public values); the noise-aware posterior is wider; save/load keeps both.
    Models without the step refuse ``noise_aware=True`` and fit as before by default."""
    x, y = data()
    privacy = Privacy(epsilon=1.0, delta=1e-5)
    aware = fit_vips(MODEL, (x, y), privacy=privacy, batch_size=50, steps=20, rng_key=jax.random.key(1))
    plain = fit_vips(MODEL, (x, y), privacy=privacy, batch_size=50, steps=20, rng_key=jax.random.key(1),
                     noise_aware=False)
    assert aware.noise_aware and not plain.noise_aware and plain.params_fitted is None
    assert aware.privacy == plain.privacy
    for name in ("eta", "precision"):
        np.testing.assert_array_equal(np.asarray(aware.params_fitted[name]), np.asarray(plain.params[name]))
    assert np.all(np.linalg.eigvalsh(np.asarray(plain.params["precision"]) - np.asarray(aware.params["precision"]))
                  > -1e-4)
    aware.save(tmp_path / "vips.npz")
    loaded = load(tmp_path / "vips.npz")
    for name in ("eta", "precision"):
        np.testing.assert_array_equal(np.asarray(loaded.params_fitted[name]), np.asarray(aware.params_fitted[name]))
        np.testing.assert_array_equal(np.asarray(loaded.params[name]), np.asarray(aware.params[name]))
    logistic = PolyaGammaLogisticRegression(3, feature_bound=2.0 * np.sqrt(3))
    labels = (y > 0).astype(np.float32)
    with pytest.raises(ValueError, match="noise_aware=True"):
        fit_vips(logistic, (x, labels), privacy=privacy, batch_size=50, steps=5, noise_aware=True)
    assert not fit_vips(logistic, (x, labels), privacy=privacy, batch_size=50, steps=5).noise_aware


def test_the_curvature_noise_covariance_is_that_of_the_mean_moved_by_the_release_noise():
    """``curvature_noise_covariance`` against Monte Carlo: the release mechanism itself (``add_symmetric_noise``)
    perturbs a fixed precision ``Lambda`` 4,000 times, the mean ``(Lambda + E)^-1 Lambda m`` is recomputed, and its
    sample covariance must match the first-order formula. The noise (sd 0.02 against eigenvalues 1-3) keeps the
    second-order terms below 1%; the sample variance's relative standard error is sqrt(2 / 3999) = 0.022, so each
    diagonal entry is checked to 0.1 (4.5 standard errors) and the off-diagonal entries to 0.1 of the diagonal
    scale. A formula that forgot the shared off-diagonal entries (``m m^T``) is off by 17% on a diagonal entry and
    by 0.29 of the scale off it; one that doubled the diagonal's noise, by 63% on a diagonal entry."""
    import jax.numpy as jnp
    from numpyro_dppvi.privacy.mechanisms import add_symmetric_noise
    from numpyro_dppvi.vips.linear import curvature_noise_covariance

    jax.config.update("jax_enable_x64", True)
    try:
        precision = jnp.asarray([[2.0, 0.5, 0.2], [0.5, 1.5, -0.3], [0.2, -0.3, 3.0]])
        mean = jnp.asarray([1.0, -2.0, 0.5])
        std = 0.02
        noisy = jax.vmap(lambda k: add_symmetric_noise(k, precision, std))(jax.random.split(jax.random.key(7), 4000))
        moved = jax.vmap(lambda p: jnp.linalg.solve(p, precision @ mean))(noisy)
        sample = np.cov(np.asarray(moved, np.float64).T)
        predicted = np.asarray(curvature_noise_covariance(mean, precision, std**2))
    finally:
        jax.config.update("jax_enable_x64", False)
    scale = np.sqrt(np.outer(np.diag(predicted), np.diag(predicted)))
    assert np.all(np.abs(np.diag(sample) / np.diag(predicted) - 1.0) < 0.1), (sample, predicted)
    assert np.all(np.abs(sample - predicted) / scale < 0.1), (sample, predicted)


def test_the_noise_aware_linear_regression_widens_for_the_noise_in_the_second_moment():
    """The noise-aware posterior keeps the noise-aware mean and adds the curvature term to its covariance: with
    ``noise_variance["xx"] = 0`` it is the ``xy``-only posterior, and a positive ``xx`` variance widens every
    coordinate by exactly ``curvature_noise_covariance``."""
    import jax.numpy as jnp
    from numpyro_dppvi.vips.linear import curvature_noise_covariance, gaussian_moments

    params = {"eta": jnp.asarray([40.0, -20.0, 10.0]), "precision": jnp.asarray([[41.0, 3.0, 0.0], [3.0, 31.0, 2.0],
                                                                                  [0.0, 2.0, 21.0]])}
    quiet = MODEL.noise_aware_params(params, {"xy": 5.0, "xx": 0.0})
    noisy = MODEL.noise_aware_params(params, {"xy": 5.0, "xx": 3.0})
    mean_q, cov_q = gaussian_moments(quiet["eta"], quiet["precision"])
    mean_n, cov_n = gaussian_moments(noisy["eta"], noisy["precision"])
    np.testing.assert_allclose(mean_n, mean_q, rtol=1e-4)
    np.testing.assert_allclose(cov_n - cov_q, curvature_noise_covariance(mean_q, params["precision"], 3.0),
                               rtol=1e-3, atol=1e-7)
