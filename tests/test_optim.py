import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numpyro_dppvi.optim import cvi, natural_gradient


def test_natural_gradient_step_is_fisher_preconditioned():
    params = {"loc": jnp.array([1.0, -2.0]), "log_scale": jnp.log(jnp.array([0.5, 2.0]))}
    grads = {"loc": jnp.array([0.3, 0.1]), "log_scale": jnp.array([1.0, -1.0])}
    opt = natural_gradient(0.1)
    updates, _ = opt.update(grads, opt.init(params), params)
    np.testing.assert_allclose(updates["loc"], -0.1 * np.array([0.25, 4.0]) * np.array([0.3, 0.1]), rtol=1e-6)
    np.testing.assert_allclose(updates["log_scale"], [-0.05, 0.05], rtol=1e-6)


def test_natural_gradient_solves_a_gaussian_fit_in_one_unit_step():
    """For L = -E_q[log N(u; m, v)] in (mu, log s), the natural-gradient step with lr 1 on mu lands at m
    when s^2 = v (Newton step)."""
    m, v = 3.0, 0.25
    def loss(p):
        s2 = jnp.exp(2 * p["log_scale"])
        return jnp.sum(((p["loc"] - m) ** 2 + s2) / (2 * v))
    params = {"loc": jnp.array([0.0]), "log_scale": jnp.array([0.5 * np.log(v)])}
    opt = natural_gradient(1.0)
    updates, _ = opt.update(jax.grad(loss)(params), opt.init(params), params)
    np.testing.assert_allclose(optax.apply_updates(params, updates)["loc"], [m], rtol=1e-6)
    with pytest.raises(ValueError):
        natural_gradient(0.0)


def test_a_cvi_step_multiplies_a_precision_by_at_most_its_growth_cap():
    """``P_new = min(P (1 - beta g_r), c P)``: from ``P = 1`` a target precision of 1e9 (a curvature read in the
    tails of a prior-wide q, as the zoo's Weibull shape gives) moves ``P`` to ``c = 10``, not to 5e8; a target of 4
    (factor 2.5) is untouched, and so is a precision at its target (the fixed points do not move). Exact gradients:
    the values are algebra, not statistics."""
    params = {"loc": jnp.zeros(3), "log_scale": jnp.zeros(3)}  # s = 1, P = 1
    targets = jnp.array([1e9, 4.0, 1.0])
    g_r = 1.0 - targets  # 1 - s^2 T; the update takes gradients of -L: grads["log_scale"] = -g_r
    opt = cvi()
    updates, _ = opt.update({"loc": jnp.zeros(3), "log_scale": -g_r}, opt.init(params), params)
    new_precision = np.exp(-2.0 * np.asarray(updates["log_scale"]))
    np.testing.assert_allclose(new_precision, [10.0, 2.5, 1.0], rtol=1e-6)
    uncapped = cvi(max_precision_growth=float("inf"))
    updates, _ = uncapped.update({"loc": jnp.zeros(3), "log_scale": -g_r}, uncapped.init(params), params)
    np.testing.assert_allclose(np.exp(-2.0 * np.asarray(updates["log_scale"])), [5e8, 2.5, 1.0], rtol=1e-6)
    with pytest.raises(ValueError, match="max_precision_growth must be > 1"):
        cvi(max_precision_growth=1.0)
