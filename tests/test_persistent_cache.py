"""Round programs kept across processes as serialized ``jax.export.Exported`` (issue 25, first fit of a new process).

In-process tests move only the store of exported programs (``persistent_cache._state["folder"]``) to a folder of
their own and drop the in-memory programs (``program_cache._PROGRAMS``) between fits, which is what a new process
sees; one test runs two real processes. ``round_step`` is counted where the driver's programs are built
(``plan.round_step``): a fit served from the store never traces it.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi import persistent_cache, program_cache
from numpyro_dppvi.privacy import Privacy
from numpyro_dppvi.pvi import plan


def clients(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(60, 3)).astype(np.float32)
    y = (rng.uniform(size=60) < 1 / (1 + np.exp(-x @ np.array([1.0, -1.0, 0.5])))).astype(np.float32)
    return dppvi.partition((x, y), num_clients=2, seed=seed)


def model_with_scale(scale):
    @dppvi.model
    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, scale).expand([x.shape[1]]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)
    return model


def model_with_another_body(scale):
    @dppvi.model
    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, scale).expand([x.shape[1]]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w + 0.5), obs=y)
    return model


def fit(model=None, optimizer=None):
    return dppvi.fit_dppvi(model or model_with_scale(1.0), clients(), method="dp_optimisation", batch_size=10,
                           schedule="synchronous", rounds=2, local_steps=3, num_samples=2,
                           optimizer=optimizer or optax.adam(1e-2), privacy=Privacy(noise_multiplier=1.0, clip=1.0),
                           rng_key=jax.random.key(0))


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A store of exported programs of this test's own; counts the traces of ``round_step``; ``new_process()``
    drops the in-memory programs (as a new process starts)."""
    monkeypatch.setitem(persistent_cache._state, "folder", tmp_path)
    traces = []
    honest = plan.round_step

    def round_step(*args):  # counted, under the round's name (JAX names programs after their functions)
        traces.append(1)
        return honest(*args)

    monkeypatch.setattr(plan, "round_step", round_step)
    program_cache._PROGRAMS.clear()

    class Store:
        folder = tmp_path

        @staticmethod
        def traced():
            return len(traces)

        @staticmethod
        def new_process():
            program_cache._PROGRAMS.clear()

        @staticmethod
        def programs():
            return sorted(tmp_path.glob(persistent_cache.PROGRAM_PREFIX + "*"))

    yield Store
    program_cache._PROGRAMS.clear()


def test_a_new_process_runs_the_exported_round_without_tracing_it(store):
    first = fit()
    assert store.traced() == 1 and len(store.programs()) == 1
    assert store.programs()[0].stat().st_mode & 0o077 == 0  # this user's only
    store.new_process()
    second = fit()
    assert store.traced() == 1  # served from the store
    np.testing.assert_array_equal(np.asarray(first.q.eta1), np.asarray(second.q.eta1))
    np.testing.assert_array_equal(np.asarray(first.q.eta2), np.asarray(second.q.eta2))


@pytest.mark.parametrize("change", ["closure value", "model body", "optimizer kind", "optimizer value"])
def test_what_changes_the_program_is_exported_anew(store, change):
    """Across processes as within one (``tests/pvi/test_compiled_programs.py``): a changed closure value, model
    body, optimiser kind or hyperparameter is another program, never the stored one."""
    base = fit()
    changed = {"closure value": lambda: fit(model_with_scale(0.1)),
               "model body": lambda: fit(model_with_another_body(1.0)),
               "optimizer kind": lambda: fit(optimizer=optax.sgd(1e-2)),
               "optimizer value": lambda: fit(optimizer=optax.adam(1e-1))}[change]
    store.new_process()
    after = changed()
    assert store.traced() == 2 and len(store.programs()) == 2
    assert not np.array_equal(np.asarray(base.q.eta1), np.asarray(after.q.eta1))


def test_after_clear_nothing_stored_before_is_served(store):
    """``program_cache.clear()`` is for what no key can see (a library function patched at run time): the programs
    stored before it are not served, and those exported after it carry a random salt."""
    fit()
    program_cache.clear()
    fit()
    assert store.traced() == 2 and len(store.programs()) == 2


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
def test_a_program_others_could_have_written_or_a_damaged_one_is_not_served(store):
    """A stored program another user could have replaced (group- or world-writable) is not run, nor is a damaged
    one: the fit traces and exports its program again."""
    first = fit()
    (path,) = store.programs()
    path.chmod(0o666)
    store.new_process()
    fit()
    assert store.traced() == 2
    path.write_bytes(path.read_bytes()[:100])
    path.chmod(0o600)
    store.new_process()
    again = fit()
    assert store.traced() == 3
    np.testing.assert_array_equal(np.asarray(first.q.eta1), np.asarray(again.q.eta1))


def test_without_the_persistent_cache_nothing_is_stored(store, monkeypatch):
    monkeypatch.setitem(persistent_cache._state, "folder", None)
    fit()
    assert store.traced() == 1 and store.programs() == []


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_path_is_refused_not_taken_for_the_working_directory(path, tmp_path, monkeypatch):
    """``Path("")`` is ``.``: ``enable_compilation_cache("")`` filled the working directory with compiled programs
    and the accountant's signing key. It now raises, naming the fix, and switches nothing on."""
    monkeypatch.chdir(tmp_path)
    previous = jax.config.jax_compilation_cache_dir
    with pytest.raises(ValueError, match="the path is empty. Pass a folder, or None"):
        dppvi.enable_compilation_cache(path)
    assert jax.config.jax_compilation_cache_dir == previous and list(tmp_path.iterdir()) == []


_NEW_PROCESS = """
import sys, jax, numpy as np, optax
sys.path.insert(0, sys.argv[2])
import numpyro_dppvi as dppvi
from numpyro_dppvi.pvi import plan
dppvi.enable_compilation_cache(sys.argv[1])
traces = []
honest = plan.round_step
plan.round_step = lambda *a: traces.append(1) or honest(*a)
from test_persistent_cache import fit
result = fit()
print("traced", len(traces), "eta1", np.asarray(result.q.eta1).tobytes().hex())
"""


def test_a_second_real_process_does_not_trace_the_round(tmp_path):
    """Two processes, another hash seed each: the second reads the first's exported round (the digest uses no
    ``hash()`` or ``id()``) and gives the same posterior."""
    here = os.path.dirname(os.path.abspath(__file__))
    outputs = []
    for seed in ("1", "2"):
        run = subprocess.run([sys.executable, "-c", _NEW_PROCESS, str(tmp_path / "cache"), here], check=True,
                             capture_output=True, text=True,
                             env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONHASHSEED=seed))
        outputs.append(run.stdout.split())
    assert outputs[0][:2] == ["traced", "1"] and outputs[1][:2] == ["traced", "0"]
    assert outputs[0][3] == outputs[1][3]


def test_without_the_persistent_cache_a_private_fit_compiles_its_round_once(store, monkeypatch, caplog):
    """The round compiled ahead (while the accountant calibrates) on placeholder arguments is the one the rounds
    run: the state is committed to the device in both (a committed and an uncommitted argument compile apart)."""
    import logging

    monkeypatch.setitem(persistent_cache._state, "folder", None)
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.DEBUG, logger="jax"):
            fit()
    finally:
        jax.config.update("jax_log_compiles", False)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished XLA compilation of")]
    assert sum("jit(round_step)" in m for m in compiled) == 1, compiled
