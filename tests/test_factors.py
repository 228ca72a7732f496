import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest

from numpyro_dppvi import factors
from numpyro_dppvi.factors import Gaussian


def test_loc_scale_round_trip():
    loc = jnp.array([0.3, -2.0, 5.0])
    scale = jnp.array([0.1, 1.0, 3.0])
    g = factors.from_loc_scale(loc, scale)
    np.testing.assert_allclose(g.eta1, loc / scale**2, rtol=1e-6)
    np.testing.assert_allclose(g.eta2, -0.5 / scale**2, rtol=1e-6)
    back_loc, back_scale = factors.to_loc_scale(g)
    np.testing.assert_allclose(back_loc, loc, rtol=1e-6)
    np.testing.assert_allclose(back_scale, scale, rtol=1e-6)


def test_product_and_quotient_are_inverse_and_match_gaussian_product():
    a = factors.from_loc_scale(jnp.array([1.0]), jnp.array([2.0]))
    b = factors.from_loc_scale(jnp.array([-1.0]), jnp.array([1.0]))
    ab = factors.multiply(a, b)
    # N(1, 4) * N(-1, 1) is proportional to N(m, v) with v = 1/(1/4 + 1), m = v (1/4 - 1)
    v = 1 / (0.25 + 1.0)
    loc, scale = factors.to_loc_scale(ab)
    np.testing.assert_allclose(loc, v * (0.25 - 1.0), rtol=1e-6)
    np.testing.assert_allclose(scale**2, v, rtol=1e-6)
    back = factors.divide(ab, b)
    np.testing.assert_allclose(back.eta1, a.eta1, rtol=1e-6)
    np.testing.assert_allclose(back.eta2, a.eta2, rtol=1e-6)


def test_damping_interpolates_natural_parameters():
    old = Gaussian(jnp.array([0.0, 1.0]), jnp.array([-1.0, -2.0]))
    new = Gaussian(jnp.array([2.0, 3.0]), jnp.array([-3.0, -2.0]))
    d = factors.damp(old, new, 0.25)
    np.testing.assert_allclose(d.eta1, [0.5, 1.5])
    np.testing.assert_allclose(d.eta2, [-1.5, -2.0])


def test_stacked_product():
    stacked = Gaussian(jnp.arange(6.0).reshape(3, 2), -jnp.ones((3, 2)))
    p = factors.product(stacked)
    np.testing.assert_allclose(p.eta1, [6.0, 9.0])
    np.testing.assert_allclose(p.eta2, [-3.0, -3.0])


def test_validity_checks():
    assert bool(factors.is_proper(Gaussian(jnp.zeros(2), -jnp.ones(2))))
    assert not bool(factors.is_proper(Gaussian(jnp.zeros(2), jnp.array([-1.0, 0.0]))))
    assert not bool(factors.is_proper(Gaussian(jnp.array([jnp.nan, 0.0]), -jnp.ones(2))))
    with pytest.raises(ValueError, match="non-positive precision"):
        factors.check_proper(Gaussian(jnp.zeros(3), jnp.array([-1.0, 0.5, -1.0])), "cavity of client 2")
    with pytest.raises(ValueError, match="non-finite"):
        factors.check_proper(Gaussian(jnp.array([jnp.inf]), -jnp.ones(1)), "q")


def test_kl_matches_numpyro():
    key = jax.random.key(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    mq, mp = jax.random.normal(k1, (5,)), jax.random.normal(k2, (5,))
    sq, sp = jnp.exp(jax.random.normal(k3, (5,))), jnp.exp(jax.random.normal(k4, (5,)))
    ours = factors.kl(factors.from_loc_scale(mq, sq), factors.from_loc_scale(mp, sp))
    ref = jnp.sum(dist.kl_divergence(dist.Normal(mq, sq), dist.Normal(mp, sp)))
    np.testing.assert_allclose(ours, ref, rtol=1e-5)


def test_expected_log_factor_plus_entropy_is_minus_kl_up_to_normaliser():
    mq, sq = jnp.array([0.2, -1.0]), jnp.array([0.5, 2.0])
    mp, sp = jnp.array([1.0, 0.0]), jnp.array([1.5, 0.7])
    p = factors.from_loc_scale(mp, sp)
    log_z = jnp.sum(0.5 * jnp.log(2 * jnp.pi * sp**2) + mp**2 / (2 * sp**2))
    lhs = factors.expected_log_factor(mq, sq, p) + factors.entropy(sq) - log_z
    np.testing.assert_allclose(lhs, -factors.kl(factors.from_loc_scale(mq, sq), p), rtol=1e-5)


def test_full_rank_parameters_round_trip_on_ill_conditioned_precisions():
    """``to_params`` / ``from_params`` (the mean and Cholesky factor of the covariance that DP optimisation
    moves): the precision comes back within 1e-5 (relative, Frobenius) up to condition 1e8. With
    ``cholesky(inv(precision))`` in float32 the error was 2e-2 at condition 1e7 and NaN at 1e8."""
    rng = np.random.default_rng(0)
    for condition in (1e2, 1e5, 1e8):
        basis, _ = np.linalg.qr(rng.normal(size=(6, 6)))
        precision = (basis * np.logspace(0, np.log10(condition), 6)) @ basis.T
        mean = rng.normal(size=6)
        g = factors.Gaussian(jnp.asarray(precision @ mean, jnp.float32), jnp.asarray(-precision / 2, jnp.float32))
        back = jax.jit(lambda g: factors.from_params(factors.to_params(g)))(g)
        exact = -2.0 * np.asarray(g.eta2, np.float64)
        error = np.linalg.norm(-2.0 * np.asarray(back.eta2, np.float64) - exact) / np.linalg.norm(exact)
        assert error < 1e-5, (condition, error)
        assert set(factors.to_params(g)) == {"loc", "log_diag", "offdiag"}
