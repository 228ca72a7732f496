"""Client failures, divergence, checkpoints and resume (issue 7, engine side)."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi.privacy import Privacy


@dppvi.model
def linreg(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def clients(m=3, n=60, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(m):
        x = rng.normal(size=(n, 2)).astype(np.float32)
        out.append((x, (x @ np.array([1.0, -1.0]) + rng.normal(size=n)).astype(np.float32)))
    return out


@pytest.mark.parametrize("schedule", ["synchronous", "asynchronous", "sequential"])
def test_records_with_non_finite_gradients_do_not_drop_a_private_client(schedule):
    """Issue 11, finding 5: per-example gradients that overflow are zeroed before clipping, so the
    client's noisy release stays finite and its update is kept (no unnoised "failed" bit depends on
    a record); its releases are charged as usual."""
    data = clients()
    broken = (data[1][0] * np.float32(1e30), data[1][1])  # finite data whose gradients overflow
    data = [data[0], broken, data[2]]
    states = []
    result = dppvi.fit_dppvi(linreg, data, method="dp_optimisation", privacy=Privacy(noise_multiplier=1.0),
                             schedule=schedule, rounds=3, local_steps=3, batch_size=10, rng_key=jax.random.key(0),
                             callback=lambda state, entry: states.append(state))
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in result.q)
    assert not any(h.get("failed") for h in result.history), result.history
    assert result.privacy.num_releases(1) > 0
    assert np.any(np.asarray(states[-1].factors.eta1[1]) != 0.0)  # its (noisy) update was applied


@pytest.mark.parametrize("schedule", ["synchronous", "asynchronous", "sequential"])
def test_client_with_non_finite_update_is_dropped_and_reported(schedule):
    """A non-private client whose local optimisation diverges is dropped and named in the history."""
    data = clients()
    data = [data[0], (data[1][0] * np.float32(1e30), data[1][1]), data[2]]
    states = []
    result = dppvi.fit_dppvi(linreg, data, schedule=schedule, rounds=3, local_steps=3, rng_key=jax.random.key(0),
                             callback=lambda state, entry: states.append(state))
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in result.q)
    failures = [h.get("failed", []) for h in result.history]
    assert any(1 in f for f in failures), failures
    assert all(0 not in f and 2 not in f for f in failures)
    np.testing.assert_array_equal(np.asarray(states[-1].factors.eta1[1]), 0.0)  # its factor unchanged


def test_divergence_raises_with_the_last_valid_result(tmp_path):
    """A state whose client cavity is improper (a factor more precise than q) cannot be continued by the mean-field
    step (the full-rank step takes an improper cavity: ``NonPrivateFullRank.uses_client_cavity``)."""
    from numpyro_dppvi.factors import Gaussian

    data = clients()
    driver = dppvi.DPPVI(linreg, schedule="synchronous", local_steps=5, family="mean_field")  # full-rank: see below
    state = driver.init(jax.random.key(0), data)
    bad = Gaussian(state.factors.eta1, state.factors.eta2.at[0].set(-10.0))
    state = state._replace(factors=bad)
    with pytest.raises(dppvi.FitDiverged, match="previous state is kept") as info:
        driver.run(None, data, rounds=2, state=state, checkpoint=tmp_path / "c.npz")
    last = info.value.result
    assert last.rounds == 0 and last.history == []
    np.testing.assert_array_equal(np.asarray(last.q.eta2), np.asarray(state.q.eta2))


def test_checkpoint_resume_equals_uninterrupted_and_keeps_the_ledger(tmp_path):
    data = clients()
    kwargs = dict(method="dp_optimisation", privacy=Privacy(epsilon=2.0, delta=1e-5, clip=1.0),
                  schedule="synchronous", local_steps=3, batch_size=10, damping=0.5, rng_key=jax.random.key(5))
    full = dppvi.fit_dppvi(linreg, data, rounds=4, **kwargs)
    path = tmp_path / "fit.npz"

    class Interrupted(Exception):
        pass

    def interrupt(state, entry):
        if entry["round"] == 2:
            raise Interrupted  # the process dies after round 2 was checkpointed

    with pytest.raises(Interrupted):
        dppvi.fit_dppvi(linreg, data, rounds=4, checkpoint=path, callback=interrupt, **kwargs)
    resumed = dppvi.fit_dppvi(linreg, data, rounds=4, resume=path, **kwargs)
    np.testing.assert_array_equal(np.asarray(resumed.q.eta1), np.asarray(full.q.eta1))
    np.testing.assert_array_equal(np.asarray(resumed.q.eta2), np.asarray(full.q.eta2))
    assert resumed.privacy == full.privacy  # neither reset nor double counted
    assert [h["round"] for h in resumed.history] == [1, 2, 3, 4]
    assert resumed.privacy.epsilon <= 2.0
    with pytest.raises(ValueError, match="other settings"):
        dppvi.fit_dppvi(linreg, data, rounds=4, resume=path, **dict(kwargs, schedule="sequential"))
