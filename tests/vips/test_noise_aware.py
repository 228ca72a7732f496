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
    fits = [fit_vips(MODEL, (x, y), privacy=privacy, steps=10, rng_key=jax.random.key(k), noise_aware=False)
            for k in range(60)]
    etas = np.stack([np.asarray(f.params["eta"], np.float64) for f in fits])
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
    for saved, restored in zip(jax.tree_util.tree_leaves(aware.params), jax.tree_util.tree_leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(saved))  # the mixture included
    logistic = PolyaGammaLogisticRegression(3, feature_bound=2.0 * np.sqrt(3))
    labels = (y > 0).astype(np.float32)
    with pytest.raises(ValueError, match="noise_aware=True"):
        fit_vips(logistic, (x, labels), privacy=privacy, batch_size=50, steps=5, noise_aware=True)
    assert not fit_vips(logistic, (x, labels), privacy=privacy, batch_size=50, steps=5).noise_aware


def test_the_linear_statistics_are_blended_as_released_and_so_stay_unbiased():
    """Linear regression's statistics do not depend on q, so ``fit_vips`` blends the noisy releases as they are
    (``deferred_validity``) instead of projecting every step onto the positive semi-definite cone. With 200 rows
    and noise multiplier 10 a step's noise in ``X^T X`` (sd ~170 per entry) is as large as ``X^T X`` itself
    (~200 I): a per-step projection would add a positive bias of the order of that sd to the diagonal. Over 30
    keys (full batch, 100 steps, the default running mean) the fitted ``B = Lambda - Lambda0`` must average to
    ``X^T X``: the tolerance is 4 standard errors of the mean, estimated from the 30 fits."""
    x, y = data()
    privacy = Privacy(noise_multiplier=10.0, accountant="rdp")
    residuals = []
    for k in range(30):
        fit = fit_vips(MODEL, (x, y), privacy=privacy, steps=100, rng_key=jax.random.key(k), noise_aware=False)
        assert fit.info["kappa"] == 1.0 and fit.info["final_projection"] is False
        bounded = np.clip(x, -2.0, 2.0)  # all rows lie inside the feature bound
        residuals.append(np.diag(np.asarray(fit.params["precision"], np.float64) - np.eye(3) - bounded.T @ bounded))
    residuals = np.stack(residuals)
    se = residuals.std(axis=0, ddof=1) / np.sqrt(len(residuals))
    assert np.all(np.abs(residuals.mean(axis=0)) < 4 * se), (residuals.mean(axis=0), se)


def _one_dimensional_posterior(prior_precision, h, b_noisy, xy_variance, xx_variance):
    """Mean and variance of ``w`` under the model of ``noisy_statistics_posterior`` for D = 1, by quadrature over
    ``B`` (a grid of 200,001 points over +-12 sds of the release noise, clipped to ``B >= 0``)."""
    from scipy.stats import norm

    grid = np.linspace(max(0.0, b_noisy - 12 * np.sqrt(xx_variance)), b_noisy + 12 * np.sqrt(xx_variance), 200_001)
    log_density = (norm.logpdf(b_noisy, grid, np.sqrt(xx_variance))
                   + norm.logpdf(h, 0.0, np.sqrt(grid + xy_variance + grid**2 / prior_precision)))
    weight = np.exp(log_density - log_density.max())
    weight /= weight.sum()
    precision = prior_precision + grid**2 / (grid + xy_variance)
    means = grid / (grid + xy_variance) * h / precision
    mean = np.sum(weight * means)
    return mean, np.sum(weight * (1.0 / precision + means**2)) - mean**2


def test_the_noise_aware_posterior_is_the_exact_posterior_of_the_noisy_statistics():
    """D = 1, where the posterior of ``w`` given the released ``h~`` and ``B~`` is a one-dimensional integral over
    ``B``: the importance-sampled mixture (20,000 draws) must match quadrature. The noise in ``B`` (sd 1.5 against
    ``B~ = 4``) is where a first-order correction fails: the posterior at ``B = B~`` alone differs from the exact
    one's variance by 13%, over twice the tolerance (checked). Tolerances from the Monte Carlo error of self-normalised
    importance sampling with an effective sample size above 10,000: the mean to 0.03 sd, the variance to 5% (both
    about 4 standard errors)."""
    import jax.numpy as jnp
    from numpyro_dppvi.vips.linear import mixture_moments, noisy_statistics_posterior

    prior_precision, h, b_noisy, xy_variance, xx_variance = 1.0, 5.0, 4.0, 2.0, 1.5**2
    exact_mean, exact_variance = _one_dimensional_posterior(prior_precision, h, b_noisy, xy_variance, xx_variance)
    weights, means, trils = noisy_statistics_posterior(
        jnp.zeros(1), jnp.eye(1) * prior_precision, jnp.asarray([h]), jnp.asarray([[prior_precision + b_noisy]]),
        xy_variance, xx_variance, jax.random.key(3), num_draws=20_000)
    assert 1.0 / float(jnp.sum(weights**2)) > 10_000
    mean, covariance = mixture_moments(weights, means, trils)
    sd = np.sqrt(exact_variance)
    assert abs(float(mean[0]) - exact_mean) < 0.03 * sd, (float(mean[0]), exact_mean)
    assert abs(float(covariance[0, 0]) / exact_variance - 1.0) < 0.05, (float(covariance[0, 0]), exact_variance)
    plug_in_precision = prior_precision + b_noisy**2 / (b_noisy + xy_variance)
    assert abs(1.0 / plug_in_precision / exact_variance - 1.0) > 0.1  # the plug-in B = B~ (13% off) fails the 5%


def test_without_noise_in_the_second_moment_the_mixture_is_the_noisy_observation_factor():
    """``xx_variance`` -> 0: every draw is ``B~`` and the posterior is the prior times the factor ``(B (B + V)^-1 h,
    B (B + V)^-1 B)`` of :func:`noisy_observation_factor`, in closed form (to float32 round-off)."""
    import jax.numpy as jnp
    from numpyro_dppvi.pvi.noise_aware import noisy_observation_factor
    from numpyro_dppvi.vips.linear import gaussian_moments

    params = {"eta": jnp.asarray([40.0, -20.0, 10.0]), "precision": jnp.asarray([[41.0, 3.0, 0.0], [3.0, 31.0, 2.0],
                                                                                  [0.0, 2.0, 21.0]])}
    aware = MODEL.noise_aware_params(params, {"xy": 5.0, "xx": 1e-12})
    h, b = noisy_observation_factor(params["eta"], params["precision"] - jnp.eye(3), 5.0 * jnp.eye(3))
    mean, covariance = gaussian_moments(h, jnp.eye(3) + b)
    got_mean, got_covariance = gaussian_moments(aware["eta"], aware["precision"])
    np.testing.assert_allclose(got_mean, mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got_covariance, covariance, rtol=1e-3, atol=1e-7)


def test_a_noise_aware_fit_samples_its_mixture():
    """A private fit is noise-aware by default and ``sample()`` draws from its mixture: 20,000 draws match the
    mixture's mean and covariance (``eta``, ``precision``) to 5 Monte Carlo standard errors (sd / sqrt(n) for a
    mean, about sqrt(2 / n) sd^2 for a covariance entry)."""
    from numpyro_dppvi.vips.linear import gaussian_moments

    x, y = data()
    fit = fit_vips(MODEL, (x, y), privacy=Privacy(epsilon=1.0, delta=1e-5), batch_size=50, steps=20,
                   rng_key=jax.random.key(2))
    assert "mixture" in fit.params and fit.info["noise_aware_effective_draws"] > 100
    draws = np.asarray(fit.sample(20_000, rng_key=jax.random.key(4))["w"], np.float64)
    mean, covariance = (np.asarray(a, np.float64) for a in gaussian_moments(fit.params["eta"], fit.params["precision"]))
    sd = np.sqrt(np.diag(covariance))
    assert np.all(np.abs(draws.mean(axis=0) - mean) < 5 * sd / np.sqrt(len(draws)))
    np.testing.assert_allclose(np.cov(draws.T), covariance, atol=5 * np.sqrt(2.0 / len(draws)) * np.outer(sd, sd).max())
