"""DP optimisation (DP-SGD in the local step): sensitivity, sampler/ledger agreement, budgets, resume."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi.privacy import Privacy
from numpyro_dppvi.privacy.mechanisms import tree_norm
from numpyro_dppvi.diagnostics import convergence_advice

from .conftest import logistic


def small_clients(m=3, n=200, d=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m * n, d)).astype(np.float32)
    y = (rng.uniform(size=m * n) < 1 / (1 + np.exp(-x @ np.arange(1.0, d + 1)))).astype(np.float32)
    return dppvi.partition((x, y), num_clients=m, seed=seed)


def driver(privacy, schedule="synchronous", rounds=2, local_steps=5, batch_size=20):
    return dppvi.DPPVI(logistic, method="dp_optimisation", privacy=privacy, schedule=schedule, rounds=rounds,
                       local_steps=local_steps, batch_size=batch_size, optimizer=optax.adam(1e-2), damping=0.5)


@pytest.mark.parametrize("relation,bound", [("add_remove", 1.0), ("substitute", 2.0)])
def test_clipped_sum_sensitivity_on_neighbouring_datasets(relation, bound):
    """Removing (or replacing) one row moves the pre-noise clipped sum by at most C (or 2C)."""
    clip = 0.7
    d = driver(Privacy(noise_multiplier=1.0, clip=clip, neighbouring=relation))
    clients = small_clients()
    d.init(jax.random.key(0), clients)
    clipped_sum = jax.jit(d.rule.clipped_sum)
    rng = np.random.default_rng(1)
    x, y = clients[0]
    worst = 0.0
    for trial in range(20):
        params = {"loc": jnp.asarray(rng.normal(size=d.adapter.dim) * 3, jnp.float32),
                  "log_scale": jnp.asarray(rng.normal(size=d.adapter.dim), jnp.float32)}
        eps = jax.random.normal(jax.random.key(trial), (4, d.adapter.dim))
        rows = (jnp.asarray(x[:30]), jnp.asarray(y[:30]))
        mask = jnp.ones(30, bool)
        base = clipped_sum(params, eps, rows, mask)
        if relation == "add_remove":
            neighbour_mask = mask.at[trial % 30].set(False)
            other = clipped_sum(params, eps, rows, neighbour_mask)
        else:
            changed = (rows[0].at[trial % 30].set(jnp.asarray(rng.normal(size=x.shape[1]) * 50, jnp.float32)),
                       rows[1].at[trial % 30].set(1.0 - rows[1][trial % 30]))
            other = clipped_sum(params, eps, changed, mask)
        diff = float(tree_norm(jax.tree.map(jnp.subtract, base, other)))
        worst = max(worst, diff)
        assert diff <= bound * clip * (1 + 1e-5)
    assert worst > 0.5 * clip  # the bound is approached: clipping binds on these far-out parameters


def test_poisson_sampler_rate_matches_ledger():
    """The sampler the rule uses includes rows at the rate the ledger accounts (batch_size / n_m,
    rounded up to 9 significant bits: 0.10009765625 for 20 / 200), walking the batch in chunks."""
    from numpyro_dppvi.privacy.sampling import poisson_fold

    privacy = Privacy(noise_multiplier=1.0, clip=1.0)
    d = driver(privacy, batch_size=20)
    clients = small_clients(n=200)
    state = d.init(jax.random.key(0), clients)
    accounted = float(d.plan.rates[0])
    assert 0.1 <= accounted < 0.1 * (1 + 2**-8) and d.rule.chunk == d.plan.chunk == 8
    rows_drawn = lambda k: poisson_fold(k, d.mask[0], state.client_state["rate"][0], d.rule.chunk,
                                        lambda total, idx, m: total + jnp.sum(m), jnp.zeros((), jnp.int32))
    sizes = jax.jit(jax.vmap(rows_drawn))(jax.random.split(jax.random.key(5), 2000))
    rate = float(jnp.mean(sizes)) / 200
    # 2000 draws of Binomial(200, 0.1): the mean batch has sd sqrt(200 * 0.09 / 2000) = 0.095 rows,
    # i.e. 4.7e-4 in rate; 5 sd = 2.4e-3
    assert abs(rate - accounted) < 2.4e-3
    result = d.run(None, clients, rounds=2, state=state, ledger=d.ledger)
    for m in range(3):
        (event,) = result.privacy.events(m)
        assert event.sampling == d.rule.sampling == privacy.sampling == "poisson"
        assert event.rate == accounted
        assert event.count == 2 * 5


def test_a_plan_whose_walk_would_cost_delta_draws_rows_and_charges_nothing():
    """The geometric-skip walk charges ``~ n 2^-48`` per step to delta, times ``1 + e^epsilon``: one client of
    2,000 rows, 100 steps a round for 10 rounds, at epsilon 8 that is ``2.8e-5 > delta = 1e-5`` (the budget
    could not be met: fit_global_vi at epsilon 8 was refused so). The plan then draws Poisson batches row by
    row (``row_sampler``, nothing charged), the rule it builds uses that sampler, the budget is met at the full
    accounting delta and the ledger reports ``(8, 1e-5)``; at epsilon 1 the same walk costs under the reserve
    and the plan keeps it (its charge in the events); a noise multiplier alone keeps it too (its charge is
    reported, not spent)."""
    import math

    from numpyro_dppvi.privacy.config import DELTA_RESERVE, budget_delta
    from numpyro_dppvi.pvi.privacy_plan import dp_sgd_plan

    plan = lambda privacy, **kw: dp_sgd_plan(privacy, [2000], 100, 100, 10, 6, calibrate=False, **kw)
    rows = plan(Privacy(epsilon=8.0, delta=1e-5))
    assert rows.row_sampler and np.all(rows.overflow == 0.0) and rows.charges(10) < 1e-12
    walk = plan(Privacy(epsilon=1.0, delta=1e-5))
    assert not walk.row_sampler and walk.overflow[0] > 0.0
    assert (1 + math.e) * walk.charges(10) < DELTA_RESERVE * 1e-5 < (1 + math.exp(8.0)) * walk.charges(10)
    assert not plan(Privacy(noise_multiplier=1.0)).row_sampler
    assert plan(Privacy(noise_multiplier=1.0), budget_epsilon=8.0).row_sampler  # a Flower node's pinned plan

    x = np.random.default_rng(0).normal(size=(2000, 2)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)
    d = dppvi.DPPVI(logistic, method="dp_optimisation", batch_size=100, local_steps=100, rounds=10,
                    privacy=Privacy(epsilon=8.0, delta=1e-5), num_samples=2)
    d.init(jax.random.key(0), [(x, y)])
    assert d.plan.row_sampler and d.rule.row_sampler and d.ledger.delta == budget_delta(1e-5)


def test_without_replacement_sampler_and_substitute_accounting():
    privacy = Privacy(noise_multiplier=1.0, clip=1.0, sampling="without_replacement", neighbouring="substitute",
                      accountant="rdp")
    d = driver(privacy)
    clients = small_clients()
    result = d.run(jax.random.key(0), clients, rounds=1)
    (event,) = result.privacy.events(0)
    assert event.sampling == "without_replacement" and d.rule.sampling == "without_replacement"
    # user noise multiplier 1 (std = C) is 0.5 relative to the substitution sensitivity 2C
    assert event.noise_multiplier == pytest.approx(0.5)
    from numpyro_dppvi.privacy import without_replacement_batch

    masks = jax.vmap(lambda k: without_replacement_batch(k, d.mask[0], d.rule.max_batch)[1])(
        jax.random.split(jax.random.key(1), 10))
    assert d.rule.max_batch == 20 and np.all(np.sum(np.asarray(masks), axis=1) == 20)


def test_budget_is_met_per_client_and_reported():
    clients = small_clients(m=2, n=300)
    clients = [clients[0], (clients[1][0][:120], clients[1][1][:120])]  # two different sampling rates
    result = dppvi.fit_dppvi(logistic, clients, method="dp_optimisation",
                             privacy=Privacy(epsilon=1.0, delta=1e-5, clip=1.0), schedule="sequential",
                             rounds=3, local_steps=5, batch_size=20, rng_key=jax.random.key(0))
    eps = result.privacy.epsilon_per_client
    assert eps.shape == (2,)
    assert np.all(eps <= 1.0) and np.all(eps > 0.98)  # calibrated, not over-noised (rtol 1e-3 on sigma)
    sigmas = result.config["privacy"]["noise_multiplier"]
    assert sigmas[1] > sigmas[0]  # the smaller client samples at a higher rate and needs more noise
    assert result.privacy.epsilon == pytest.approx(eps.max())
    assert "add_remove" in result.privacy.report()


def test_epsilon_max_stops_a_client_and_the_fit_continues():
    clients = small_clients(m=3)
    result = dppvi.fit_dppvi(logistic, clients, method="dp_optimisation",
                             privacy=Privacy(noise_multiplier=1.0, clip=1.0, epsilon_max=[100.0, 0.5, 100.0]),
                             schedule="synchronous", rounds=4, local_steps=5, batch_size=20, rng_key=jax.random.key(0))
    eps = result.privacy.epsilon_per_client
    assert eps[1] <= 0.5 and eps[0] > eps[1]
    stopped = [h for h in result.history if "stopped" in h]
    assert stopped and stopped[0]["stopped"] == [1]
    assert result.privacy.stopped[1]["reason"] == "epsilon_max"
    assert not result.history[-1]["participated"][1] and result.history[-1]["participated"][0]


@pytest.mark.parametrize("public_sizes", [None, 250])
def test_private_resume_continues_the_ledger(tmp_path, public_sizes):
    """A resumed fit equals the uninterrupted one, ledger included; with declared public sizes (issue 24) the
    bound is a saved setting: the ledger keeps saying the sizes were declared, and a resume under another
    bound is refused (its rates, hence its ledger events, would differ)."""
    clients = small_clients()
    privacy = Privacy(noise_multiplier=1.2, clip=1.0, public_sizes=public_sizes)
    full = driver(privacy).run(jax.random.key(4), clients, rounds=4)
    part = driver(privacy).run(jax.random.key(4), clients, rounds=2, checkpoint=tmp_path / "p.ckpt")
    resumed = driver(privacy).resume(tmp_path / "p.ckpt", clients, rounds=4)
    np.testing.assert_array_equal(np.asarray(resumed.q.eta1), np.asarray(full.q.eta1))
    np.testing.assert_allclose(resumed.privacy.epsilon_per_client, full.privacy.epsilon_per_client, rtol=1e-12)
    assert resumed.privacy == full.privacy and part.privacy.num_releases(0) * 2 == full.privacy.num_releases(0)
    assert resumed.privacy.sizes == ("observed" if public_sizes is None else "declared")
    if public_sizes is not None:
        with pytest.raises(ValueError, match="public_sizes"):
            driver(Privacy(noise_multiplier=1.2, clip=1.0, public_sizes=300)).resume(tmp_path / "p.ckpt", clients,
                                                                                      rounds=4)
    d = driver(privacy)
    state = d.init(jax.random.key(4), clients)
    with pytest.raises(ValueError, match="ledger"):
        d.run(None, clients, rounds=1, state=state)


def test_a_checkpoint_saved_without_the_gain_noise_resumes_with_it_at_zero(tmp_path):
    """A private checkpoint of an older version lacks the client state's ``gain_noise``
    (``DPOptimisation.ADDED_STATE``): the resume says so, starts it at zero and continues the ledger. The term
    enters only the noise-aware posterior's sds, so ``q`` as fitted is the uninterrupted fit's, bit for bit."""
    from numpyro_dppvi import checkpoint
    from numpyro_dppvi.pvi.local import DPOptimisation

    clients = small_clients()
    privacy = Privacy(noise_multiplier=1.2, clip=1.0)
    full = driver(privacy).run(jax.random.key(4), clients, rounds=4)
    path = tmp_path / "p.ckpt"
    d = driver(privacy)
    d.run(jax.random.key(4), clients, rounds=2, checkpoint=path)
    arrays, meta = checkpoint.load(path)
    state = checkpoint.unflatten_like(d.init(jax.random.key(4), clients), arrays)
    older = {k: v for k, v in state.client_state.items() if k not in DPOptimisation.ADDED_STATE}
    assert len(older) == len(state.client_state) - 1
    checkpoint.save(path, state._replace(client_state=older), meta, private=True)
    with pytest.warns(UserWarning, match=r"older version, without .*gain_noise.*start at zero"):
        resumed = driver(privacy).resume(path, clients, rounds=4)
    np.testing.assert_array_equal(np.asarray(resumed.q_fitted.eta1), np.asarray(full.q_fitted.eta1))
    assert resumed.privacy == full.privacy
    other = {k: v for k, v in state.client_state.items() if k != "factor_noise"}  # anything else missing: refused
    checkpoint.save(path, state._replace(client_state=other), meta, private=True)
    with pytest.raises(ValueError, match="does not match this fit's configuration"):
        driver(privacy).resume(path, clients, rounds=4)


def test_a_resume_past_a_spent_budget_says_so_and_stops(tmp_path):
    """A fit whose noise is calibrated to 3 rounds, resumed to 6: every budget is spent after round 3, so the
    resume raises with the advice instead of running 3 rounds in which no client takes part (issue 26). The
    convergence advice of a private fit does not send the user to resume=."""
    clients = small_clients()
    privacy = Privacy(epsilon=2.0, delta=1e-5, clip=1.0)
    path = tmp_path / "p.ckpt"
    driver(privacy, rounds=3).run(jax.random.key(4), clients, rounds=3, checkpoint=path)
    with pytest.raises(ValueError, match="budget is spent after round 3"):
        driver(privacy, rounds=3).resume(path, clients, rounds=6)
    drift, _ = convergence_advice("fit_dppvi", "sequential", private=True)
    assert "resume=checkpoint" not in drift and "new fit" in drift
    assert "resume=checkpoint" in convergence_advice("fit_dppvi", "sequential")[0]
    # virtual clients: how far a factor can travel (damping x clip a round) is named; other methods do not have it
    assert "damping x Privacy.clip" in convergence_advice("fit_dppvi", "synchronous", private=True,
                                                          method="virtual_clients")[0]
    assert "Privacy.clip" not in drift


def test_private_method_argument_errors():
    with pytest.raises(TypeError, match="privacy=dppvi.Privacy"):
        dppvi.DPPVI(logistic, method="dp_optimisation", batch_size=10)
    with pytest.raises(ValueError, match="batch_size"):
        dppvi.DPPVI(logistic, method="dp_optimisation", privacy=Privacy(epsilon=1.0))
    with pytest.raises(ValueError, match="not private"):
        dppvi.DPPVI(logistic, privacy=Privacy(epsilon=1.0))
    d = driver(Privacy(epsilon=1.0), batch_size=500)
    with pytest.raises(ValueError, match=r"batch_size=500 is not smaller than client\(s\) \[0, 1, 2\]"):
        d.init(jax.random.key(0), small_clients())


def test_private_baselines_spend_the_budget():
    clients = small_clients(m=3)
    privacy = Privacy(epsilon=2.0, delta=1e-5, clip=1.0)
    g = dppvi.fit_global_vi(logistic, clients, steps=20, steps_per_round=10, batch_size=20, privacy=privacy)
    eps = g.privacy.epsilon_per_client
    assert eps.shape == (3,) and np.allclose(eps, eps[0]) and eps[0] <= 2.0
    (event,) = g.privacy.events(2)
    assert 20 / 600 <= event.rate < 20 / 600 * (1 + 2**-8) and event.count == 20
    b = dppvi.fit_bcm(logistic, clients, local_steps=10, batch_size=20, privacy=privacy)
    assert b.privacy.epsilon <= 2.0 and b.privacy.num_releases(0) == 10
    assert np.all(np.isfinite(np.asarray(b.q.eta1)))


def test_adaptive_clipping_tracks_a_quantile_privately_and_is_accounted():
    """The clip moves from its start towards the target quantile of per-example norms; the ledger
    records one joint (gradient, count) event per step with the calibrated total noise."""
    from numpyro_dppvi.privacy import AdaptiveClip

    clients = small_clients(m=2, n=300)
    privacy = Privacy(epsilon=2.0, delta=1e-5, clip=50.0, adaptive_clip=AdaptiveClip(target_quantile=0.5))
    states = []
    result = dppvi.fit_dppvi(logistic, clients, method="dp_optimisation", privacy=privacy, schedule="synchronous",
                             rounds=4, local_steps=25, batch_size=30, damping=0.5, rng_key=jax.random.key(0),
                             callback=lambda state, entry: states.append(state))
    clip = np.asarray(states[-1].client_state["clip"].clip)
    assert np.all(clip < 3.0), clip  # started at 50; the median per-example norm at the end is ~0.6 (measured), the clip ~0.9
    assert result.privacy.epsilon <= 2.0
    (event,) = result.privacy.events(0)
    assert event.count == 100 and event.noise_multiplier == pytest.approx(privacy.to_event(result.config["privacy"]["noise_multiplier"][0]))


def test_long_private_fits_at_the_defaults_do_not_diverge():
    """Issue 23: a 5-covariate logistic regression with an intercept (weights drawn from the prior), 10
    clients of 200 rows, DP optimisation at epsilon 1 with batches of 100 and otherwise the defaults, 40
    rounds (400 releases per client: noise multiplier ~37, the noise of one release ~70 times a client's
    signal). With Adam at damping 1, 10 of 10 such fits raised FitDiverged (rounds 18-37); with the trace's
    plug-in Newton answers (no noise-aware shrinkage, no trust region) the means drifted to +-100-1000 in
    every one of five. Now every fit runs its 40 rounds and stays where the data put it: each weight within
    1 (the prior's sd) of the truth, the noise-aware sds 0.1-0.2 (measured: errors at most 0.65)."""
    from numpyro_dppvi.example_models import logistic_regression

    for seed in range(5):
        rng = np.random.default_rng(seed)
        w, b = rng.normal(size=5), rng.normal()
        x = rng.normal(size=(2000, 5)).astype(np.float32)
        y = (rng.random(2000) < 1 / (1 + np.exp(-(x @ w + b)))).astype(np.float32)
        clients = dppvi.partition((x, y), num_clients=10, seed=seed)
        result = dppvi.fit_dppvi(logistic_regression, clients, method="dp_optimisation", batch_size=100, rounds=40,
                                 privacy=Privacy(epsilon=1.0, delta=1e-5, clip=1.0), rng_key=jax.random.key(seed))
        assert result.rounds == 40 and result.noise_aware
        loc = np.concatenate([result.posterior["w"]["loc"], [result.posterior["b"]["loc"]]])
        assert np.all(np.abs(loc - np.concatenate([w, [b]])) < 1.0), loc
