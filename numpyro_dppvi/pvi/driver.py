"""``DPPVI``: the SVI-style driver of (DP-)PVI (``init``, ``round``, ``run`` over a ``PVIState``).

Wires the model adapter, a local update rule, the server schedule and (for private methods) the
privacy plan and ledger. ``init`` returns a :class:`PVIState` pytree and ``round`` advances it by
one jitted round. The state is **private** (it holds the fit's secret key and every client's private
state): ``run`` returns a :class:`~numpyro_dppvi.results.DPPVIResult` holding only what may be
published, and writes the state only to a private checkpoint (``checkpoint=path``), from which
``fit_dppvi(resume=path)`` continues with its ledger intact.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np
import optax
from tqdm.auto import tqdm

from .. import diagnostics, factors, keys
from ..data import pad_clients, validate_clients
from ..diagnostics import ADVICE, LOW_RANK_ADVICE
from ..evaluation import evaluate
from ..model_adapter import ModelAdapter
from ..privacy.noise import float32_at_least
from ..privacy.sizes import fit_sizes
from ..program_cache import cached, committed, jit, to_device
from ..results import DPPVIResult
from . import plan as plan_module
from . import report
from . import resume as resume_module
from .defaults import MIN_ROUNDS, UPDATE_METHODS, virtual_clip
from .fit_settings import FitSettings, ResolvedSettings
from .report import FitDiverged, NoValidUpdates, unrecovered_clients  # noqa: F401 (public here since 0.1)
from .plan import RoundSpec, model_adapter, round_program
from .privacy_plan import check_subsampled
from .server import PVIState
from .shards import make_shards, shard_counts


class DPPVI:
    """Partitioned variational inference driver, in the manner of ``numpyro.infer.SVI``.

    ``init`` traces the model and returns the initial (private) :class:`PVIState`, ``round`` advances it by one
    round, and ``run`` runs the rounds and returns the public :class:`~numpyro_dppvi.results.DPPVIResult`.
    :func:`~numpyro_dppvi.fit_dppvi` builds one and runs it.

    Args:
        model: a NumPyro model taking the data arrays positionally (``@dppvi.model`` optional).
        method: ``"pvi"`` (default), ``"dp_optimisation"``, ``"local_averaging"``, ``"virtual_clients"`` or
            ``"parameter_perturbation"``.
        schedule: ``"sequential"``, ``"synchronous"`` or ``"asynchronous"``; None: the method's.
        optimizer: the local steps' optax ``GradientTransformation``, ``optim.Newton`` or ``optim.PrivateNewton``.
        local_steps: optimiser steps per client (or shard) per round.
        batch_size: rows per local step (None: the client's whole data; DP optimisation requires it).
        num_samples: Monte Carlo draws of ``q`` per step. Default 10.
        damping: ``rho`` in ``t_m <- t_m + rho (q_new - q)``, in ``(0, 1]``.
        server_steps: steps of the server's prior-factor refinement per round. Default 50.
        privacy: a :class:`~numpyro_dppvi.privacy.Privacy`, or None (not private).
        rounds: the planned number of rounds (the noise's calibration; :meth:`run`'s default).
        shards: update perturbation's local partitions per client.
        invalid: the rule for a noisy update with a non-positive precision, ``"reject"`` or ``"floor"``.
        precision_floor: the floor of ``invalid="floor"``.
        trusted_aggregator: only the sum of the clients' noisy releases is revealed. Default False.
        privacy_unit: ``"example"`` (default) or ``"client"`` (client-level DP).
        client_rate: client-level DP's per-round participation probability. Default 1.
        tail_average: the share of the last local iterates averaged into the client's answer.
        family: ``"mean_field"``, ``"full_rank"`` or ``"low_rank"``; None: chosen by the method and the model.
        rank: the rank of ``family="low_rank"``.
        noise_aware: whether ``q`` accounts for the privacy noise: None (wherever available), True or False.

    Every option, its default and the combinations refused are :class:`~numpyro_dppvi.pvi.fit_settings.FitSettings`'
    (the driver's settings are ``FitSettings(...).resolve()``, completed by the traced model's dimension).
    """

    def __init__(self, model, method: str = "pvi", schedule: str | None = None,
                 optimizer: optax.GradientTransformation | None = None, local_steps: int | None = None,
                 batch_size: int | None = None, num_samples: int = 10, damping: float | None = None,
                 server_steps: int = 50, privacy=None, rounds: int | None = None, shards=None,
                 invalid: str | None = None, precision_floor: float | None = None, trusted_aggregator: bool = False,
                 privacy_unit: str = "example", client_rate: float = 1.0, tail_average: float | None = None,
                 family: str | None = None, rank: int | None = None, noise_aware: bool | None = None):
        self.fit_settings = FitSettings(
            method=method, schedule=schedule, optimizer=optimizer, local_steps=local_steps, batch_size=batch_size,
            num_samples=num_samples, damping=damping, server_steps=server_steps, privacy=privacy, rounds=rounds,
            shards=shards, invalid=invalid, precision_floor=precision_floor, trusted_aggregator=trusted_aggregator,
            privacy_unit=privacy_unit, client_rate=client_rate, tail_average=tail_average, family=family, rank=rank,
            noise_aware=noise_aware)
        self._apply(self.fit_settings.resolve())
        # fit_dppvi sets it when ``rounds`` was left out and the method's default depends on the model
        # (virtual clients: :data:`~.defaults.VIRTUAL_FULL_RANK_DEFAULTS`); ``planned_rounds`` is then resolved
        # with the family (:meth:`ResolvedSettings.for_model`)
        self.auto_rounds = False
        self.model = model
        self.adapter: ModelAdapter | None = None
        self.declared_sizes = None  # Privacy.public_sizes, checked against the clients (set up by init)
        self.ledger = None
        self.plan = None
        self.caller = "DPPVI"  # the public function whose options error messages name

    def _apply(self, settings: ResolvedSettings) -> None:
        """Take the driver's settings attributes (``method``, ``family``, ``damping``, ...) from ``settings``."""
        for field in dataclasses.fields(ResolvedSettings):
            if field.name != "given":
                setattr(self, field.name, getattr(settings, field.name))
        given = settings.given
        # a virtual-clients clip rule replaces the clip per set-up (_setup), starting from the privacy as resolved
        self.given = {"damping": given.damping, "tail_average": given.tail_average, "noise_aware": given.noise_aware,
                      "local_steps": given.local_steps, "privacy": settings.privacy}

    def _resolved(self) -> ResolvedSettings:
        """The driver's settings attributes as one value (set-up and ``resume`` may have replaced some)."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(ResolvedSettings) if f.name != "given"}
        return ResolvedSettings(given=self.fit_settings, **dict(current, privacy=self.given["privacy"]))

    # -- set-up --------------------------------------------------------------------------------
    def _setup(self, clients, key_data):
        """Validate and lay out the clients (shards keyed by a secret derived from ``key_data``),
        trace the model, make the privacy plan and the local rule, and compile the round."""
        clients = validate_clients(clients)
        self.clients = clients
        observed = [len(c[0]) for c in clients]
        self.privacy = self.given["privacy"]  # as given: a clip chosen by a rule follows these clients
        p = self.privacy
        self.declared_sizes, sizes = fit_sizes(p, observed, self.privacy_unit, self.caller)
        if self.method == "dp_optimisation":  # before tracing the model: a quick, clear error
            check_subsampled(self.batch_size, sizes, self.caller)
        self.adapter = model_adapter(self.model, clients)
        for m, c in enumerate(clients):
            self.adapter.validate_data(c, f"client {m}")
        self.num_clients = len(clients)
        a = self.adapter
        if self.family == "low_rank":
            self.rank = factors.resolved_rank(a.dim, self.rank)
        self._apply(self._resolved().for_model(a.dim, self.auto_rounds))
        dimension = plan_module.release_dimension(self)
        declared = self.declared_sizes is not None and self.privacy_unit != "client"
        if self.method in UPDATE_METHODS:
            layout = self.shard_layout(clients, key_data, counts=shard_counts(sizes, self.shards) if declared else None)
            self.num_shards = layout.num_shards
            self.shard_ids = layout.ids
        else:  # declared sizes also fix the padded shape
            layout = pad_clients(clients, size=int(sizes.max()) if declared else None)
        self.data = tuple(to_device(x) for x in layout.arrays)
        self.mask = to_device(layout.mask)
        self.sizes = to_device(sizes, np.float32)
        self.public_sizes = np.asarray(sizes, int)
        # the noise is calibrated by init, while the programs compile (_calibrate): they take it as an input
        self.plan, self.rule = plan_module.privacy_plan_and_rule(self, sizes, dimension, calibrate=False)
        if self.virtual_full_rank and not p.clip_chosen:  # the clip from the (public) noise and shard counts
            self.plan.calibrate(self.planned_rounds)
            clip = virtual_clip(float(np.max(self.plan.noise_multipliers)), self.num_shards)
            self.privacy = p = dataclasses.replace(p, clip=clip)
            self.plan, self.rule = plan_module.privacy_plan_and_rule(self, sizes, dimension, calibrate=False)
        self.server_step = plan_module.server_factor_step(self)
        self.spec = RoundSpec(self.rule, self.server_step, self.schedule, self.damping, self.privacy_unit,
                              self.trusted_aggregator, self.client_rate, None if p is None else p.clip, self.invalid,
                              self.precision_floor, self.num_clients)
        self._program = round_program(self.spec)
        self._server_noise_std = to_device(float32_at_least(0.0), np.float32)  # client-level DP: set by _calibrate

    def shard_layout(self, clients, key_data, counts=None):
        """The shards of ``clients`` as this fit derives them (update-perturbation methods): keyed by a
        secret derived from ``key_data``, by the records' bytes, or by their positions under the
        substitute relation (:mod:`.shards`); ``counts``: the planned shard counts (a neighbouring data
        set is laid out under the settings of the original).

        :meta private:
        """
        p = self.privacy
        return make_shards(clients, self.shards, keys.derived_bytes(key_data, keys.SHARD_HASH_TAG), counts=counts,
                           by_position=p is not None and p.neighbouring == "substitute")

    def init(self, rng_key, clients) -> PVIState:
        """Validate and lay out the clients, trace the model, and return the initial state (``q_0`` = prior).

        ``rng_key=None`` draws the fit's key from the operating system (recommended for private fits:
        the guarantee rests on the key staying secret, and the state, which holds it, is private).
        """
        key_data, seed = keys.resolve(rng_key)
        return self._init(key_data, seed, clients)

    def _init(self, key_data, seed: str, clients) -> PVIState:
        self._setup(clients, key_data)
        m = self.num_clients
        program = cached(("pvi-initial-state", self.rule, self.server_step, m),
                         lambda: jit(functools.partial(plan_module.initial_state, self.rule, self.server_step, m)))
        inputs = (self.data, self.mask, to_device(key_data, np.uint32), self.adapter.prior, self.adapter.server_mask)
        if self.plan is not None:
            state = self._calibrate(program, inputs)
        else:
            state = program(*inputs, plan_module.initial_extras(self, self.plan))
        self.seed = seed
        self.ledger = None if self.plan is None else self.privacy.ledger(
            m, self.trusted_aggregator, seed=seed, charges=self.plan.charges(self.planned_rounds),
            sizes="unused" if self.privacy_unit == "client" else None)
        return state

    def _calibrate(self, initial_program, inputs) -> PVIState:
        """Calibrate the plan's noise for the planned rounds, warn if it swamps the signal, and return the initial
        state (``initial_program`` on ``inputs`` and the calibrated noise).

        A first fit's calibration searches the PLD accountant for seconds, as long as compiling the fit's
        round. The programs take the noise as an input, so the round is compiled meanwhile on a second thread
        for a placeholder plan of the same shape (:meth:`_compile_ahead`), and the calls that follow find it
        compiled. The search waits until that thread has traced and lowered the round: both are Python, which
        runs one thread at a time, while XLA's compilation that follows runs without Python's lock, beside the
        search and the initial-state program (a new process's first fit of the Adult benchmark: the round's
        tracing took 0.8 s beside the search and 0.3 s alone, ``benchmarks/fit_overhead.py``). A calibration
        known at once (memoised, or a noise multiplier alone) needs no thread.

        Tracing runs the model under NumPyro's effect handlers, whose stack is one list for the whole process:
        no other model may run while the round is traced, which the wait guarantees. An accountant's error is
        raised only once the compilation has ended.
        """
        rounds = self.planned_rounds
        if self.plan.calibrated_at_once(rounds):
            self.plan.calibrate(rounds)
            state = initial_program(*inputs, plan_module.initial_extras(self, self.plan))
        else:
            placeholder = dataclasses.replace(self.plan, noise_multipliers=np.ones(self.num_clients))
            lowered = threading.Event()
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dppvi-compile")
            compiling = pool.submit(self._compile_ahead, initial_program, inputs, plan_module.initial_extras(self, placeholder),
                                    lowered)
            try:
                lowered.wait()
                self.plan.calibrate(rounds)
                state = initial_program(*inputs, plan_module.initial_extras(self, self.plan))
            finally:
                pool.shutdown(wait=True)
            compiling.result()
        if self.plan.kind == "client":
            self._server_noise_std = to_device(float32_at_least(self.plan.noise_std(0)), np.float32)
        plan_module.warn_if_noise_swamps(self)
        return state

    def _compile_ahead(self, initial_program, inputs, placeholder_extras, lowered: threading.Event) -> None:
        """Compile the round for this fit's shapes, from the initial state's shapes for a placeholder plan
        (``jax.eval_shape``: nothing runs); set ``lowered`` once the round is lowered (or this fails), before
        XLA compiles it."""
        try:
            state = jax.eval_shape(initial_program, *inputs, placeholder_extras)
            limits = to_device(np.zeros(self.num_clients), np.int32)
            program = self._program.lower(state, self.data, self.mask, self.sizes, limits, self._server_noise_std)
        finally:
            lowered.set()
        program.compile()

    def _round(self, state: PVIState, data, mask, sizes, limits):
        """The compiled round of this fit (shared with every fit of the same structure)."""
        return self._program(state, data, mask, sizes, limits, self._server_noise_std)

    def limits(self, state: PVIState, rounds: int) -> jax.Array:
        """Per-client participation limits for the next ``rounds`` rounds (budget stop rule)."""
        if self.plan is None:
            return to_device(np.full(self.num_clients, np.iinfo(np.int32).max, np.int32))
        horizon = int(rounds) * (self.num_clients if self.schedule == "asynchronous" else 1)
        limits = self.plan.limits(self.ledger, np.asarray(state.participations), max(horizon, 1))
        return to_device(np.minimum(limits, np.iinfo(np.int32).max), np.int32)

    def round(self, state: PVIState, limits=None) -> tuple[PVIState, dict]:
        """One round (raises, keeping ``state`` untouched, when the round would make ``q`` or a cavity
        invalid). Charges the releases it made to :attr:`ledger`. ``limits``: the participation limits
        from :meth:`limits` (computed for one round when omitted)."""
        if self.adapter is None:
            raise RuntimeError("call init(rng_key, clients) before round(state)")
        if limits is None:
            limits = self.limits(state, 1)
        new_state, metrics = self._round(state, self.data, self.mask, self.sizes, limits)
        charged = np.asarray(new_state.participations) - np.asarray(state.participations)
        stopped = np.flatnonzero(np.asarray(metrics["stopped"])).tolist()
        if self.ledger is not None:  # the releases happened: charge them before anything can fail
            for m in np.flatnonzero(charged):
                self.ledger.record(int(m), self.plan.event(int(m), int(charged[m])))
            for m in stopped:
                self.ledger.stop(int(m), "epsilon_max", int(state.round) + 1)
        metrics = dict(metrics, stopped=stopped, rejected_round=False)
        if not bool(metrics["valid"]) and self.plan is not None and self.plan.kind in ("shard_update", "client"):
            # noisy releases whose sum would make q improper: the round is rejected as a whole (every
            # factor and client state kept; the releases stay charged); counted in the history
            kept = state._replace(round=new_state.round, communications=new_state.communications,
                                  active=new_state.active, participations=new_state.participations)
            return kept, dict(metrics, rejected_round=True)
        if not bool(metrics["valid"]):
            raise FloatingPointError(
                f"round {int(state.round) + 1} produced an invalid posterior or cavity (non-finite or "
                f"non-positive precision); the previous state is kept. In {self.caller}, {ADVICE[self.caller]}"
                + (LOW_RANK_ADVICE if self.family == "low_rank" else "") + "."
            )
        return new_state, metrics

    @property
    def virtual_full_rank(self) -> bool:
        """Virtual clients with full-rank factors and a noise-aware posterior (:attr:`ResolvedSettings.virtual_full_rank`)."""
        return self.method == "virtual_clients" and self.family == "full_rank" and self.noise_aware

    def settings(self) -> dict:
        """The data-independent settings of the fit (JSON, :func:`.report.public_settings`): published as
        ``result.config`` and compared on resume."""
        return report.public_settings(self)

    config = settings

    def run(self, rng_key, clients, rounds: int, eval_data: Sequence | None = None,
            callback: Callable | None = None, progress: bool = False, state: PVIState | None = None,
            history: list | None = None, ledger=None, checkpoint=None, private_history: list | None = None,
            hmac_key: bytes | None = None, track_epsilon: bool = False,
            stop_when_converged: bool = False) -> DPPVIResult:
        """Run ``rounds`` rounds from ``init``, or from ``state`` (with its ``history`` and privacy
        ``ledger``) to resume, and return the (public) result.

        ``checkpoint``: a path the private checkpoint is written to after every round (resume it with
        ``fit_dppvi(..., resume=path)``). If a round would make ``q`` invalid, :class:`FitDiverged` is
        raised carrying the last valid result (``err.result``) and the checkpoint keeps that state.
        ``callback(state, entry)`` receives the private state and the public history entry.
        ``track_epsilon``: also record the ledger's epsilon after every round in the history (one
        accountant call per distinct client plan per round; otherwise epsilon is computed on demand).
        ``stop_when_converged`` (non-private fits): stop before ``rounds`` once ``q`` has converged
        (:func:`~numpyro_dppvi.diagnostics.convergence`, checked from round :data:`MIN_ROUNDS` on).
        """
        if stop_when_converged and self.plan is not None:
            raise ValueError("stop_when_converged is for non-private fits: a private fit spends its budget over "
                             "the rounds it was calibrated for")
        if rounds is not None and (int(rounds) != rounds or rounds < 0):
            raise ValueError(f"rounds must be a non-negative integer, got {rounds!r}")
        if state is None:
            state = self.init(rng_key, clients)
        else:
            resume_module.take_ledger(self, ledger)
        if rounds is None:  # the planned rounds, once the model's defaults are resolved (fit_dppvi's rounds=None)
            if self.planned_rounds is None:
                raise ValueError("rounds must be a non-negative integer, got None")
            rounds = self.planned_rounds
        state = committed(state)  # as every round's output is: eager work on the state compiles one program for both
        history = list(history or [])
        private_history = list(private_history or [])
        eval_arrays = None if eval_data is None else self.adapter.validate_data(eval_data, "eval_data")
        eval_key = None if eval_data is None else jax.random.fold_in(jax.random.wrap_key_data(state.key), 0x5EED)
        limits = self.limits(state, rounds)
        resume_module.check_budget_left(self, state, limits, rounds)
        trajectory = collections.deque([diagnostics.unconstrained_coordinates(state.q)],
                                       maxlen=2 * diagnostics.WINDOW + 1)
        iterator = range(int(rounds))
        if progress:
            iterator = tqdm(iterator, desc=f"{self.method}/{self.schedule}", unit="round")
        for _ in iterator:
            start = time.perf_counter()
            try:
                state, metrics = self.round(state, limits)
            except FloatingPointError as exc:
                raise FitDiverged(str(exc), report.public_result(self, state, history)) from exc
            jax.block_until_ready(state.q)
            entry, private = report.public_entry(self, state, metrics, time.perf_counter() - start)
            trajectory.append(diagnostics.unconstrained_coordinates(state.q))
            entry["change"] = diagnostics.change(trajectory[-2], trajectory[-1])
            if eval_arrays is not None:
                entry.update(evaluate(self.adapter, state.q, eval_arrays, eval_key))
            if track_epsilon and self.ledger is not None:
                entry["epsilon"] = self.ledger.epsilon
            history.append(entry)
            private_history.append(private)
            if checkpoint is not None:
                self.save_checkpoint(checkpoint, state, history, private_history, hmac_key)
            if callback is not None:
                callback(state, entry)
            if stop_when_converged and int(state.round) >= MIN_ROUNDS and report.convergence_summary(self, trajectory, history)["converged"]:
                break
        return report.finish(self, state, trajectory, history, rounds)

    def save_checkpoint(self, path, state: PVIState, history: list, private_history: list,
                        hmac_key: bytes | None = None) -> None:
        """Write the **private** checkpoint (:func:`.resume.save_checkpoint`). Never publish it."""
        resume_module.save_checkpoint(self, path, state, history, private_history, hmac_key)

    def resume(self, path, clients, rounds: int, hmac_key: bytes | None = None, rng_key=None,
               **run_options) -> DPPVIResult:
        """Continue the fit saved in the private checkpoint ``path`` until ``rounds`` rounds in total
        (:func:`.resume.resume`: the saved settings, key, data and ledger are checked first)."""
        return resume_module.resume(self, path, clients, rounds, hmac_key=hmac_key, rng_key=rng_key, **run_options)
