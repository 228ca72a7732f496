"""The local objective's pieces: per-example likelihood gradients that DP-SGD clips."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi import objectives
from numpyro_dppvi.model import ModelAdapter


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


def test_per_example_grads_reject_blocks_that_do_not_cover_u():
    params = {"loc": jnp.zeros(4), "log_scale": jnp.zeros(4)}
    with pytest.raises(ValueError, match="must sum to the dimension 4"):
        objectives.per_example_log_lik_grads(lambda u, row: jnp.sum(u), params, jnp.zeros((2, 4)),
                                             (jnp.zeros((3, 1)),), blocks=(3, 2))
