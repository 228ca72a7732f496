"""Compiled programs are reused across fits of the same structure (issue 13).

JAX reports every compilation through ``jax.monitoring`` (``/jax/core/compile/...`` events); a
second ``fit_dppvi`` of the same model, settings and data shapes (and a resume, or another
``init``) must trigger none: the model is traced once per model and row shapes, and each round
program is built once per structure (``numpyro_dppvi.program_cache``).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import monitoring

import numpyro_dppvi as dppvi
from numpyro_dppvi import program_cache as cache
from numpyro_dppvi.privacy import Privacy

from .conftest import logistic

COMPILE_EVENTS = []
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kwargs: COMPILE_EVENTS.append(name) if "/compile/" in name else None)


def clients(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(150, 3)).astype(np.float32)
    y = (rng.uniform(size=150) < 1 / (1 + np.exp(-x @ np.array([1.0, -1.0, 0.5])))).astype(np.float32)
    return dppvi.partition((x, y), num_clients=3, seed=seed)


@pytest.mark.parametrize("options", [
    dict(),
    dict(method="dp_optimisation", batch_size=10, privacy=Privacy(noise_multiplier=1.0, clip=1.0)),
    dict(method="virtual_clients", privacy=Privacy(noise_multiplier=1.0, clip=1.0)),
], ids=["pvi", "dp_optimisation", "virtual_clients"])
def test_a_second_fit_of_the_same_structure_compiles_nothing(options, tmp_path):
    kwargs = dict(schedule="synchronous", rounds=2, local_steps=3, num_samples=2, **options)
    first = dppvi.fit_dppvi(logistic, clients(0), checkpoint=tmp_path / "fit.ckpt", **kwargs)
    COMPILE_EVENTS.clear()
    second = dppvi.fit_dppvi(logistic, clients(1), **kwargs)  # other data, same shapes
    resumed = dppvi.fit_dppvi(logistic, clients(0), resume=tmp_path / "fit.ckpt", **dict(kwargs, rounds=3))
    assert COMPILE_EVENTS == []
    assert second.rounds == 2 and resumed.rounds == 3 and first.rounds == 2
    # a different structure (more clients) does compile: the check can fail
    dppvi.fit_dppvi(logistic, clients(0) + clients(1), **kwargs)
    assert COMPILE_EVENTS


def test_hashed_shards_of_another_key_compile_nothing():
    """Issue 25: a record's shard comes from a keyed hash, so shard sizes change with the fit's key; the layout pads
    them to a bound from the public sizes and shard counts (:func:`~numpyro_dppvi.pvi.shards.padded_shard_rows`),
    so a fit with another key compiles nothing. (Padded to the largest shard, as before, four shard secrets give
    largest shards of 23, 21, 23 and 20 rows here: three layouts, three programs.)"""
    from numpyro_dppvi.pvi.shards import make_shards

    kwargs = dict(method="local_averaging", shards=3, schedule="synchronous", rounds=2, local_steps=3, num_samples=2,
                  privacy=Privacy(noise_multiplier=1.0, clip=1.0))
    data = clients(0)
    largest = {int(make_shards(data, 3, bytes([k] * 32)).mask.sum(-1).max()) for k in range(4)}
    dppvi.fit_dppvi(logistic, data, rng_key=jax.random.key(0), **kwargs)
    COMPILE_EVENTS.clear()
    for k in (1, 2, 3):
        dppvi.fit_dppvi(logistic, data, rng_key=jax.random.key(k), **kwargs)
    assert COMPILE_EVENTS == []
    assert len(largest) > 1  # the keys do give shards of different sizes: the check can fail


_NEW_PROCESS = r"""
import json, logging, re, sys
import jax
import numpy as np
import numpyro_dppvi as dppvi
from numpyro_dppvi.example_models import logistic_regression
from numpyro_dppvi.privacy import Privacy, backends

dppvi.enable_compilation_cache(sys.argv[1])
programs, computed = [], []


class Programs(logging.Handler):
    def emit(self, record):
        found = re.match(r"Finished tracing (\S+) for jit", record.getMessage())
        if found:
            programs.append(found.group(1))


jax.config.update("jax_log_compiles", True)
logging.getLogger("jax").addHandler(Programs())
logging.getLogger("jax").setLevel(logging.DEBUG)
pld = backends._pld_epsilon
backends._pld_epsilon = lambda *args: computed.append(args) or pld(*args)
rng = np.random.default_rng(0)
x = rng.normal(size=(240, 3)).astype(np.float32)
y = (rng.uniform(size=240) < 1 / (1 + np.exp(-x @ np.array([1.0, -1.0, 0.5])))).astype(np.float32)
result = dppvi.fit_dppvi(logistic_regression, dppvi.partition((x, y), num_clients=3, seed=0),
                         method="dp_optimisation", privacy=Privacy(epsilon=1.0, delta=1e-5, clip=1.0),
                         rounds=2, local_steps=3, batch_size=20, num_samples=2)
print(json.dumps({"programs": programs, "accountant_runs": len(computed),
                  "epsilon": result.privacy.epsilon.hex()}))
"""


def first_fit_in_a_new_process(cache) -> dict:
    out = subprocess.run([sys.executable, "-c", _NEW_PROCESS, str(cache)], check=True, capture_output=True,
                         text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_first_fit_of_a_new_process_compiles_only_its_own_programs_and_reads_its_accounting(tmp_path):
    """A new process pays for the fit's own programs only: the model's traces, the initial state,
    the round, the noise-aware posterior and its widening by the noise (set-up by transfers, not by dozens of one-operation programs: 61
    before issue 13's second pass), and the one-operation program that tells whether XLA knows the package's compiler
    options (``program_cache.xla_options_probe``); with a persistent cache filled by an earlier process it computes no PLD (the
    accountant's answers are read, signed) and its ledger reports the same epsilon to the last bit. The round is
    traced twice in the first process (exported, then its exported program's call: a few operations) and only as that
    call in the second, which reads the exported round (``persistent_cache.ExportedProgram``)."""
    empty = first_fit_in_a_new_process(tmp_path / "cache")
    warm = first_fit_in_a_new_process(tmp_path / "cache")
    fit_programs = ["initial_state", "model_traces", "posterior_with_rule", "widening", "xla_options_probe"]
    assert sorted(empty["programs"]) == sorted(fit_programs + ["round_step", "round_step"])
    assert sorted(warm["programs"]) == sorted(fit_programs + ["round_step"])
    assert empty["accountant_runs"] >= 1 and warm["accountant_runs"] == 0
    assert warm["epsilon"] == empty["epsilon"]


# --------------------------------------------------------------------------- keys by structure (issue 25)

SCALE = 1.0  # read by ``module_level_model``: rebinding it must give a new program


def module_level_model(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, SCALE).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def model_with_prior_scale(scale=1.0):
    """A model made afresh on every call, as a script or notebook cell re-running its ``def`` makes it."""
    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, scale).expand([x.shape[1]]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)
    return model


def model_with_another_body(scale=1.0):
    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, scale).expand([x.shape[1]]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w - 1.0), obs=y)
    return model


def written_afresh(model=None, optimizer=None, **extra):
    """``fit_dppvi`` as a user's script writes it: every argument built in the call."""
    return dppvi.fit_dppvi(model or model_with_prior_scale(), clients(0), method="dp_optimisation", batch_size=10,
                           schedule="synchronous", rounds=2, local_steps=3, num_samples=2,
                           optimizer=optimizer or optax.adam(1e-2), privacy=Privacy(noise_multiplier=1.0, clip=1.0),
                           rng_key=jax.random.key(0), **extra)


def test_a_second_fit_written_afresh_compiles_nothing():
    """Issue 25: ``optax.adam(1e-2)`` written in the call, the model re-defined by the same ``def`` and a fresh
    ``Privacy``: the second fit compiles nothing (keyed by identity, it compiled the whole fit again) and gives
    the first fit's posterior."""
    first = written_afresh()
    COMPILE_EVENTS.clear()
    second = written_afresh()
    assert COMPILE_EVENTS == []
    np.testing.assert_array_equal(np.asarray(first.q.eta1), np.asarray(second.q.eta1))


def fresh_programs(fit):
    """``fit()`` with every cached program dropped first: what the fit computes when nothing can be reused."""
    cache._PROGRAMS.clear()
    return fit()


@pytest.mark.parametrize("change", ["closure value", "model body", "optimizer kind", "global value"])
def test_what_changes_the_program_compiles_anew(change, monkeypatch):
    """A changed closure value (the prior scale), model body, optimiser kind (sgd for adam) or a global the model
    reads (rebound between fits) each build a new program, whose result is the one a process with no cached
    program computes: no stale program is reused."""
    base = {"closure value": lambda: written_afresh(model_with_prior_scale(1.0)),
            "model body": lambda: written_afresh(model_with_prior_scale(1.0)),
            "optimizer kind": lambda: written_afresh(optimizer=optax.adam(1e-2)),
            "global value": lambda: written_afresh(module_level_model)}[change]
    changed = {"closure value": lambda: written_afresh(model_with_prior_scale(0.1)),
               "model body": lambda: written_afresh(model_with_another_body(1.0)),
               "optimizer kind": lambda: written_afresh(optimizer=optax.sgd(1e-2)),
               "global value": lambda: written_afresh(module_level_model)}[change]
    before = base()
    if change == "global value":
        monkeypatch.setattr(sys.modules[__name__], "SCALE", 0.1)
    COMPILE_EVENTS.clear()
    after = changed()
    assert COMPILE_EVENTS
    assert not np.array_equal(np.asarray(before.q.eta1), np.asarray(after.q.eta1))
    np.testing.assert_array_equal(np.asarray(after.q.eta1), np.asarray(fresh_programs(changed).q.eta1))


# --------------------------------------------------------------------------- calibration meanwhile (issue 25)

def budget_fit(**extra):
    return dppvi.fit_dppvi(logistic, clients(0), method="dp_optimisation", batch_size=10, schedule="synchronous",
                           rounds=2, local_steps=3, num_samples=2, rng_key=jax.random.key(3), **extra)


def test_compiling_while_the_accountant_searches_gives_the_fit_that_calibrates_first(monkeypatch, caplog):
    """A first fit of a budget compiles its programs on a second thread while the accountant searches (the
    noise is an input of the programs, so a placeholder of its shape compiles the same ones); the same fit
    again, its calibration memoised, runs no thread. Both give the same q and ledger, bit for bit, and the
    programs compiled ahead are the ones the fit runs (each compiled once)."""
    import logging

    from numpyro_dppvi.privacy import calibration
    from numpyro_dppvi.pvi.driver import DPPVI

    ahead = []
    compile_ahead = DPPVI._compile_ahead
    monkeypatch.setattr(DPPVI, "_compile_ahead", lambda self, *a: ahead.append(1) or compile_ahead(self, *a))
    calibration.clear_memo()
    cache._PROGRAMS.clear()
    privacy = dict(privacy=Privacy(epsilon=2.0, delta=1e-5, clip=1.0, public_sizes=50))
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING, logger="jax"):
            first = budget_fit(**privacy)
    finally:
        jax.config.update("jax_log_compiles", False)
    compiled = [r.getMessage().split("jit(")[1].split(")")[0] for r in caplog.records
                if r.getMessage().startswith("Finished XLA compilation of jit(")]
    assert ahead == [1]
    assert compiled.count("round_step") == 1 and compiled.count("initial_state") == 1, compiled
    COMPILE_EVENTS.clear()
    second = budget_fit(**privacy)
    assert ahead == [1] and COMPILE_EVENTS == []  # memoised: no thread, nothing compiled
    np.testing.assert_array_equal(np.asarray(first.q.eta1), np.asarray(second.q.eta1))
    np.testing.assert_array_equal(np.asarray(first.q.eta2), np.asarray(second.q.eta2))
    assert first.privacy == second.privacy and first.privacy.epsilon.hex() == second.privacy.epsilon.hex()
    assert first.config == second.config


def test_the_accountant_searches_once_the_round_is_lowered(monkeypatch):
    """Tracing the round and the accountant's search are both Python, which runs one thread at a time: the search
    starts once the compile-ahead thread says it has lowered the round (XLA's compilation, which holds no lock,
    then runs beside it); the fit is the one whose calibration is memoised (no thread), bit for bit."""
    from numpyro_dppvi.privacy import calibration
    from numpyro_dppvi.pvi.driver import DPPVI
    from numpyro_dppvi.pvi.privacy_plan import PrivacyPlan

    order = []
    compile_ahead, calibrate = DPPVI._compile_ahead, PrivacyPlan.calibrate

    class Recorded:
        def __init__(self, event):
            self.event = event

        def set(self):
            order.append("lowered")
            self.event.set()

    monkeypatch.setattr(DPPVI, "_compile_ahead", lambda self, program, inputs, extras, lowered: compile_ahead(
        self, program, inputs, extras, Recorded(lowered)))
    monkeypatch.setattr(PrivacyPlan, "calibrate", lambda plan, rounds: order.append("calibrate") or calibrate(
        plan, rounds))
    calibration.clear_memo()
    cache._PROGRAMS.clear()
    privacy = dict(privacy=Privacy(epsilon=3.0, delta=1e-5, clip=1.0, public_sizes=50))
    first = budget_fit(**privacy)
    assert order == ["lowered", "calibrate"], order
    again = budget_fit(**privacy)
    assert order == ["lowered", "calibrate", "calibrate"], order  # memoised: no thread
    np.testing.assert_array_equal(np.asarray(first.q.eta1), np.asarray(again.q.eta1))


def test_a_budget_the_accountant_cannot_meet_fails_after_the_compilation_ends():
    """The accountant's error reaches the caller once the compilation on the other thread has ended: it
    traces the model under NumPyro's handlers, whose stack is global, so a fit run right after the error
    would otherwise record the other thread's sites (CI, stop 35: "`w` duplicated")."""
    import threading

    from numpyro_dppvi.privacy import calibration

    calibration.clear_memo()
    cache._PROGRAMS.clear()  # a compilation that is really under way when the accountant fails
    with pytest.raises(ValueError, match="noise multiplier above"):
        budget_fit(privacy=Privacy(epsilon=1e-7, delta=1e-5, clip=1.0, public_sizes=50))
    assert not [t for t in threading.enumerate() if t.name.startswith("dppvi-compile")]
    budget_fit(privacy=Privacy(noise_multiplier=1.0, clip=1.0))


def test_the_package_compiles_its_programs_with_its_cpu_options():
    """``program_cache.jit`` passes :data:`~numpyro_dppvi.program_cache.CPU_COMPILER_OPTIONS` (XLA's elemental
    emitters: the Adult DP round compiles about 0.45 s faster, ``benchmarks/fit_overhead.py``) on a CPU whose XLA
    knows them, and leaves ``jax.jit`` itself alone."""
    assert jax.default_backend() == "cpu"
    assert cache.compiler_options() == cache.CPU_COMPILER_OPTIONS
    assert jax.jit(lambda x: x * 2.0)(np.float32(1.5)) == 3.0  # a user's own program: XLA's defaults


def test_an_xla_without_the_options_gets_its_defaults(monkeypatch):
    """An XLA that does not know an option (an older or newer jaxlib) rejects it at compilation; the package then
    compiles with XLA's defaults instead of failing every fit."""
    cache.compiler_options.cache_clear()
    try:
        monkeypatch.setattr(cache, "CPU_COMPILER_OPTIONS", {"xla_cpu_no_such_option_for_this_test": True})
        assert cache.compiler_options() is None
        assert float(cache.jit(lambda x: x + 1.0)(np.float32(1.0))) == 2.0
    finally:
        cache.compiler_options.cache_clear()


def test_the_options_reach_a_fits_programs(monkeypatch):
    """A fit's programs are compiled through ``program_cache.jit``: options XLA rejects make the fit fail at its
    first compilation (the package's own options compile, as every other test shows)."""
    cache.clear()
    monkeypatch.setattr(cache, "compiler_options", lambda: {"xla_cpu_no_such_option_for_this_test": True})
    with pytest.raises(Exception, match="No such compile option"):
        dppvi.fit_dppvi(logistic, clients(2), schedule="synchronous", rounds=1, local_steps=2, num_samples=2)
    cache.clear()
