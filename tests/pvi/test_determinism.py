"""Determinism and PRNG-key hygiene of the PVI engine (issue 7, item 5).

* Same inputs and ``rng_key`` give bit-identical posteriors, factors and ledgers for every method
  and schedule (tiny sizes); a different key gives a different private fit (the key is used).
* Noise keys are never reused across clients, rounds, shards or local steps: every Gaussian draw
  the engine makes goes through ``jax.random.normal`` (Monte Carlo draws) or the privacy noise
  sampler ``privacy.noise.standard_normal``; the tests wrap both so that each call reports the key
  it was given (``jax.debug.callback`` works inside ``jit``, ``vmap`` and ``scan``), run a few
  rounds, and require every recorded key to be distinct. A key used twice would give two
  clients (or rounds, or shards) the same noise, which cancels in differences and breaks the
  accounting's independence assumption.
"""

import traceback

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi import program_cache as cache
from numpyro_dppvi.privacy import Privacy, gaussian_noise_like
from numpyro_dppvi.privacy import noise as noise_module


@dppvi.model
def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def tiny_clients(m=3, n=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m * n, 2)).astype(np.float32)
    y = (rng.uniform(size=m * n) < 1 / (1 + np.exp(-x @ np.array([1.0, -1.0])))).astype(np.float32)
    return dppvi.partition((x, y), num_clients=m, seed=seed)


PRIVATE = Privacy(noise_multiplier=2.0, clip=1.0)
CONFIGS = {
    "pvi": dict(method="pvi"),
    "dp_optimisation": dict(method="dp_optimisation", batch_size=3, privacy=PRIVATE),
    "local_averaging": dict(method="local_averaging", shards=2, privacy=PRIVATE),
    "virtual_clients": dict(method="virtual_clients", shards=2, privacy=PRIVATE),
    "parameter_perturbation": dict(method="parameter_perturbation", privacy=PRIVATE),
}
CASES = [(name, schedule) for name in CONFIGS for schedule in ("sequential", "synchronous", "asynchronous")]
CASES += [("trusted_aggregator", "synchronous"), ("client_level", "synchronous")]


def options(name):
    if name == "trusted_aggregator":
        return dict(CONFIGS["local_averaging"], trusted_aggregator=True)
    if name == "client_level":
        return dict(method="pvi", privacy_unit="client", client_rate=0.5, privacy=PRIVATE, invalid="floor")
    return CONFIGS[name]


def fit(name, schedule, key, rounds=2, clients=None):
    """A fit and its final private state (captured by the callback: a result holds no state)."""
    states = []
    result = dppvi.fit_dppvi(logistic, tiny_clients() if clients is None else clients, schedule=schedule,
                             rounds=rounds, local_steps=2, num_samples=2, damping=0.5, optimizer=optax.adam(5e-2),
                             rng_key=key, callback=lambda state, entry: states.append(state), **options(name))
    return result, states[-1]


def state_arrays(state):
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves((state.q, state.factors, state.noise_factor))]


@pytest.mark.slow
@pytest.mark.parametrize("name,schedule", CASES)
def test_same_key_gives_bit_identical_results(recorded_normal_keys, name, schedule):
    """Two runs from the same initial state and key (one driver, compiled once) agree bit for bit;
    the same state with another base key gives another result wherever the fit is random. The first
    run's Gaussian draws (2 rounds x 3 clients x 2 steps or shards) all have distinct keys."""
    d = dppvi.DPPVI(logistic, schedule=schedule, rounds=2, local_steps=2, num_samples=2, damping=0.5,
                    optimizer=optax.adam(5e-2), **options(name))
    clients = tiny_clients()
    start = d.init(jax.random.key(7), clients)

    def run(state):
        ledger = None if d.privacy is None else d.privacy.ledger(len(clients), d.trusted_aggregator)
        states = []
        result = d.run(None, clients, rounds=2, state=state, ledger=ledger, callback=lambda s, e: states.append(s))
        return result, states[-1]

    first, first_state = run(start)
    assert assert_all_distinct(recorded_normal_keys) >= 2 * 3 * 2
    second, second_state = run(start)
    for a, b in zip(state_arrays(first_state), state_arrays(second_state)):
        np.testing.assert_array_equal(a, b)
    assert [h.get("participated") for h in first.history] == [h.get("participated") for h in second.history]
    if first.is_private:
        assert first.privacy == second.privacy
        np.testing.assert_array_equal(first.privacy.epsilon_per_client, second.privacy.epsilon_per_client)
    if name != "pvi" or schedule == "asynchronous":  # randomness in the result: another key must change it
        _, other = run(start._replace(key=jax.random.key_data(jax.random.key(8))))
        assert any(not np.array_equal(a, b) for a, b in zip(state_arrays(first_state), state_arrays(other)))


def test_same_key_gives_bit_identical_results_quick():
    """Two separate fits (separate set-up and compilation): DP optimisation, synchronous."""
    first, first_state = fit("dp_optimisation", "synchronous", jax.random.key(3), rounds=1)
    second, second_state = fit("dp_optimisation", "synchronous", jax.random.key(3), rounds=1)
    for a, b in zip(state_arrays(first_state), state_arrays(second_state)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(first.q.eta1, second.q.eta1)


# --------------------------------------------------------------------------- key hygiene

ENGINE_FILES = ("pvi/local.py", "pvi/update_perturbation.py", "pvi/server.py", "privacy/mechanisms.py",
                "privacy/noise.py", "vips/release.py")


#: Monte Carlo of a noise-aware posterior: post-processing of the releases with a public key (fixed by default, by
#: design), not a draw of the fit. Recording it would put a callback into each of its thousands of vmapped draws
#: (the federated VIPS test's noise-aware program then compiled in 57 s against 2.5 s).
POST_PROCESSING = (("vips/linear.py", "noisy_statistics_posterior"),)


def _from_engine():
    """True when the draw is made by a local rule, the server or a mechanism (not, e.g., the model
    adapter's one-off structure trace of the model, which uses a fixed key and touches no data, nor the
    :data:`POST_PROCESSING` of a noise-aware posterior)."""
    stack = [(f.filename.replace("\\", "/"), f.name) for f in traceback.extract_stack()]
    if any(path.endswith(file) and name == function for path, name in stack for file, function in POST_PROCESSING):
        return False
    return any(path.endswith(ENGINE_FILES) for path, _ in stack)


@pytest.fixture(scope="module")
def _normal_key_recorder():
    """The recorder, installed once for this module's tests that use it and the ones after them: ``jax.random.normal``
    and the noise sampler patched to report each key they are given (at run time, through a callback traced into
    the program) into one list. Programs are keyed by structure, and a patched library function is invisible to the
    key: the program cache is cleared when the recorder is installed (no program traced without it is reused) and
    when it is removed (no later module reuses a program traced with it). While it is installed every program is
    traced with it, so the tests share their compiled programs (one compilation per structure, as in a fit) and
    each one's draws still report to the list."""
    seen = []

    def recording(original):
        def draw(key, *args, **kwargs):
            if _from_engine():
                data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
                jax.debug.callback(lambda d: seen.append(np.asarray(d).reshape(-1, 2).copy()), data)
            return original(key, *args, **kwargs)
        return draw

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax.random, "normal", recording(jax.random.normal))
        patch.setattr(noise_module, "standard_normal", recording(noise_module.standard_normal))
        cache.clear()  # programs are keyed by structure: a patched library function is invisible to the key
        yield seen
        cache.clear()  # and no later test may reuse a program traced with the recorder


@pytest.fixture
def recorded_normal_keys(_normal_key_recorder):
    """Every key passed by the engine to ``jax.random.normal`` (Monte Carlo draws) or to the privacy
    noise sampler during the test, as rows of raw key data."""
    jax.effects_barrier()  # no callback of an earlier test still on its way into the list
    _normal_key_recorder.clear()
    yield _normal_key_recorder
    jax.effects_barrier()


def assert_all_distinct(seen):
    keys = np.concatenate(seen)
    unique = np.unique(keys, axis=0)
    assert len(keys) > 0
    assert unique.shape[0] == keys.shape[0], f"{keys.shape[0] - unique.shape[0]} of {keys.shape[0]} normal draws reused a key"
    return keys.shape[0]


def test_no_normal_draw_reuses_a_key_quick(recorded_normal_keys):
    """Default-suite representative: DP optimisation noise and draws over 2 rounds x 3 clients x 2 steps."""
    fit("dp_optimisation", "synchronous", jax.random.key(0), rounds=2)
    # per round, client and step: one draw of the Monte Carlo eps and one noise draw for the whole release (an optax
    # step of a mean-field q: the loc and log-scale blocks, objectives.per_example_scaled_grads, and the adaptive
    # clip's count, Privacy's default, from one draw of the sampler: noise.add_gaussian_noise)
    assert assert_all_distinct(recorded_normal_keys) == 2 * 3 * 2 * 2


def test_the_recorder_detects_a_reused_key(recorded_normal_keys):
    """The check can fail: two noise draws from one key are reported."""
    noise = lambda k: gaussian_noise_like(k, jnp.zeros(2), 1.0)
    jax.jit(lambda k: noise(k) + noise(k))(jax.random.key(0))
    with pytest.raises(AssertionError, match="reused a key"):
        assert_all_distinct(recorded_normal_keys)


def test_resumed_rounds_use_new_keys(recorded_normal_keys):
    """A fit stopped after round 1 and resumed draws round 2 from the round-2 keys: the union of
    both parts has no repeated key (``round_key = fold_in(base, round)`` with the saved round)."""
    clients = tiny_clients()
    driver = lambda: dppvi.DPPVI(logistic, method="dp_optimisation", batch_size=3, privacy=PRIVATE, rounds=2,
                                 local_steps=2, num_samples=2, damping=0.5, optimizer=optax.adam(5e-2))
    first = driver()
    states = []
    part = first.run(jax.random.key(0), clients, rounds=1, callback=lambda s, e: states.append(s))
    first.run(None, clients, rounds=1, state=states[-1], history=part.history, ledger=part.privacy)
    assert_all_distinct(recorded_normal_keys)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_federated_vips_is_bit_identical_and_draws_fresh_keys(recorded_normal_keys, schedule):
    """``fit_dppvi(method="vips")``: same key, same posterior bit for bit; each client's noisy ESS
    release in each round has its own keys."""
    from numpyro_dppvi.vips import BayesianLinearRegression

    model = BayesianLinearRegression(2, noise_scale=1.0, feature_bound=3.0, target_bound=1.0)
    clients = tiny_clients()

    def run(key):
        return dppvi.fit_dppvi(model, clients, method="vips", schedule=schedule, rounds=2, damping=0.5,
                               privacy=PRIVATE, rng_key=key)

    first = run(jax.random.key(1))
    assert assert_all_distinct(recorded_normal_keys) >= 2 * 3
    second, other = run(jax.random.key(1)), run(jax.random.key(2))
    leaves = lambda r: [np.asarray(a) for a in jax.tree_util.tree_leaves(r.params)]
    for a, b in zip(leaves(first), leaves(second)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(first), leaves(other)))
