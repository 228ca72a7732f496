"""Update perturbation (local averaging, virtual clients, parameter perturbation), trusted aggregator
and client-level DP (Heikkila et al. 2023, §4.2; Liu 2019, §3.3)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi import factors
from numpyro_dppvi.privacy import Privacy

from .conftest import logistic

NOISE = 0.5


@dppvi.model
def linreg(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, NOISE), obs=y)


def linreg_clients(n=400, m=2, seed=0, one_hot=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    if one_hot:  # each row observes one coordinate: diagonal X^T X, so mean-field VI is exact
        x = np.eye(3, dtype=np.float32)[rng.integers(0, 3, size=n)]
    y = (x @ np.array([1.0, -2.0, 0.5]) + NOISE * rng.normal(size=n)).astype(np.float32)
    precision = np.eye(3) + x.T @ x / NOISE**2
    mean = np.linalg.solve(precision, x.T @ y / NOISE**2)
    return dppvi.partition((x, y), num_clients=m, seed=seed), mean, 1 / np.diag(precision)


def decaying_adam(steps, start=5e-2, end=2e-4):
    return optax.adam(optax.exponential_decay(start, steps, end / start))


def test_theorem_10_local_averaging_shards_do_not_change_conjugate_posterior():
    """Conjugate exponential family: 1, 2 and 8 shards give the same (exact) posterior (Theorem 10).

    The theorem averages natural parameters of the model's exponential family; our factors are
    mean-field, so the design is one-hot (each row observes one coordinate) to make the mean-field
    family the exact conjugate one. (With a correlated design the average of mean-field shard
    posteriors differs from the mean-field optimum by up to ~0.4 sd at 8 shards: measured, and
    expected, since diag(P_k) m_k does not average to diag(P) m.)
    Local averaging keeps each shard's optimiser state across rounds, so the learning rate decays over
    all 3 x 400 steps and Adam's second-moment memory is short (b2 = 0.9). With 64 draws the final
    iterate's jitter is a few hundredths of a posterior sd; we require 0.15 sd and 5 %; a wrong KL
    weight (1 instead of 1/N_m) changes the variance by a factor ~N_m.
    """
    clients, mean, var = linreg_clients(one_hot=True)
    optimizer = lambda: optax.adam(optax.exponential_decay(5e-2, 1200, 2e-4 / 5e-2), b2=0.9)
    for shards in (1, 2, 8):
        r = dppvi.fit_dppvi(linreg, clients, method="local_averaging", shards=shards, schedule="synchronous",
                            rounds=3, local_steps=400, num_samples=64, optimizer=optimizer(), damping=1.0,
                            rng_key=jax.random.key(shards))
        post = r.posterior["w"]
        assert np.all(np.abs(post["loc"] - mean) < 0.15 * np.sqrt(var)), (shards, post["loc"], mean)
        np.testing.assert_allclose(post["scale"] ** 2, var, rtol=0.05)
    assert r.config["shards"] == [8, 8]


def test_virtual_clients_without_dp_equal_pvi_with_all_shards_as_clients():
    """Synchronous virtual clients (no DP) == synchronous PVI with the sum_m N_m shards as clients.

    Logistic regression (not conjugate) after 3 damped rounds, i.e. away from the fixed point, so the
    comparison checks the update algebra and not only convergence. Both runs converge their local
    optimisation (decaying learning rate, 64 draws); the remaining Monte Carlo jitter is ~1e-2 in the
    means (measured), so 0.05 absolute is a ~5x margin while a factor missing from a virtual cavity
    shifts the means by > 0.2. The shards are the ones the fit derives (a keyed hash of each record).
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 3)).astype(np.float32)
    y = (rng.uniform(size=240) < 1 / (1 + np.exp(-x @ np.array([1.5, -1.0, 0.5])))).astype(np.float32)
    clients = dppvi.partition((x, y), num_clients=2, seed=0)
    kwargs = dict(schedule="synchronous", rounds=3, local_steps=300, num_samples=64, damping=0.5,
                  optimizer=decaying_adam(300))
    driver = dppvi.DPPVI(logistic, method="virtual_clients", shards=3, **{k: v for k, v in kwargs.items() if k != "rounds"})
    driver.init(jax.random.key(0), clients)
    shard_clients = [tuple(np.asarray(a[m, k])[np.asarray(driver.mask[m, k])] for a in driver.data)
                     for m in range(2) for k in range(3)]
    assert sum(len(c[0]) for c in shard_clients) == 240 and min(len(c[0]) for c in shard_clients) > 0
    states = []
    vc = driver.run(jax.random.key(0), clients, rounds=3, callback=lambda state, entry: states.append(state))
    pvi = dppvi.fit_dppvi(logistic, shard_clients, method="pvi", rng_key=jax.random.key(1), **kwargs)
    np.testing.assert_allclose(vc.posterior["w"]["loc"], pvi.posterior["w"]["loc"], atol=0.05)
    np.testing.assert_allclose(vc.posterior["w"]["scale"], pvi.posterior["w"]["scale"], rtol=0.05)
    # without noise the client factor is the sum of its virtual factors
    last = states[-1]
    t_sum = factors.product(jax.tree.map(lambda a: a[0], last.client_state["factors"]))
    np.testing.assert_allclose(t_sum.eta2, last.factors.eta2[0], rtol=1e-4, atol=1e-4)


def aggregate_noise(d, state, key):
    """The noise part of one trusted-aggregator round's aggregate: the round with noise minus the same
    round (same keys) without it, damping 1."""
    from numpyro_dppvi.pvi.update_perturbation import trusted_aggregator_round

    everyone = jnp.ones(d.num_clients, bool)
    quiet = state._replace(client_state=dict(state.client_state, noise_std=jnp.zeros(d.num_clients)))
    noisy, _ = trusted_aggregator_round(d.rule, 1.0, state, d.data, d.mask, d.sizes, key, everyone)
    clean, _ = trusted_aggregator_round(d.rule, 1.0, quiet, d.data, d.mask, d.sizes, key, everyone)
    return factors.divide(noisy.q, clean.q)


def test_trusted_aggregator_noise_shares_carry_every_clients_accounted_noise():
    """Issue 12, finding 2. Clients with 1 and 4 shards (local averaging divides a client's release
    by its shard count, so client 0's records enter the aggregate with weight 1, client 1's with 1/4):
    the aggregate's noise must have std >= sigma C (client 0's accounted noise at weight 1). The old
    rule (every client sigma C / sqrt(M)) gives sigma C sqrt((1 + 1/16) / 2) = 0.73 sigma C.

    Statistical check: 400 rounds x (2 x 3 natural parameters) = 2400 values; the sample std has
    relative standard error 1/sqrt(2 * 2400) = 1.4 %, so 6 % (4 se) is the tolerance.
    """
    sigma, clip = 1.7, 0.5
    data = linreg_clients(n=200, m=2)[0]
    clients = [tuple(a[:40] for a in data[0]), data[1]]
    d = dppvi.DPPVI(linreg, method="local_averaging", shards=lambda n: 1 if n == 40 else 4, schedule="synchronous",
                    trusted_aggregator=True, privacy=Privacy(noise_multiplier=sigma, clip=clip), local_steps=1,
                    rounds=1)
    state = d.init(jax.random.key(0), clients)
    assert list(d.num_shards) == [1, 4]
    np.testing.assert_allclose(np.asarray(state.client_state["noise_std"]), sigma * clip, rtol=1e-6)
    # a precise public q (precision 200), so that no noisy proposal is improper and rejected
    state = state._replace(q=factors.Gaussian(jnp.zeros(3), jnp.full(3, -100.0)))
    noise = jax.jit(jax.vmap(lambda k: aggregate_noise(d, state, k)))(jax.random.split(jax.random.key(3), 400))
    values = np.concatenate([np.ravel(noise.eta1), np.ravel(noise.eta2)])
    assert abs(values.std() / (sigma * clip) - 1) < 0.06
    small = dppvi.DPPVI(linreg, method="local_averaging", shards=2, schedule="synchronous", trusted_aggregator=True,
                        privacy=Privacy(noise_multiplier=sigma, clip=0.01), local_steps=1, rounds=1)
    result = small.run(jax.random.key(0), clients, rounds=1)
    assert result.privacy.trusted_aggregator
    (event,) = result.privacy.events(0)
    assert event.noise_multiplier == pytest.approx(sigma / 2)  # the full noise over sensitivity 2C


@pytest.mark.parametrize("method", ["local_averaging", "virtual_clients"])
def test_trusted_aggregator_private_state_holds_no_noise_share(method):
    """Issue 12, finding 4: a client's factor and its per-shard state feed its later releases, so they
    must not hold a partial noise share (a later release could reveal it). The same round with and
    without noise leaves every client's private state identical; the noise sits in the server's
    noise factor, and q = prior * prod_m t_m * t_noise exactly."""
    clients = linreg_clients(n=240, m=3)[0]
    d = dppvi.DPPVI(linreg, method=method, shards=4, schedule="synchronous", trusted_aggregator=True,
                    privacy=Privacy(noise_multiplier=0.5, clip=0.5), local_steps=5, rounds=2,
                    optimizer=optax.adam(5e-2))
    state = d.init(jax.random.key(0), clients)
    quiet = state._replace(client_state=dict(state.client_state, noise_std=jnp.zeros(3)))
    limits = jnp.full(3, 10, jnp.int32)
    noisy, _ = d._round(state, d.data, d.mask, d.sizes, limits)
    clean, _ = d._round(quiet, d.data, d.mask, d.sizes, limits)
    assert not np.allclose(np.asarray(noisy.q.eta1), np.asarray(clean.q.eta1))
    np.testing.assert_array_equal(np.asarray(noisy.factors.eta1), np.asarray(clean.factors.eta1))
    np.testing.assert_array_equal(np.asarray(noisy.factors.eta2), np.asarray(clean.factors.eta2))
    for a, b in zip(jax.tree_util.tree_leaves({k: v for k, v in noisy.client_state.items() if k != "noise_std"}),
                    jax.tree_util.tree_leaves({k: v for k, v in clean.client_state.items() if k != "noise_std"})):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    recon = factors.multiply(factors.multiply(factors.multiply(d.adapter.prior, noisy.server_factor),
                                              factors.product(noisy.factors)), noisy.noise_factor)
    np.testing.assert_allclose(noisy.q.eta1, recon.eta1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(noisy.q.eta2, recon.eta2, rtol=1e-5, atol=1e-5)


def test_virtual_clients_private_factors_hold_no_noise_share():
    """Without a trusted aggregator too: the virtual factors take only their own clipped changes."""
    clients = linreg_clients(n=120, m=2)[0]
    d = dppvi.DPPVI(linreg, method="virtual_clients", shards=3, schedule="synchronous",
                    privacy=Privacy(noise_multiplier=0.05, clip=0.5), local_steps=5, rounds=2, invalid="floor",
                    optimizer=optax.adam(5e-2))
    state = d.init(jax.random.key(0), clients)
    quiet = state._replace(client_state=dict(state.client_state, noise_std=jnp.zeros(2)))
    limits = jnp.full(2, 10, jnp.int32)
    noisy, _ = d._round(state, d.data, d.mask, d.sizes, limits)
    clean, _ = d._round(quiet, d.data, d.mask, d.sizes, limits)
    np.testing.assert_array_equal(np.asarray(noisy.client_state["factors"].eta1),
                                  np.asarray(clean.client_state["factors"].eta1))
    assert not np.array_equal(np.asarray(noisy.factors.eta1), np.asarray(clean.factors.eta1))


def test_client_level_dp_keeps_q_equal_to_prior_times_factors_and_noise(tmp_path):
    """Issue 12, finding 3: the noise is a server-held factor, q = prior * prod_m t_m * t_noise exactly,
    and each client's factor holds only its own clipped changes."""
    clients = linreg_clients(n=600, m=6)[0]
    states = []
    result = dppvi.fit_dppvi(linreg, clients, method="pvi", privacy_unit="client", client_rate=0.5,
                             privacy=Privacy(noise_multiplier=0.8, clip=5.0), schedule="synchronous", rounds=6,
                             local_steps=20, damping=0.5, rng_key=jax.random.key(0), checkpoint=tmp_path / "c.ckpt",
                             callback=lambda state, entry: states.append(state))
    last = states[-1]
    q, prior = result.q, result.adapter.prior
    recon = factors.multiply(factors.multiply(prior, factors.product(last.factors)), last.noise_factor)
    np.testing.assert_allclose(q.eta1, recon.eta1, atol=1e-6 * max(1.0, float(jnp.max(jnp.abs(q.eta1)))) * 10)
    np.testing.assert_allclose(q.eta2, recon.eta2, rtol=1e-6, atol=1e-5)
    assert float(jnp.max(jnp.abs(last.noise_factor.eta1))) > 0  # the noise is there, held by the server
    eps = result.privacy.epsilon_per_client
    assert np.allclose(eps, eps[0]) and eps[0] > 0
    (event,) = result.privacy.events(0)
    assert event.sampling == "poisson" and event.rate == 0.5 and event.count == 6
    # the client sample stays private: not in the published history, only in the private checkpoint
    assert all("participated" not in h and "communications" not in h for h in result.history)
    assert result.updates is None  # per-client counts of rounds taken part would publish the sample too
    from numpyro_dppvi import checkpoint

    _, meta = checkpoint.load(tmp_path / "c.ckpt")
    participated = np.array([h["participated"] for h in meta["private_history"]])
    assert 0 < participated.mean() < 1  # clients really were subsampled
    assert float(jnp.max(jnp.abs(q.eta2 - prior.eta2))) > 1.0


def test_invalid_noisy_updates_are_rejected_and_counted():
    """Noise of std 500 on a change clipped to norm 10 decides by its signs which updates keep every precision
    positive. Key 1 rejects 7 of the 8 updates (measured; key 0 rejects all 8, and the fit raises NoValidUpdates,
    tests/test_diagnostics.py): the rejected ones are counted, never flipped, and q stays proper."""
    clients = linreg_clients(n=200, m=2)[0]
    result = dppvi.fit_dppvi(linreg, clients, method="parameter_perturbation",
                             privacy=Privacy(noise_multiplier=50.0, clip=10.0), schedule="synchronous",
                             rounds=4, local_steps=20, damping=1.0, rng_key=jax.random.key(1))
    counts = [h["invalid_updates"] for h in result.history]
    assert 0 < sum(counts) < 8  # huge noise makes precisions negative: rejected, never flipped
    assert bool(factors.is_proper(result.q))


def test_update_perturbation_argument_errors():
    with pytest.raises(ValueError, match="needs shards"):
        dppvi.DPPVI(linreg, method="local_averaging")
    with pytest.raises(ValueError, match="trusted_aggregator"):
        dppvi.DPPVI(linreg, method="local_averaging", shards=2, trusted_aggregator=True,
                    privacy=Privacy(noise_multiplier=1.0), schedule="sequential")
    with pytest.raises(ValueError, match="client-level"):
        dppvi.DPPVI(linreg, privacy_unit="client", privacy=Privacy(noise_multiplier=1.0), schedule="asynchronous")
    with pytest.raises(ValueError, match="invalid-update rule"):
        dppvi.DPPVI(linreg, method="local_averaging", shards=2, invalid="flip")


LAPACK_PRIMITIVES = {"cholesky", "lu", "triangular_solve", "eigh", "qr", "geqrf", "householder_product", "svd"}


def lapack_batches(jaxpr) -> list[tuple[str, tuple, int]]:
    """``(primitive, operand shape, batch x n^3)`` of every LAPACK-backed equation of ``jaxpr``, sub-programs
    (scan, while, cond, pjit) included."""
    from jax.extend import core

    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in LAPACK_PRIMITIVES:
            shape = eqn.invars[0].aval.shape
            out.append((eqn.primitive.name, shape, int(np.prod(shape[:-2])) * shape[-1] ** 3))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, core.ClosedJaxpr):
                    out += lapack_batches(sub.jaxpr)
                elif isinstance(sub, core.Jaxpr):
                    out += lapack_batches(sub)
    return out


def test_lapack_safe_chunk_is_the_largest_batch_under_jaxlibs_parallel_threshold():
    from numpyro_dppvi.pvi.full_rank import LAPACK_PARALLEL_WORK, lapack_safe_chunk

    for dim, outer in [(6, 10), (6, 1), (3, 100), (20, 10), (40, 10)]:
        k = lapack_safe_chunk(dim, outer)
        assert k >= 1
        if outer * dim**3 < LAPACK_PARALLEL_WORK:
            assert outer * k * dim**3 < LAPACK_PARALLEL_WORK <= outer * (k + 1) * dim**3
        else:  # the vmap over clients alone reaches it: chunks of one shard, the least the shards can do
            assert k == 1


def test_map_in_chunks_equals_one_vmap_whatever_the_chunk():
    """Chunks that do not divide the shards (7 shards in chunks of at most 3: three chunks of 3, one padded
    copy dropped) give the same values as one vmap, keys included."""
    from numpyro_dppvi.pvi.full_rank import map_in_chunks

    def fn(a, k):
        return {"x": jnp.linalg.cholesky(a @ a.T + jnp.eye(3)), "draw": jax.random.normal(k, (2,))}

    a = jax.random.normal(jax.random.key(0), (7, 3, 3))
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(1), i))(jnp.arange(7))
    whole = map_in_chunks(fn, (a, keys), None)
    for chunk in (1, 3, 7, 100):
        chunked = map_in_chunks(fn, (a, keys), chunk)
        assert jax.tree.map(jnp.shape, chunked) == jax.tree.map(jnp.shape, whole)
        jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6), chunked, whole)


@pytest.mark.parametrize("method", ["virtual_clients", "local_averaging"])
def test_dense_shard_rules_keep_every_lapack_batch_on_the_calling_thread(method):
    """jaxlib 0.10's batched LAPACK kernels split a call whose ``batch x cost`` reaches 200,000 over the intra-op
    pool and block a worker until the pieces are done; two such calls run concurrently hung the full-rank
    virtual-clients round (10 clients x 1,000 one-record shards, ``D = 6``: batches of 10,000, every thread
    idle; pvi.full_rank.lapack_safe_chunk). The round program of both dense shard rules at that size must hold
    no LAPACK call at or above the threshold (with one ``vmap`` over the shards the largest is 270,000 here,
    ``D = 3``)."""
    import functools

    from numpyro_dppvi.pvi.full_rank import LAPACK_PARALLEL_WORK
    from numpyro_dppvi.pvi.plan import round_step

    clients, _, _ = linreg_clients(n=10000, m=10)  # 1,000 rows a client
    extra = {"shards": "rows"} if method == "local_averaging" else {}
    d = dppvi.DPPVI(linreg, method=method, family="full_rank", rounds=2, privacy=Privacy(epsilon=8.0, delta=1e-5),
                    **extra)
    state = d.init(jax.random.key(0), clients)
    jaxpr = jax.make_jaxpr(functools.partial(round_step, d.spec))(state, d.data, d.mask, d.sizes,
                                                                   d.limits(state, 1), d._server_noise_std)
    batches = lapack_batches(jaxpr.jaxpr)
    assert batches, "the full-rank shard updates use LAPACK"
    assert d.data[0].shape[:2] == (10, 1000)  # 10,000 shards: one vmap would batch 10,000 problems
    worst = max(batches, key=lambda b: b[2])
    assert worst[2] < LAPACK_PARALLEL_WORK, worst
