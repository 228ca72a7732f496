import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numpyro_dppvi.optim import natural_gradient


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
