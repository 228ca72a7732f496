"""One result protocol for the three families (issue 14): DP-PVI, VIPS and VFL results answer the same
calls, and save / ``numpyro_dppvi.load`` round-trips every one of them (the class comes from the file).

Each family fits a tiny model; then: ``sample`` (site names of the model), ``predict`` (NumPyro
``Predictive``), ``log_predictive_density`` (one value per row), ``to_arviz`` + ``arviz.summary``,
``save`` + ``load`` + ``sample`` again (equal draws for the same key), ``privacy.report()``.
"""

import warnings

import arviz as az
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi.privacy import Privacy

from .vfl.vfl_problems import gaussian_likelihood, make_split

RNG = np.random.default_rng(0)
X = RNG.normal(size=(90, 2)).astype(np.float32) * 0.4
Y = (X @ np.array([1.0, -1.0]) + 0.3 * RNG.normal(size=90)).astype(np.float32)


@dppvi.model
def linreg(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 0.3), obs=y)


def fit_dppvi_family():
    clients = dppvi.partition((X, Y), num_clients=3, seed=0)
    result = dppvi.fit_dppvi(linreg, clients, method="dp_optimisation", privacy=Privacy(noise_multiplier=1.0),
                             batch_size=10, rounds=2, local_steps=5)
    return result, dict(model=linreg, data=(X[:7],), eval_data=(X[:7], Y[:7]), sites={"w": (2,)})


def fit_vips_family():
    result = dppvi.fit_vips(linreg, (X, Y), privacy=Privacy(noise_multiplier=1.0), iterations=5,
                            detect_options=dict(feature_bound=2.0, target_bound=3.0))
    return result, dict(model=linreg, data=(X[:7],), eval_data=(X[:7], Y[:7]), sites={"w": (2,)})


def fit_vfl_family():
    clients = make_split(X, [1, 1])
    result = dppvi.fit_vfl(clients, Y, gaussian_likelihood, steps=50)
    new = [X[:7, :1], X[:7, 1:]]
    return result, dict(model=(clients, gaussian_likelihood), data=(new,), eval_data=(new, Y[:7]),
                        sites={"beta": None, "b": (), "sigma": ()})


FAMILIES = {"dppvi": fit_dppvi_family, "vips": fit_vips_family, "vfl": fit_vfl_family}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_answers_the_same_calls(family, tmp_path):
    result, case = FAMILIES[family]()
    assert isinstance(result, dppvi.Result)
    key = jax.random.key(7)
    draws = result.sample(50, key)
    for site, shape in case["sites"].items():
        matches = [k for k in draws if k == site or k.endswith("/" + site)]
        assert matches, (site, sorted(draws))
        for k in matches:
            assert draws[k].shape[0] == 50 and (shape is None or draws[k].shape[1:] == shape)
    predicted = result.predict(*case["data"], num_samples=20, rng_key=key)
    assert predicted["y"].shape == (20, 7)
    lpd = result.log_predictive_density(*case["eval_data"], num_samples=30, rng_key=key)
    assert lpd.shape == (7,) and np.all(np.isfinite(lpd))
    idata = result.to_arviz(num_samples=40, rng_key=key, eval_data=case["eval_data"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ArviZ warns on one chain (r_hat) and on shapes: none of that
        summary = az.summary(idata)
    assert len(summary) >= 2 and np.all(np.isfinite(summary.to_numpy(dtype=float)))
    # independent draws in 4 chains: r_hat is the Monte Carlo diagnostic of independent draws, about 1 (with
    # 10 draws a chain its spread is ~0.1; 1.3 would be chains that differ in distribution)
    assert np.all(summary["r_hat"].to_numpy(dtype=float) < 1.3)
    assert idata.posterior.sizes["chain"] == 4 and idata.posterior.sizes["draw"] == 10
    assert idata.log_likelihood[result.observed_name].shape[-1] == 7
    np.testing.assert_array_equal(np.asarray(idata.observed_data[result.observed_name]), case["eval_data"][-1])
    fresh = [result.sample(5)[sorted(draws)[0]] for _ in range(2)]
    assert not np.array_equal(fresh[0], fresh[1])  # no key: new draws on every call, never a silent repeat
    assert isinstance(result.history, list) and isinstance(result.history[-1], dict)
    report = result.privacy.report()
    assert ("epsilon" in report) if result.is_private else ("NOT differentially private" in report)
    path = tmp_path / "result.npz"
    result.save(path)
    loaded = dppvi.load(path, case["model"])
    assert type(loaded) is type(result)
    again = loaded.sample(50, key)
    assert sorted(again) == sorted(draws)
    for k in draws:
        np.testing.assert_allclose(again[k], draws[k], rtol=1e-6, atol=1e-6)
    assert loaded.history == result.history or family == "vips"  # VIPS: floats through JSON, compared below
    if result.is_private:
        assert loaded.privacy == result.privacy


def test_loo_on_a_dppvi_result_with_data_and_the_chain_layout_names_the_fix():
    """``az.loo`` reads the ``log_likelihood`` group of ``to_arviz(eval_data=...)`` (rows of the held-out data);
    ``num_samples`` must split evenly into ``num_chains``."""
    result, case = fit_dppvi_family()
    idata = result.to_arviz(num_samples=400, rng_key=jax.random.key(1), eval_data=(X, Y))
    loo = az.loo(idata)
    assert np.isfinite(float(loo["elpd_loo"] if "elpd_loo" in loo else loo.elpd_loo))
    assert result.to_arviz(num_samples=30, num_chains=1).posterior.sizes["chain"] == 1
    with pytest.raises(ValueError, match="multiple of num_chains"):
        result.to_arviz(num_samples=30)


def test_load_names_the_missing_model_and_refuses_unknown_files(tmp_path):
    result, case = fit_dppvi_family()
    result.save(tmp_path / "r.npz")
    with pytest.raises(TypeError, match="needs the model"):
        dppvi.load(tmp_path / "r.npz")
    np.savez(tmp_path / "other.npz", a=np.zeros(2))
    with pytest.raises(ValueError, match="not a numpyro_dppvi save file"):
        dppvi.load(tmp_path / "other.npz", linreg)
