"""``DPPVI``: the SVI-style driver of (DP-)PVI, and ``fit_dppvi``, its one-call form.

Wires the model adapter, a local update rule, the server schedule and (for private methods) the
privacy ledger. The driver holds the padded client data; ``init`` returns a :class:`PVIState`
pytree and ``round`` advances it by one jitted round, so a fit can be stopped, saved and resumed.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import factors
from ..data import pad_clients, validate_clients
from ..evaluation import evaluate
from ..factors import Gaussian
from ..model import ModelAdapter
from ..results import DPPVIResult
from . import server
from .local import DPOptimisation, NonPrivate, ServerFactorStep
from .server import SCHEDULES, PVIState

METHODS = ("pvi", "dp_optimisation")
PRIVATE_METHODS = ("dp_optimisation",)


class DPPVI:
    """Partitioned variational inference driver, in the manner of ``numpyro.infer.SVI``.

    Args:
        model: a ``@dppvi.model`` NumPyro model taking the data arrays positionally.
        method: ``"pvi"`` (non-private).
        schedule: ``"sequential" | "synchronous" | "asynchronous"``.
        optimizer: an optax ``GradientTransformation`` for the local steps (default ``adam(1e-2)``).
        local_steps: optimiser steps per client per round.
        batch_size: rows per local step (``None``: the client's whole data).
        num_samples: Monte Carlo draws of ``q`` per step, shared across the batch.
        damping: ``rho`` in ``t_m <- t_m + rho (q_new - q)``.
        server_steps: steps of the server's prior-factor refinement per round (non-Gaussian priors).
        privacy: a :class:`~numpyro_dppvi.privacy.Privacy` for the private methods.
        rounds: the planned number of rounds; needed to calibrate the noise to a budget.
    """

    def __init__(self, model, method: str = "pvi", schedule: str = "synchronous",
                 optimizer: optax.GradientTransformation | None = None, local_steps: int = 10,
                 batch_size: int | None = None, num_samples: int = 10, damping: float = 1.0,
                 server_steps: int = 50, privacy=None, rounds: int | None = None):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
        if method in PRIVATE_METHODS:
            from ..privacy import Privacy

            if not isinstance(privacy, Privacy):
                raise TypeError(f"method={method!r} needs privacy=dppvi.Privacy(...) (a budget or a noise multiplier)")
            if batch_size is None:
                raise ValueError(f"method={method!r} needs a batch_size (the expected batch of each DP-SGD step)")
            if privacy.adaptive_clip is not None:
                raise NotImplementedError("adaptive clipping is not wired into fit_dppvi yet; use a fixed clip")
        elif privacy is not None:
            raise ValueError(f"method={method!r} is not private; use method='dp_optimisation' to use `privacy`")
        if rounds is not None and (int(rounds) != rounds or rounds < 1):
            raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
        if not (0.0 < float(damping) <= 1.0):
            raise ValueError(f"damping must be in (0, 1], got {damping}")
        for name, value in (("local_steps", local_steps), ("num_samples", num_samples), ("server_steps", server_steps)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if batch_size is not None and (int(batch_size) != batch_size or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        self.model = model
        self.method = method
        self.schedule = schedule
        self.optimizer = optimizer if optimizer is not None else optax.adam(1e-2)
        self.local_steps = int(local_steps)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.num_samples = int(num_samples)
        self.damping = float(damping)
        self.server_steps = int(server_steps)
        self.privacy = privacy
        self.planned_rounds = None if rounds is None else int(rounds)
        self.adapter: ModelAdapter | None = None
        self.ledger = None

    # -- set-up --------------------------------------------------------------------------------
    def _setup(self, clients):
        clients = validate_clients(clients)
        self.clients = clients
        self.adapter = ModelAdapter(self.model, clients[0])
        for m, c in enumerate(clients):
            self.adapter.validate_data(c, f"client {m}")
        padded = pad_clients(clients)
        self.data = tuple(jnp.asarray(a) for a in padded.arrays)
        self.mask = jnp.asarray(padded.mask)
        self.sizes = jnp.asarray(padded.sizes, jnp.float32)
        self.num_clients = len(clients)
        if self.method == "dp_optimisation":
            self.rule = self._dp_rule(padded.sizes)
        else:
            self.rule = NonPrivate(self.adapter.log_lik_rows, self.adapter.dim, self.optimizer,
                                   self.local_steps, self.batch_size, self.num_samples)
        self.server_step = (
            ServerFactorStep(self.adapter.server_log_density, self.adapter.server_mask, self.optimizer,
                             self.server_steps, self.num_samples)
            if self.adapter.has_server_factor else None
        )
        self._round = jax.jit(self._round_fn)
        self._order = jax.jit(self._order_fn)

    def _dp_rule(self, sizes) -> DPOptimisation:
        """Calibrate the noise for the planned run and build the DP-SGD local rule (DESIGN §5.1).

        Plan: client ``m`` releases ``local_steps`` subsampled Gaussian sums per round at rate
        ``q_m = batch_size / n_m`` over the planned rounds. Each client's noise multiplier is calibrated
        to its own plan (clients with the same rate share one calibration), so every client meets the
        budget and none adds more noise than it needs; the overall guarantee is the max over clients.
        """
        from ..privacy.sampling import poisson_overflow_probability, poisson_pad_size

        p = self.privacy
        sizes = np.asarray(sizes, int)
        if np.any(sizes < self.batch_size) and p.sampling == "without_replacement":
            raise ValueError(f"batch_size={self.batch_size} exceeds the smallest client ({sizes.min()} rows); "
                             "lower batch_size")
        if np.any(self.batch_size >= sizes):
            raise ValueError(f"batch_size={self.batch_size} must be smaller than every client's size "
                             f"(smallest: {sizes.min()}) so that batches are subsampled; lower batch_size")
        if p.epsilon is not None and p.noise_multiplier is None and self.planned_rounds is None:
            raise ValueError("calibrating the noise to a budget needs the planned number of rounds: "
                             "pass rounds=... to DPPVI (fit_dppvi does this for you)")
        rounds = self.planned_rounds or 1
        self.rates = self.batch_size / sizes
        steps = self.local_steps * rounds
        if p.sampling == "poisson":
            max_batch = max(poisson_pad_size(int(n), float(q), steps) for n, q in zip(sizes, self.rates))
            self.overflow = np.array([poisson_overflow_probability(int(n), float(q), max_batch)
                                      for n, q in zip(sizes, self.rates)])
        else:
            max_batch, self.overflow = self.batch_size, np.zeros(len(sizes))
        by_rate = {}
        for m in range(len(sizes)):
            key = (float(self.rates[m]), float(self.overflow[m]))
            if key not in by_rate:
                by_rate[key] = p.resolve(lambda z, m=m: [self._step_event(m, steps, z)])
        self.noise_multipliers = np.array([by_rate[(float(q), float(o))] for q, o in zip(self.rates, self.overflow)])
        self.epsilon_max = p.epsilon_max_per_client(len(sizes))
        if p.epsilon is not None and p.epsilon_max is None:
            self.epsilon_max = np.full(len(sizes), p.epsilon)
        return DPOptimisation(self.adapter.log_lik_rows, self.adapter.dim, self.optimizer, self.local_steps,
                              self.batch_size, self.num_samples, log_lik_row=self.adapter.log_lik_row,
                              clip=p.clip, sampling=p.sampling, max_batch=int(max_batch))

    def _step_event(self, m: int, count: int, noise_multiplier=None):
        z = self.noise_multipliers[m] if noise_multiplier is None else noise_multiplier
        return self.privacy.step_event(float(z), float(self.rates[m]), count, float(self.overflow[m]))

    def init(self, rng_key, clients) -> PVIState:
        """Validate and pad the clients, trace the model, and return the initial state (``q_0`` = prior)."""
        self._setup(clients)
        a, m = self.adapter, self.num_clients
        t0 = Gaussian(jnp.zeros(a.dim), jnp.where(a.server_mask, -0.5, 0.0))  # N(0, 1) on t_0's coordinates
        q = factors.multiply(a.prior, t0)
        zeros = Gaussian(jnp.zeros((m, a.dim)), jnp.zeros((m, a.dim)))
        key = jax.random.key_data(rng_key) if jnp.issubdtype(rng_key.dtype, jax.dtypes.prng_key) else rng_key
        init_key = jax.random.fold_in(jax.random.wrap_key_data(key), 0x7FFFFFFF)
        client_state = jax.vmap(self.rule.init_client_state)(self.data, self.mask, jax.random.split(init_key, m))
        if self.method == "dp_optimisation":
            stds = [float(self.privacy.gradient_noise_std(z)) for z in self.noise_multipliers]
            client_state = {"noise_std": jnp.asarray(stds, jnp.float32)}
        state = PVIState(q=q, factors=zeros, server_factor=t0, q_seen=server._broadcast(q, m),
                         client_state=client_state, key=key, round=jnp.array(0, jnp.int32),
                         communications=jnp.array(0, jnp.int32), active=jnp.ones(m, bool))
        if self.server_step is not None:
            state = jax.jit(lambda s: server.refine_server_factor(self.server_step, s, init_key))(state)
        self.ledger = self.privacy.ledger(m) if self.privacy is not None else None
        return state

    def _order_fn(self, state: PVIState, sizes):
        """Which clients take part this round, in arrival order (asynchronous: drawn ~ 1/n_m)."""
        if self.schedule == "asynchronous":
            k_order = jax.random.split(server.round_key(state), 3)[1]
            return server.arrival_order(k_order, sizes, state.active, self.num_clients)
        return jnp.arange(self.num_clients)

    def _round_fn(self, state: PVIState, data, mask, sizes, order):
        key = server.round_key(state)
        k_server, _, k_clients = jax.random.split(key, 3)
        if self.server_step is not None:
            state = server.refine_server_factor(self.server_step, state, k_server)
        if self.schedule == "synchronous":
            return server.synchronous(self.rule, self.damping, state, data, mask, sizes, k_clients)
        return server.arrivals(self.rule, self.damping, state, data, mask, sizes, k_clients,
                               order, stale=self.schedule == "asynchronous")

    def _charge(self, state: PVIState, order) -> tuple[PVIState, list, np.ndarray]:
        """Apply the per-client budget stop rule before a round; return the arrivals per client.

        A client whose releases this round would take its epsilon past ``epsilon_max`` stops for
        good (it is marked inactive, recorded in the ledger and in the history)."""
        active = np.asarray(state.active).copy()
        arrivals = np.bincount(np.asarray(order), minlength=self.num_clients) * active
        stopped = []
        if self.ledger is not None:
            for m in np.flatnonzero(arrivals):
                event = self._step_event(int(m), int(self.local_steps * arrivals[m]))
                if self.ledger.epsilon_if(int(m), event) > self.epsilon_max[m] * (1 + 1e-9):
                    active[m], arrivals[m] = False, 0
                    self.ledger.stop(int(m), "epsilon_max", int(state.round) + 1)
                    stopped.append(int(m))
        return state._replace(active=jnp.asarray(active)), stopped, arrivals

    def round(self, state: PVIState) -> tuple[PVIState, dict]:
        """One round. Raises (keeping ``state`` untouched) when the round would make ``q`` or a cavity invalid."""
        if self.adapter is None:
            raise RuntimeError("call init(rng_key, clients) before round(state)")
        order = self._order(state, self.sizes)
        state, stopped, arrivals = self._charge(state, order)
        new_state, metrics = self._round(state, self.data, self.mask, self.sizes, order)
        if self.ledger is not None:  # the releases happened: charge them before anything can fail
            for m in np.flatnonzero(arrivals):
                self.ledger.record(int(m), self._step_event(int(m), int(self.local_steps * arrivals[m])))
        metrics = dict(metrics, stopped=stopped)
        if not bool(metrics["valid"]):
            raise FloatingPointError(
                f"round {int(state.round) + 1} produced an invalid posterior or cavity (non-finite or "
                "non-positive precision); the previous state is kept. Lower `damping`, the learning "
                "rate or `local_steps`."
            )
        return new_state, metrics

    def run(self, rng_key, clients, rounds: int, eval_data: Sequence | None = None,
            callback: Callable | None = None, progress: bool = False, state: PVIState | None = None,
            history: list | None = None, ledger=None) -> DPPVIResult:
        """Run ``rounds`` rounds from ``init``, or from ``state`` (with its ``history`` and privacy
        ``ledger``) to resume a saved fit, and return a result."""
        if int(rounds) != rounds or rounds < 0:
            raise ValueError(f"rounds must be a non-negative integer, got {rounds!r}")
        if state is None:
            state = self.init(rng_key, clients)
        else:
            if self.adapter is None:
                self._setup(clients)
            if self.privacy is not None:
                if ledger is None:
                    raise ValueError("resuming a private fit needs its ledger (result.privacy) so spent budget is kept")
                self.ledger = ledger
        history = list(history or [])
        eval_arrays = None if eval_data is None else self.adapter.validate_data(eval_data, "eval_data")
        eval_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), 0x5EED)
        iterator = range(int(rounds))
        if progress:
            from tqdm.auto import tqdm
            iterator = tqdm(iterator, desc=f"{self.method}/{self.schedule}", unit="round")
        for _ in iterator:
            start = time.perf_counter()
            state, metrics = self.round(state)
            jax.block_until_ready(state.q)
            entry = {"round": int(state.round), "communications": int(state.communications),
                     "participated": np.asarray(metrics["participated"]).tolist(),
                     "seconds": time.perf_counter() - start}
            if self.ledger is not None:
                entry["epsilon"] = self.ledger.epsilon
                if metrics["stopped"]:
                    entry["stopped"] = metrics["stopped"]
            if "order" in metrics and self.schedule == "asynchronous":
                entry["arrivals"] = np.asarray(metrics["order"]).tolist()
            if eval_arrays is not None:
                entry.update(evaluate(self.adapter, state.q, eval_arrays, eval_key))
            history.append(entry)
            if callback is not None:
                callback(state, entry)
        return DPPVIResult(self.adapter, state, history, method=self.method, schedule=self.schedule,
                           privacy=self.ledger, config=self.config())

    def config(self) -> dict:
        out = {"method": self.method, "schedule": self.schedule, "local_steps": self.local_steps,
               "batch_size": self.batch_size, "num_samples": self.num_samples, "damping": self.damping}
        if self.privacy is not None:
            out.update(noise_multiplier=[float(z) for z in self.noise_multipliers], clip=self.privacy.clip,
                       sampling=self.privacy.sampling, neighbouring=self.privacy.neighbouring,
                       planned_rounds=self.planned_rounds)
        return out


def fit_dppvi(model, clients, *, method: str = "pvi", schedule: str = "synchronous", rounds: int = 10,
              local_steps: int = 10, batch_size: int | None = None, num_samples: int = 10,
              optimizer: optax.GradientTransformation | None = None, damping: float = 1.0,
              rng_key=None, eval_data=None, callback=None, progress: bool = False,
              server_steps: int = 50, privacy=None) -> DPPVIResult:
    """Fit a ``@dppvi.model`` to federated ``clients`` with (DP-)PVI; the one-call form of :class:`DPPVI`.

    ``method="dp_optimisation"`` with ``privacy=Privacy(epsilon=..., delta=..., clip=...)`` calibrates
    the noise so that every client's releases over ``rounds`` rounds meet the budget; the result's
    ``privacy`` ledger reports what was spent.
    """
    driver = DPPVI(model, method=method, schedule=schedule, optimizer=optimizer, local_steps=local_steps,
                   batch_size=batch_size, num_samples=num_samples, damping=damping, server_steps=server_steps,
                   privacy=privacy, rounds=rounds)
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    return driver.run(rng_key, clients, rounds, eval_data=eval_data, callback=callback, progress=progress)
