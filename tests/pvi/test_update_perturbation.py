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
from numpyro_dppvi.factors import Gaussian
from numpyro_dppvi.privacy import Privacy
from numpyro_dppvi.privacy.mechanisms import tree_norm
from numpyro_dppvi.pvi.shards import make_shards

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
    shifts the means by > 0.2.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 3)).astype(np.float32)
    y = (rng.uniform(size=240) < 1 / (1 + np.exp(-x @ np.array([1.5, -1.0, 0.5])))).astype(np.float32)
    clients = dppvi.partition((x, y), num_clients=2, seed=0)
    layout = make_shards(clients, 3, seed=0)
    shard_clients = [tuple(a[m, k][layout.mask[m, k]] for a in layout.arrays) for m in range(2) for k in range(3)]
    kwargs = dict(schedule="synchronous", rounds=3, local_steps=300, num_samples=64, damping=0.5,
                  optimizer=decaying_adam(300))
    vc = dppvi.fit_dppvi(logistic, clients, method="virtual_clients", shards=3, rng_key=jax.random.key(0), **kwargs)
    pvi = dppvi.fit_dppvi(logistic, shard_clients, method="pvi", rng_key=jax.random.key(1), **kwargs)
    np.testing.assert_allclose(vc.posterior["w"]["loc"], pvi.posterior["w"]["loc"], atol=0.05)
    np.testing.assert_allclose(vc.posterior["w"]["scale"], pvi.posterior["w"]["scale"], rtol=0.05)
    # the client factor is the sum of its virtual factors
    t_sum = factors.product(jax.tree.map(lambda a: a[0], vc.state.client_state["factors"]))
    np.testing.assert_allclose(t_sum.eta2, vc.state.factors.eta2[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["local_averaging", "virtual_clients"])
def test_shard_sum_sensitivity_is_2C_when_one_record_is_replaced(method):
    clip = 0.3
    clients = [(np.asarray(c[0]), np.asarray(c[1])) for c in linreg_clients(n=120, m=1)[0]]
    d = dppvi.DPPVI(linreg, method=method, shards=4, privacy=Privacy(noise_multiplier=1.0, clip=clip),
                    local_steps=30, optimizer=optax.adam(5e-2), rounds=1)
    state = d.init(jax.random.key(0), clients)
    rng = np.random.default_rng(0)
    arrays = tuple(a[0] for a in d.data)
    mask = d.mask[0]
    cs = jax.tree.map(lambda a: a[0], state.client_state)
    if method == "virtual_clients":  # give the virtual factors some history
        cs = dict(cs, factors=Gaussian(jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), -0.2 * jnp.ones((4, 3))))
        released = jax.jit(lambda arr: factors.product(d.rule.clipped_changes(state.q, arr, mask, jax.random.key(1), cs)[0]))
    else:
        released = jax.jit(lambda arr: d.rule.clipped_sum(state.q, state.q, arr, mask, jax.random.key(1), cs)[0])
    base = released(arrays)
    worst = 0.0
    for trial in range(6):
        k, i = trial % 4, trial
        x2 = arrays[0].at[k, i].set(jnp.asarray(rng.normal(size=3) * 20, jnp.float32))
        y2 = arrays[1].at[k, i].set(jnp.float32(rng.normal() * 50))
        diff = float(tree_norm(jax.tree.map(jnp.subtract, released((x2, y2)), base)))
        assert diff <= 2 * clip * (1 + 1e-5)
        worst = max(worst, diff)
    assert worst > clip  # the changed shard's clipped change really moved (beyond C)


def test_trusted_aggregator_noise_shares_add_up_to_the_accounted_noise():
    """Each of the M clients adds sigma C / sqrt(M); the sum over clients has std sigma C.

    Statistical check: 8 clients x (2 x 3 natural parameters) x 400 rounds of noise; the sample std of
    the summed noise over 2400 values has relative standard error 1/sqrt(2 * 2400) = 1.4 %, so 6 %
    (4 se) is the tolerance; a per-client std of sigma C (no split) would give sqrt(8) = 2.8x.
    """
    sigma, clip, m = 1.7, 0.5, 8
    clients = linreg_clients(n=400, m=m)[0]
    d = dppvi.DPPVI(linreg, method="local_averaging", shards=2, schedule="synchronous", trusted_aggregator=True,
                    privacy=Privacy(noise_multiplier=sigma, clip=clip), local_steps=1, rounds=1)
    state = d.init(jax.random.key(0), clients)
    stds = np.asarray(state.client_state["noise_std"])
    np.testing.assert_allclose(stds, sigma * clip / np.sqrt(m), rtol=1e-6)

    def noise_sum(key):
        keys = jax.random.split(key, m)
        def one(i, k):
            cs = jax.tree.map(lambda a: a[i], state.client_state)
            rows = tuple(a[i] for a in d.data)
            noisy, _, _ = d.rule.update(state.q, state.q, rows, d.mask[i], d.sizes[i], k, cs)
            clean, _, _ = d.rule.update(state.q, state.q, rows, d.mask[i], d.sizes[i], k, dict(cs, noise_std=0.0))
            return factors.scale(factors.divide(noisy, clean), 2.0)  # times N_m = 2 shards
        parts = jax.vmap(one)(jnp.arange(m), keys)
        return factors.product(parts)

    sums = jax.jit(jax.vmap(noise_sum))(jax.random.split(jax.random.key(3), 400))
    values = np.concatenate([np.ravel(sums.eta1), np.ravel(sums.eta2)])
    assert abs(values.std() / (sigma * clip) - 1) < 0.06
    small = dppvi.DPPVI(linreg, method="local_averaging", shards=2, schedule="synchronous", trusted_aggregator=True,
                        privacy=Privacy(noise_multiplier=sigma, clip=0.01), local_steps=1, rounds=1)
    result = small.run(jax.random.key(0), clients, rounds=1)
    assert result.privacy.trusted_aggregator
    (event,) = result.privacy.events(0)
    assert event.noise_multiplier == pytest.approx(sigma / 2)  # the full noise over sensitivity 2C


def test_client_level_dp_keeps_q_equal_to_prior_times_factors():
    clients = linreg_clients(n=600, m=6)[0]
    result = dppvi.fit_dppvi(linreg, clients, method="pvi", privacy_unit="client", client_rate=0.5,
                             privacy=Privacy(noise_multiplier=0.8, clip=5.0), schedule="synchronous", rounds=6,
                             local_steps=20, damping=0.5, rng_key=jax.random.key(0))
    q, prior, t = result.state.q, result.adapter.prior, result.state.factors
    recon = factors.multiply(prior, factors.product(t))
    np.testing.assert_allclose(q.eta1, recon.eta1, atol=1e-6 * max(1.0, float(jnp.max(jnp.abs(q.eta1)))) * 10)
    np.testing.assert_allclose(q.eta2, recon.eta2, rtol=1e-6, atol=1e-5)
    eps = result.privacy.epsilon_per_client
    assert np.allclose(eps, eps[0]) and eps[0] > 0
    (event,) = result.privacy.events(0)
    assert event.sampling == "poisson" and event.rate == 0.5 and event.count == 6
    participated = np.array([h["participated"] for h in result.history])
    assert 0 < participated.mean() < 1  # clients really were subsampled
    accepted = [not h.get("rejected_round", False) for h in result.history]
    assert sum(accepted) >= 3, accepted  # the identity is tested on rounds that changed q
    assert float(jnp.max(jnp.abs(q.eta2 - prior.eta2))) > 1.0


def test_invalid_noisy_updates_are_rejected_and_counted():
    clients = linreg_clients(n=200, m=2)[0]
    result = dppvi.fit_dppvi(linreg, clients, method="parameter_perturbation",
                             privacy=Privacy(noise_multiplier=50.0, clip=10.0), schedule="synchronous",
                             rounds=4, local_steps=20, damping=1.0, rng_key=jax.random.key(0))
    counts = [h["invalid_updates"] for h in result.history]
    assert sum(counts) > 0  # huge noise makes precisions negative: rejected, never flipped
    assert bool(factors.is_proper(result.state.q))


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
