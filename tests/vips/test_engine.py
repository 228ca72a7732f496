"""The engine's batch sum: summed in chunks (bounded memory) it is the one-pass sum, clip count included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_dppvi.vips import engine
from numpyro_dppvi.vips.linear import BayesianLinearRegression
from numpyro_dppvi.vips.logistic import PolyaGammaLogisticRegression


@pytest.mark.parametrize("model", [PolyaGammaLogisticRegression(7, feature_bound=3.0),
                                   BayesianLinearRegression(7, noise_scale=1.0, feature_bound=3.0, target_bound=2.0)],
                         ids=["logistic", "linear"])
@pytest.mark.parametrize("private", [True, False])
def test_a_chunked_batch_sum_is_the_one_pass_sum(monkeypatch, model, private):
    rng = np.random.default_rng(0)
    n = 1003  # not a multiple of the chunk: the padded records must count for nothing
    x = jnp.asarray(rng.normal(size=(n, 7)) * 2, jnp.float32)
    y = jnp.asarray(rng.random(n) < 0.5, jnp.float32)
    mask = jnp.asarray(rng.random(n) < 0.8)
    enp = model.expected_natural_params(model.prior_params())
    bounds = {name: 0.5 * bound for name, bound in model.block_bounds.items()} if private else None
    one_pass, clipped = model._clipped_chunk_sum(enp, (x, y), mask, bounds)
    per_example = model._example_ess_size(enp, (x, y))
    assert per_example == 7 + 49
    monkeypatch.setattr(engine, "ESS_CHUNK_ELEMENTS", 100 * per_example)  # chunks of 100 records
    chunked, chunked_clipped = jax.jit(lambda b, m: model.clipped_ess_sum(enp, b, m, bounds))((x, y), mask)
    assert int(chunked_clipped) == int(clipped)
    if private:
        assert int(clipped) > 100  # the half bounds clip: the count is exercised
    for name in one_pass:
        # float32 sums of ~800 terms of size <= 40 in another order: rounding only (1e-6 relative per term)
        scale = float(jnp.max(jnp.abs(one_pass[name])))
        np.testing.assert_allclose(chunked[name], one_pass[name], rtol=1e-5, atol=1e-5 * scale)
