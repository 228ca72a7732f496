"""The local objective's pieces: per-example likelihood gradients that DP-SGD clips."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi import objectives
from numpyro_dppvi.model_adapter import ModelAdapter


@dppvi.model
def heteroscedastic(x, y=None):
    """Non-linear in ``u``: a positive noise scale (exp transform) and a tanh link."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(jnp.tanh(x @ w), sigma), obs=y)


@pytest.mark.parametrize("by_site", [False, True])
def test_per_example_grads_equal_autodiff_of_each_rows_expectation(by_site):
    """The chain-rule form equals ``vmap(grad(E_q[log p(x_i | theta)]))`` on a model that is not
    linear in ``u``; tolerance: float32 rounding of sums of 7 draws (values are O(1))."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(40, 3)), dtype=jnp.float32)
    y = jnp.asarray(rng.normal(size=40), dtype=jnp.float32)
    adapter = ModelAdapter(heteroscedastic, (x, y))
    key_loc, key_scale, key_eps = jax.random.split(jax.random.key(0), 3)
    params = {"loc": 0.5 * jax.random.normal(key_loc, (adapter.dim,)),
              "log_scale": -1.0 + 0.3 * jax.random.normal(key_scale, (adapter.dim,))}
    eps = jax.random.normal(key_eps, (7, adapter.dim))
    blocks = adapter.site_sizes if by_site else None
    assert adapter.site_sizes == (3, 1)
    log_lik = adapter.log_lik_row_blocks if by_site else adapter.log_lik_row
    fast = objectives.per_example_log_lik_grads(log_lik, params, eps, (x, y), blocks)
    ell = lambda p, row: objectives.expected_log_lik_row(adapter.log_lik_row, p, eps, row)
    reference = jax.vmap(jax.grad(ell), in_axes=(None, 0))(params, (x, y))
    for name in ("loc", "log_scale"):
        assert fast[name].shape == (40, adapter.dim)
        np.testing.assert_allclose(fast[name], reference[name], rtol=1e-5, atol=1e-6)
        assert float(jnp.max(jnp.abs(reference[name]))) > 0.1  # the comparison is not of zeros


def test_the_scaled_release_gives_back_the_variational_gradient_and_keeps_the_curvature_large():
    """``per_example_scaled_grads`` (the release of an optax step of a mean-field ``q``): summed over rows and
    unscaled (``gradients_from_scaled``) it is the variational gradient exactly; its log-scale block is
    ``kappa g^{log s} / (s sigma)``, about ``kappa diag(H_i) s / sigma`` with antithetic draws, so for a linear
    regression (``H_i = -x_i x_i^T / noise^2``) its sum over rows is ``-kappa sum_i x_ij^2 s_j / (noise^2 sigma)``
    up to the draws' ``(1/S) sum_s eps_s eps_s^T - I`` (4000 pairs: ~2%; 8% allowed), while the plain log-scale
    gradient is ``s_j sigma / kappa`` times it (here ``s`` about ``e^-3``: 1/357 to 1/969), the share of a joint
    clip's noise the curvature would otherwise get. Tolerance of the round trip: float32 rounding."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(50, 3)), dtype=jnp.float32)
    y = jnp.asarray(x @ np.array([0.5, -1.0, 2.0]) + 0.5 * rng.normal(size=50), dtype=jnp.float32)
    log_lik = lambda u, row: -0.5 * jnp.square(row[1] - row[0] @ u) / 0.25
    params = {"loc": jnp.array([0.4, -0.8, 1.9]), "log_scale": jnp.array([-3.0, -2.5, -3.5])}
    eps = objectives.antithetic_pairs(jax.random.key(1), 4000, 3)
    kappa = 1.7
    scaled = objectives.per_example_scaled_grads(log_lik, params, eps, (x, y), kappa)
    plain = objectives.per_example_log_lik_grads(log_lik, params, eps, (x, y))
    back = objectives.gradients_from_scaled(params, jax.tree.map(lambda v: jnp.sum(v, axis=0), scaled), kappa)
    for name in ("loc", "log_scale"):
        np.testing.assert_allclose(back[name], jnp.sum(plain[name], axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(scaled["loc"], plain["loc"])
    s = np.exp(np.asarray(params["log_scale"], np.float64))
    sigma = float(objectives.probe_scale(params))
    expected = -kappa * np.sum(np.asarray(x, np.float64) ** 2, axis=0) * s / (0.25 * sigma)
    np.testing.assert_allclose(np.sum(scaled["log_scale"], axis=0), expected, rtol=0.08)
    assert np.all(np.abs(np.sum(scaled["log_scale"], axis=0)) > 300 * np.abs(np.sum(plain["log_scale"], axis=0)))


def test_per_example_grads_reject_blocks_that_do_not_cover_u():
    params = {"loc": jnp.zeros(4), "log_scale": jnp.zeros(4)}
    with pytest.raises(ValueError, match="must sum to the dimension 4"):
        objectives.per_example_log_lik_grads(lambda u, row: jnp.sum(u), params, jnp.zeros((2, 4)),
                                             (jnp.zeros((3, 1)),), blocks=(3, 2))


def test_expected_grad_and_diag_hessian_of_a_known_density():
    """``f(u) = -sum_k c_k u_k^4 / 4 + u_0 u_1``: ``E[df/du_k] = -c_k E[u_k^3] + E[u_other]`` (on the
    coupled pair), ``E[d^2 f/du_k^2] = -3 c_k E[u_k^2]``, with the Gaussian moments of the same draws;
    only the coordinates of ``index`` are returned. Tolerance: float32 rounding."""
    c = jnp.array([1.0, 2.0, 0.5])
    f = lambda u: -jnp.sum(c * u ** 4) / 4 + u[0] * u[1]
    loc, scale = jnp.array([0.3, -0.2, 1.0]), jnp.array([0.5, 0.1, 2.0])
    eps = jax.random.normal(jax.random.key(0), (64, 3))
    u = loc + scale * eps
    grad, curv = objectives.expected_grad_and_diag_hessian(f, loc, scale, eps, np.array([0, 2]))
    want_grad = jnp.stack([jnp.mean(-c[0] * u[:, 0] ** 3 + u[:, 1]), jnp.mean(-c[2] * u[:, 2] ** 3)])
    want_curv = jnp.stack([jnp.mean(-3 * c[0] * u[:, 0] ** 2), jnp.mean(-3 * c[2] * u[:, 2] ** 2)])
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(curv, want_curv, rtol=1e-5)


def test_expected_grad_and_diag_hessian_leaves_out_non_finite_draws():
    f = lambda u: -0.5 * u[0] ** 2 + 0.0 * jnp.sqrt(1.0 - u[0])  # NaN (value and derivatives) at u > 1
    eps = jnp.array([[0.0], [0.5], [3.0]])  # the last draw (u = 3) is not finite
    grad, curv = objectives.expected_grad_and_diag_hessian(f, jnp.zeros(1), jnp.ones(1), eps, np.array([0]))
    np.testing.assert_allclose(grad, [-0.25])
    np.testing.assert_allclose(curv, [-1.0])


def test_finite_log_lik_draws_is_the_identity_on_finite_models():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(20, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=20), jnp.float32)
    adapter = ModelAdapter(heteroscedastic, (x, y))
    params = {"loc": jnp.array([0.2, -0.1, 0.4, 0.0]), "log_scale": jnp.full(4, -1.0)}
    eps = jax.random.normal(jax.random.key(2), (5, adapter.dim))
    plain = lambda p: jnp.mean(jax.vmap(adapter.log_lik_rows, in_axes=(0, None))(objectives.draws(p, eps), (x, y)))
    safe = lambda p: jnp.mean(objectives.expected_log_lik_rows(adapter.log_lik_rows, p, eps, (x, y)))
    np.testing.assert_allclose(safe(params), plain(params), rtol=1e-6)
    for name in ("loc", "log_scale"):
        np.testing.assert_allclose(jax.grad(safe)(params)[name], jax.grad(plain)(params)[name], rtol=1e-5, atol=1e-7)


def test_a_finite_draw_with_a_non_finite_gradient_contributes_no_gradient_there():
    """Issue 15: NumPyro's HSGP is finite but not differentiable where ``sqrt`` of its spectral density
    underflows to 0; one such Monte Carlo draw used to make a client's whole update NaN. Here
    ``sqrt(max(u_0, 0)) + u_1`` has a NaN derivative in ``u_0`` at ``u_0 <= 0``: that entry of the
    draw at ``u_0 = -1`` is zeroed, its ``u_1`` entry (1) is kept; the draw at ``u_0 = 4`` keeps
    ``d sqrt(u)/du = 1/4``. Averaged over the 2 draws."""
    log_lik_rows = lambda u, arrays: (jnp.sqrt(jnp.maximum(u[0], 0.0)) + u[1]) * jnp.ones(arrays[0].shape[0])
    params = {"loc": jnp.zeros(2), "log_scale": jnp.zeros(2)}
    eps = jnp.array([[-1.0, 1.0], [4.0, -1.0]])
    f = lambda p: jnp.mean(objectives.expected_log_lik_rows(log_lik_rows, p, eps, (jnp.zeros((3, 1)),)))
    np.testing.assert_allclose(f(params), 1.0)
    grads = jax.grad(f)(params)
    np.testing.assert_allclose(grads["loc"], [0.125, 1.0])
    np.testing.assert_allclose(grads["log_scale"], [0.125 * 4.0, 0.0])


def test_a_draw_with_a_non_finite_value_is_not_hidden():
    """A ``-inf`` log-likelihood (e.g. an overflowing Poisson rate) is the likelihood's strongest signal:
    it is not zeroed, so the update is not finite and the server drops the client (``failed``)."""
    log_lik_rows = lambda u, arrays: jnp.where(u[0] > 1.0, -jnp.inf, -u[0] ** 2) * jnp.ones(arrays[0].shape[0])
    params = {"loc": jnp.zeros(1), "log_scale": jnp.zeros(1)}
    eps = jnp.array([[0.5], [2.0]])
    f = lambda p: jnp.mean(objectives.expected_log_lik_rows(log_lik_rows, p, eps, (jnp.zeros((3, 1)),)))
    assert not np.isfinite(float(f(params)))
