"""Private VIPS: the release's noise, the accounting of the sampler used, calibration, and
the federated client step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_dppvi.privacy import Privacy, epsilon_of_events
from numpyro_dppvi.vips import (
    BayesianLinearRegression, BetaBernoulli, PolyaGammaLogisticRegression, conjugate_client_delta,
    conjugate_server_update, fit_vips)
from numpyro_dppvi.vips.release import release_ess

Y = (np.random.default_rng(0).random(400) < 0.3).astype(float)


def test_release_noise_has_the_declared_std_per_block():
    """4,000 independent releases of a zero sum. Block std must be sigma sqrt(B) C_b; the
    relative standard error of a std estimated from m draws is 1/sqrt(2m): with m >= 4,000
    that is <= 1.2%, so 5% is a 4-sigma tolerance."""
    bounds = {"v": 2.0, "m": 0.5, "s": 1.0}
    ess = {"v": jnp.zeros(3), "m": jnp.zeros((2, 2)), "s": jnp.zeros((2, 4, 4))}  # two symmetric matrices
    std = 1.3 * math.sqrt(3)
    keys = jax.random.split(jax.random.key(0), 4000)
    draws = jax.jit(jax.vmap(lambda k: release_ess(ess, bounds, std, k, ("s",))))(keys)
    np.testing.assert_allclose(np.std(draws["v"]), std * 2.0, rtol=0.05)
    np.testing.assert_allclose(np.std(draws["m"]), std * 0.5, rtol=0.05)
    s = np.asarray(draws["s"])
    np.testing.assert_array_equal(s, np.swapaxes(s, -1, -2))  # symmetric noise
    upper = s[:, :, np.triu_indices(4)[0], np.triu_indices(4)[1]]
    np.testing.assert_allclose(np.std(upper), std * 1.0, rtol=0.05)
    assert abs(np.corrcoef(s[:, 0, 0, 1], s[:, 1, 0, 1])[0, 1]) < 0.06  # the matrices get independent noise
    corr = np.corrcoef(np.asarray(draws["v"])[:, 0], np.asarray(draws["m"])[:, 0, 0])[0, 1]
    assert abs(corr) < 0.06  # independent blocks (4 sigma of a zero correlation at m = 4,000)


@pytest.mark.parametrize("sampling,neighbouring,accountant,event_nm", [
    ("poisson", "add_remove", "pld", 2.0),
    ("without_replacement", "substitute", "autodp", 1.0)])  # the paper's setting and accountant
def test_ledger_records_the_sampler_actually_used(sampling, neighbouring, accountant, event_nm):
    privacy = Privacy(noise_multiplier=2.0, sampling=sampling, neighbouring=neighbouring, delta=1e-5,
                      accountant=accountant)
    result = fit_vips(BetaBernoulli(), (Y,), privacy=privacy, batch_size=50, iterations=12,
                      rng_key=jax.random.key(0))
    (event,) = result.privacy.events(0)
    assert event.sampling == sampling and event.count == 12
    assert event.rate == pytest.approx(50 / 400)
    assert event.noise_multiplier == pytest.approx(event_nm)
    assert result.epsilon == pytest.approx(epsilon_of_events([event], 1e-5, neighbouring, accountant), rel=1e-9)
    assert all(set(h) == {"step", "rho"} for h in result.history)  # no realised batch sizes


def test_calibrated_noise_meets_the_budget():
    privacy = Privacy(epsilon=1.0, delta=1e-5)
    result = fit_vips(BetaBernoulli(), (Y,), privacy=privacy, batch_size=100, iterations=20,
                      rng_key=jax.random.key(0))
    assert 0.98 <= result.epsilon <= 1.0
    assert result.noise_multiplier > 0
    assert result.info["joint_clip"] == pytest.approx(1.0)  # one block


def test_noise_is_added_and_fixed_by_the_key():
    privacy = Privacy(noise_multiplier=1.0)
    fits = [fit_vips(BetaBernoulli(), (Y,), privacy=privacy, iterations=3, kappa=0.0, rng_key=jax.random.key(k))
            for k in (0, 0, 1)]
    exact = 1.0 + Y.sum()
    assert float(fits[0].params["alpha"]) == float(fits[1].params["alpha"])
    assert float(fits[0].params["alpha"]) != float(fits[2].params["alpha"])
    assert float(fits[0].params["alpha"]) != pytest.approx(exact, abs=1e-3)


def test_private_fit_needs_public_bounds():
    x = np.random.default_rng(1).normal(size=(20, 2))
    with pytest.raises(ValueError, match="feature_bound"):
        fit_vips(BayesianLinearRegression(2, 1.0), (x, x[:, 0]), privacy=Privacy(noise_multiplier=1.0),
                 rng_key=jax.random.key(0))
    with pytest.raises(ValueError, match="epsilon_max"):
        fit_vips(BetaBernoulli(), (Y,), privacy=Privacy(epsilon=1.0, epsilon_max=1.0), rng_key=jax.random.key(0))
    with pytest.raises(TypeError, match="Privacy"):
        fit_vips(BetaBernoulli(), (Y,), privacy={"epsilon": 1.0}, rng_key=jax.random.key(0))


def test_federated_rounds_equal_centralised_batch_vb():
    """Three clients' exact conjugate steps summed by the server are batch VB on the pooled
    data: after 4 rounds the posterior equals fit_vips(iterations=4, kappa=0) to 1e-6 (float64)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        x = np.column_stack([rng.normal(size=(300, 2)), np.ones(300)])
        y = (rng.random(300) < 1 / (1 + np.exp(-x @ np.array([1.5, -1.0, 0.3])))).astype(float)
        model = PolyaGammaLogisticRegression(3, hyperprior=(1.0, 1.0))
        central = fit_vips(model, (x, y), iterations=4, kappa=0.0, rng_key=jax.random.key(0))
        params = model.init_params(jax.random.key(0))
        clients = [(x[i::3], y[i::3]) for i in range(3)]
        factors = [None] * 3
        for _ in range(4):
            enp = model.expected_natural_params(params)
            for m, data in enumerate(clients):
                delta, info = conjugate_client_delta(model, data, enp, factors[m], clip=None)
                factors[m] = info["factor"]
            total = jax.tree_util.tree_map(lambda *f: sum(f), *factors)
            params = conjugate_server_update(model, params, total)
        for name in ("eta", "precision", "alpha_b"):
            np.testing.assert_allclose(params[name], central.params[name], rtol=1e-6, atol=1e-9)


def test_private_client_step_reports_its_noise():
    model = BetaBernoulli()
    enp = model.expected_natural_params(model.prior_params())
    delta, info = conjugate_client_delta(model, (Y,), enp, noise_key=jax.random.key(3), clip=1.0,
                                         noise_multiplier=2.0)
    assert info["joint_clip"] == 1.0 and info["noise_std"] == 2.0
    assert not np.allclose(delta["counts"], [Y.sum(), (1 - Y).sum()])
    with pytest.raises(ValueError, match="noise_key"):
        conjugate_client_delta(model, (Y,), enp, clip=1.0, noise_multiplier=1.0)


def test_save_and_load_keep_posterior_and_ledger(tmp_path):
    result = fit_vips(BetaBernoulli(), (Y,), privacy=Privacy(noise_multiplier=2.0), batch_size=100, iterations=5,
                      rng_key=jax.random.key(0))
    path = tmp_path / "fit.npz"
    result.save(path)
    loaded = type(result).load(path)
    assert float(loaded.params["alpha"]) == float(result.params["alpha"])
    assert loaded.epsilon == result.epsilon and loaded.privacy.events(0) == result.privacy.events(0)
    assert loaded.history == result.history
    assert type(loaded.model) is type(result.model) and loaded.model.init_config() == result.model.init_config()
