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


def test_the_noise_aware_linear_regression_is_the_posterior_given_the_releases():
    """``second_moment_mixture`` against the posterior computed by quadrature, one coordinate: prior ``w ~ N(0,
    1)``, ``h~ | w, B ~ N(B w, B + V)``, ``B~ | B ~ N(B, v)``, ``B >= 0`` flat; ``h~ = 30``, ``B~ = 20``, ``V =
    40``, ``v = 36`` (the released second moment's noise sd 6, 30% of it: far from the first-order regime). The
    posterior mean and sd on a 4,001 x 2,801 grid against the mixture's 2,000 importance-weighted draws (a
    fixed key): both within 0.1 sd (the draws' Monte Carlo error is ~0.03 sd; measured 0.007 and 0.0002 sd).
    Without the second moment's noise (``v = 0``) the result is the noisy observation's posterior at ``B~``
    (to float32 rounding)."""
    import jax.numpy as jnp
    from scipy import stats

    from numpyro_dppvi.pvi.noise_aware import noisy_observation_factor
    from numpyro_dppvi.vips.linear import gaussian_moments, second_moment_mixture

    h, released, big_v, v = 30.0, 20.0, 40.0, 36.0
    w, b = np.meshgrid(np.linspace(-6.0, 8.0, 2801), np.linspace(1e-6, 80.0, 4001))
    log_p = (stats.norm.logpdf(w) + stats.norm.logpdf(h, b * w, np.sqrt(b + big_v))
             + stats.norm.logpdf(released, b, np.sqrt(v)))
    p = np.exp(log_p - log_p.max())
    p /= p.sum()
    mean = (p * w).sum()
    sd = np.sqrt((p * (w - mean) ** 2).sum())
    m, c = second_moment_mixture(jnp.array([h]), jnp.array([[released]]), jnp.zeros(1), jnp.eye(1), big_v, v)
    assert abs(float(m[0]) - mean) < 0.1 * sd
    assert abs(float(np.sqrt(c[0, 0])) - sd) < 0.1 * sd

    h3, b3 = jnp.asarray([40.0, -20.0, 10.0]), jnp.asarray([[40.0, 3.0, 0.0], [3.0, 30.0, 2.0], [0.0, 2.0, 20.0]])
    m0, c0 = second_moment_mixture(h3, b3, jnp.zeros(3), jnp.eye(3), 5.0, 0.0)
    info, curvature = noisy_observation_factor(h3, b3, 5.0 * jnp.eye(3))
    m1, c1 = gaussian_moments(info, jnp.eye(3) + curvature)
    np.testing.assert_allclose(m0, m1, rtol=1e-4)  # float32 means of 2,000 equal terms
    np.testing.assert_allclose(c0, c1, rtol=1e-4)
