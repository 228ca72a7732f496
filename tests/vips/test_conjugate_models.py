"""Without noise, one full-batch VB step of every conjugate model is its closed-form posterior.

The comparisons run in float64 (``jax.enable_x64`` as a context manager, restored after
each test) so that 1e-6 is a statement about the algebra and not about float32 rounding.
"""

import jax
import numpy as np
import pytest

from numpyro_dppvi.vips import (
    BayesianLinearRegression, BetaBernoulli, DirichletCategorical, GammaPoisson,
    NormalGammaLinearRegression, fit_vips)

TOL = 1e-6


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _fit_batch(model, data, iterations=1, kappa=0.0):
    return fit_vips(model, data, iterations=iterations, kappa=kappa, tau0=1.0, rng_key=jax.random.key(0))


def _regression_data(n=150, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = x @ np.array([1.0, -2.0, 0.5])[:d] + 0.4 * rng.normal(size=n)
    return x, y


@pytest.mark.parametrize("iterations,kappa", [(1, 0.0), (5, 0.7)])
def test_linear_regression_known_noise_is_exact(x64, iterations, kappa):
    x, y = _regression_data()
    s2 = 0.4**2
    prior_mean = np.array([0.5, 0.0, -1.0])
    prior_prec = np.array([2.0, 1.0, 0.5])
    model = BayesianLinearRegression(3, noise_scale=0.4, prior_mean=prior_mean, prior_precision=prior_prec)
    result = _fit_batch(model, (x, y), iterations, kappa)
    precision = np.diag(prior_prec) + x.T @ x / s2
    mean = np.linalg.solve(precision, prior_prec * prior_mean + x.T @ y / s2)
    q = result.model.posterior_distribution(result.params)
    np.testing.assert_allclose(q.precision_matrix, precision, rtol=TOL)
    np.testing.assert_allclose(q.loc, mean, rtol=TOL, atol=TOL)


def test_normal_gamma_regression_is_exact(x64):
    x, y = _regression_data(seed=1)
    n = len(y)
    m0, l0, a0, b0 = np.array([0.1, 0.2, 0.3]), 2.0 * np.eye(3), 2.0, 3.0
    model = NormalGammaLinearRegression(3, prior_mean=m0, prior_precision=2.0, noise_concentration=a0,
                                        noise_rate=b0)
    result = _fit_batch(model, (x, y))
    ln = l0 + x.T @ x
    mn = np.linalg.solve(ln, l0 @ m0 + x.T @ y)
    an = a0 + n / 2
    bn = b0 + 0.5 * (y @ y + m0 @ l0 @ m0 - mn @ ln @ mn)
    np.testing.assert_allclose(result.params["precision"], ln, rtol=TOL)
    np.testing.assert_allclose(np.linalg.solve(result.params["precision"], result.params["eta"]), mn, rtol=TOL)
    np.testing.assert_allclose(result.params["a"], an, rtol=TOL)
    np.testing.assert_allclose(model.noise_rate_posterior(result.params), bn, rtol=TOL)


@pytest.mark.parametrize("total_count", [1, 5])
def test_beta_binomial_is_exact(x64, total_count):
    y = np.random.default_rng(2).binomial(total_count, 0.3, size=97)
    result = _fit_batch(BetaBernoulli(2.0, 3.0, total_count=total_count), (y,))
    np.testing.assert_allclose(result.params["alpha"], 2.0 + y.sum(), rtol=TOL)
    np.testing.assert_allclose(result.params["beta"], 3.0 + (total_count - y).sum(), rtol=TOL)


def test_dirichlet_categorical_is_exact(x64):
    y = np.random.default_rng(3).integers(0, 4, size=120)
    alpha0 = np.array([0.5, 1.0, 2.0, 3.0])
    result = _fit_batch(DirichletCategorical(alpha0), (y,))
    np.testing.assert_allclose(result.params["concentration"], alpha0 + np.bincount(y, minlength=4), rtol=TOL)


def test_gamma_poisson_is_exact(x64):
    y = np.random.default_rng(4).poisson(3.0, size=80)
    result = _fit_batch(GammaPoisson(2.0, 0.5), (y,))
    np.testing.assert_allclose(result.params["concentration"], 2.0 + y.sum(), rtol=TOL)
    np.testing.assert_allclose(result.params["rate"], 0.5 + len(y), rtol=TOL)


def test_minibatch_svb_is_unbiased_around_the_exact_posterior(x64):
    """With S < N the M-step target is ν + (N/S) sum_batch; its average over many
    iterations with a small constant step equals the exact posterior up to Monte Carlo error.
    Beta-Bernoulli, N = 200, S = 50: the std of (N/S) * batch successes is about 10, so the
    mean over 400 draws of the blended alpha is within ~1 of the truth; we allow 3."""
    y = np.random.default_rng(5).binomial(1, 0.4, size=200)
    result = fit_vips(BetaBernoulli(1.0, 1.0), (y,), batch_size=50, iterations=400, tau0=1.0, kappa=1.0,
                      rng_key=jax.random.key(1))
    # kappa = 1, tau0 = 1: rho_t = 1/(t+1), so the final alpha is the running mean of the targets.
    assert abs(float(result.params["alpha"]) - (1.0 + y.sum())) < 3.0
    assert all(set(h) == {"step", "rho"} for h in result.history)  # the realised batches stay private


def test_to_arviz_and_samples_have_site_shapes():
    y = np.random.default_rng(6).integers(0, 3, size=50)
    result = fit_vips(DirichletCategorical(np.ones(3)), (y,), iterations=1, kappa=0.0, rng_key=jax.random.key(0))
    idata = result.to_arviz(num_samples=200)
    assert idata.posterior["p"].shape == (4, 50, 3)
    assert not result.is_private and result.epsilon is None


def test_bad_inputs_get_clear_errors():
    y = np.array([0, 1, 1, 0])
    with pytest.raises(ValueError, match="batch_size"):
        fit_vips(BetaBernoulli(), (y,), batch_size=10, rng_key=jax.random.key(0))
    with pytest.raises(TypeError, match="rng_key"):
        fit_vips(BetaBernoulli(), (y,), rng_key=7)
    with pytest.raises(ValueError, match="integers"):
        fit_vips(BetaBernoulli(), (np.array([0, 2]),), rng_key=jax.random.key(0))
    with pytest.raises(ValueError, match="NaN"):
        fit_vips(GammaPoisson(), (np.array([0.0, np.nan]),), rng_key=jax.random.key(0))
    with pytest.raises(ValueError, match="kappa"):
        fit_vips(BetaBernoulli(), (y,), kappa=2.0, rng_key=jax.random.key(0))
