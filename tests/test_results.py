import arviz as az
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_dppvi as dppvi


@dppvi.model
def regression(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, sigma), obs=y)


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 2)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0]) + 0.3 * rng.normal(size=200)).astype(np.float32)
    clients = dppvi.partition((x, y), num_clients=2, seed=0)
    return dppvi.fit_dppvi(regression, clients, schedule="sequential", rounds=3, local_steps=50), (x, y)


def test_posterior_and_samples_shapes(fitted):
    result, _ = fitted
    post = result.posterior
    assert post["w"]["loc"].shape == (2,) and post["sigma"]["scale"].shape == ()
    samples = result.sample(50, jax.random.key(0))
    assert samples["w"].shape == (50, 2) and samples["sigma"].shape == (50,)


def test_to_arviz_posterior_group_passes_summary(fitted):
    result, (x, y) = fitted
    idata = result.to_arviz(num_samples=200, eval_data=(x[:20], y[:20]))
    assert idata.posterior["w"].shape == (4, 50, 2)  # 200 independent draws in 4 chains
    assert idata.log_likelihood["y"].shape == (4, 50, 20)
    np.testing.assert_array_equal(np.asarray(idata.observed_data["y"]), y[:20])
    summary = az.summary(idata, var_names=["w", "sigma"], kind="stats")
    assert list(summary.index) == ["w[0]", "w[1]", "sigma"]
    assert np.all(np.isfinite(summary["mean"].to_numpy(dtype=float)))


def test_predict_through_predictive(fitted):
    result, (x, _) = fitted
    draws = result.predict(x[:5], num_samples=100, rng_key=jax.random.key(0))
    assert draws["y"].shape == (100, 5)
    # predictive mean near x @ w with w ~ (1, -1)
    np.testing.assert_allclose(draws["y"].mean(0), x[:5] @ np.array([1.0, -1.0]), atol=0.25)


def test_save_load_round_trip_and_tamper_detection(fitted, tmp_path):
    result, _ = fitted
    path = tmp_path / "r.npz"
    result.save(path)
    loaded = dppvi.load(path, regression)
    np.testing.assert_array_equal(np.asarray(loaded.q.eta1), np.asarray(result.q.eta1))
    assert loaded.history == result.history and loaded.method == "pvi"
    raw = path.read_bytes()
    (tmp_path / "truncated.npz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        dppvi.load(tmp_path / "truncated.npz", regression)
    # edit one stored number (the round counter) but keep the zip valid
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as zin, zipfile.ZipFile(buf, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == "['q'].eta1.npy":
                arr = np.load(io.BytesIO(data))
                out = io.BytesIO()
                np.save(out, arr + 1)
                data = out.getvalue()
            zout.writestr(item, data)
    (tmp_path / "edited.npz").write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="checksum"):
        dppvi.load(tmp_path / "edited.npz", regression)


def test_a_result_describes_itself_and_evaluates_the_fits_eval_data_form(fitted):
    """``repr`` names the method, family, rounds, convergence and privacy (as NumPyro's and ArviZ's objects say what
    they are); ``converged`` is ``convergence["converged"]``; ``evaluate`` takes ``(x, y)`` as ``eval_data=`` does."""
    result, (x, y) = fitted
    text = repr(result)
    # a 3-latent model: full-rank, the non-private default up to NEWTON_MAX_DIM latents
    assert text == (f"DPPVIResult(method='pvi', family='full_rank', rounds=3, converged={result.converged}, "
                    "private=False, calibrated=None)")
    assert result.converged is result.convergence["converged"]
    key = jax.random.key(0)
    assert result.evaluate((x[:50], y[:50]), rng_key=key) == result.evaluate(x[:50], y[:50], rng_key=key)
    np.testing.assert_array_equal(result.log_predictive_density((x[:5], y[:5]), rng_key=key),
                                  result.log_predictive_density(x[:5], y[:5], rng_key=key))
