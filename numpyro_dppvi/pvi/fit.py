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
from .local import NonPrivate, ServerFactorStep
from .server import SCHEDULES, PVIState

METHODS = ("pvi",)


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
    """

    def __init__(self, model, method: str = "pvi", schedule: str = "synchronous",
                 optimizer: optax.GradientTransformation | None = None, local_steps: int = 10,
                 batch_size: int | None = None, num_samples: int = 10, damping: float = 1.0,
                 server_steps: int = 50):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
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
        self.adapter: ModelAdapter | None = None

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
        self.rule = NonPrivate(self.adapter.log_lik_rows, self.adapter.dim, self.optimizer,
                               self.local_steps, self.batch_size, self.num_samples)
        self.server_step = (
            ServerFactorStep(self.adapter.server_log_density, self.adapter.server_mask, self.optimizer,
                             self.server_steps, self.num_samples)
            if self.adapter.has_server_factor else None
        )
        self._round = jax.jit(self._round_fn)

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
        state = PVIState(q=q, factors=zeros, server_factor=t0, q_seen=server._broadcast(q, m),
                         client_state=client_state, key=key, round=jnp.array(0, jnp.int32),
                         communications=jnp.array(0, jnp.int32), active=jnp.ones(m, bool))
        if self.server_step is not None:
            state = jax.jit(lambda s: server.refine_server_factor(self.server_step, s, init_key))(state)
        return state

    def _round_fn(self, state: PVIState, data, mask, sizes):
        key = server.round_key(state)
        k_server, k_order, k_clients = jax.random.split(key, 3)
        if self.server_step is not None:
            state = server.refine_server_factor(self.server_step, state, k_server)
        if self.schedule == "synchronous":
            return server.synchronous(self.rule, self.damping, state, data, mask, sizes, k_clients)
        if self.schedule == "sequential":
            order = jnp.arange(self.num_clients)
        else:
            order = server.arrival_order(k_order, sizes, state.active, self.num_clients)
        return server.arrivals(self.rule, self.damping, state, data, mask, sizes, k_clients,
                               order, stale=self.schedule == "asynchronous")

    def round(self, state: PVIState) -> tuple[PVIState, dict]:
        """One round. Raises (keeping ``state`` untouched) when the round would make ``q`` or a cavity invalid."""
        if self.adapter is None:
            raise RuntimeError("call init(rng_key, clients) before round(state)")
        new_state, metrics = self._round(state, self.data, self.mask, self.sizes)
        if not bool(metrics["valid"]):
            raise FloatingPointError(
                f"round {int(state.round) + 1} produced an invalid posterior or cavity (non-finite or "
                "non-positive precision); the previous state is kept. Lower `damping`, the learning "
                "rate or `local_steps`."
            )
        return new_state, metrics

    def run(self, rng_key, clients, rounds: int, eval_data: Sequence | None = None,
            callback: Callable | None = None, progress: bool = False, state: PVIState | None = None,
            history: list | None = None) -> DPPVIResult:
        """Run ``rounds`` rounds from ``init`` (or from ``state`` to resume) and return a result."""
        if int(rounds) != rounds or rounds < 0:
            raise ValueError(f"rounds must be a non-negative integer, got {rounds!r}")
        if state is None:
            state = self.init(rng_key, clients)
        elif self.adapter is None:
            self._setup(clients)
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
            if "order" in metrics and self.schedule == "asynchronous":
                entry["arrivals"] = np.asarray(metrics["order"]).tolist()
            if eval_arrays is not None:
                entry.update(evaluate(self.adapter, state.q, eval_arrays, eval_key))
            history.append(entry)
            if callback is not None:
                callback(state, entry)
        return DPPVIResult(self.adapter, state, history, method=self.method, schedule=self.schedule)


def fit_dppvi(model, clients, *, method: str = "pvi", schedule: str = "synchronous", rounds: int = 10,
              local_steps: int = 10, batch_size: int | None = None, num_samples: int = 10,
              optimizer: optax.GradientTransformation | None = None, damping: float = 1.0,
              rng_key=None, eval_data=None, callback=None, progress: bool = False,
              server_steps: int = 50) -> DPPVIResult:
    """Fit a ``@dppvi.model`` to federated ``clients`` with (DP-)PVI; the one-call form of :class:`DPPVI`."""
    driver = DPPVI(model, method=method, schedule=schedule, optimizer=optimizer, local_steps=local_steps,
                   batch_size=batch_size, num_samples=num_samples, damping=damping, server_steps=server_steps)
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    return driver.run(rng_key, clients, rounds, eval_data=eval_data, callback=callback, progress=progress)
