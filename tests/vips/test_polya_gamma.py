"""Polya-Gamma mean: closed form against Monte Carlo draws of the series representation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_dppvi.vips import polya_gamma_mean, sample_polya_gamma


@pytest.mark.parametrize("c", [0.0, 0.5, 2.0, 6.0])
def test_mean_matches_monte_carlo(c):
    """20,000 draws; Var PG(1, c) <= Var PG(1, 0) = 1/24, so the Monte Carlo standard error is
    <= 0.0015. The truncated series (1,000 terms) is low by < 1/(2 pi^2 1000) = 5e-5.
    Tolerance: 4 standard errors of the actual draws plus the truncation bias."""
    draws = np.asarray(sample_polya_gamma(jax.random.key(7), jnp.asarray(c), num_draws=20_000))
    stderr = draws.std() / np.sqrt(draws.size)
    assert abs(draws.mean() - float(polya_gamma_mean(c))) < 4 * stderr + 5e-5


def test_mean_formula_and_maximum():
    c = jnp.linspace(-20.0, 20.0, 4001)
    mean = polya_gamma_mean(c)
    assert float(jnp.max(mean)) == pytest.approx(0.25, abs=1e-7)
    assert float(polya_gamma_mean(0.0)) == 0.25
    np.testing.assert_allclose(polya_gamma_mean(3.0), np.tanh(1.5) / 6.0, rtol=1e-6)
    positive = np.asarray(mean[c >= 0])
    assert np.all(np.diff(positive) <= 1e-7), "E[omega] must decrease in |c|"
    np.testing.assert_allclose(mean, mean[::-1], rtol=1e-6)  # even in c


def test_mean_is_smooth_near_zero():
    grad = jax.grad(polya_gamma_mean)
    assert np.isfinite(float(grad(0.0))) and np.isfinite(float(grad(1e-4)))
    np.testing.assert_allclose(polya_gamma_mean(1e-3 * 0.999), polya_gamma_mean(1e-3 * 1.001), rtol=1e-6)
