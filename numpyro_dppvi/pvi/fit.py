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
from .privacy_plan import client_level_plan, dp_sgd_plan, shard_update_plan
from .server import SCHEDULES, PVIState
from .shards import make_shards
from .update_perturbation import INVALID_RULES, LocalAveraging, VirtualClients

METHODS = ("pvi", "dp_optimisation", "local_averaging", "virtual_clients", "parameter_perturbation")
UPDATE_METHODS = ("local_averaging", "virtual_clients", "parameter_perturbation")
PRIVACY_UNITS = ("example", "client")


def _key_data(rng_key) -> jax.Array:
    """Raw uint32 data of a JAX PRNG key (typed ``jax.random.key`` or legacy ``PRNGKey``)."""
    dtype = getattr(rng_key, "dtype", None)
    if dtype is None:
        raise TypeError(f"rng_key must be a JAX PRNG key such as jax.random.key(0), got {type(rng_key).__name__}")
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng_key)
    if dtype != jnp.uint32 or rng_key.shape[-1:] != (2,):
        raise TypeError(f"rng_key must be a JAX PRNG key such as jax.random.key(0), got an array of {dtype} {rng_key.shape}")
    return rng_key


class FitDiverged(FloatingPointError):
    """A round would have made the posterior invalid; ``result`` holds the last valid state."""

    def __init__(self, message: str, result: DPPVIResult):
        super().__init__(message)
        self.result = result


class DPPVI:
    """Partitioned variational inference driver, in the manner of ``numpyro.infer.SVI``.

    Args:
        model: a ``@dppvi.model`` NumPyro model taking the data arrays positionally.
        method: ``"pvi"`` (non-private local steps), ``"dp_optimisation"`` (DP-SGD in the local step),
            ``"local_averaging"``, ``"virtual_clients"`` or ``"parameter_perturbation"`` (privacy by
            perturbing model updates; without ``privacy`` they run without clipping or noise).
        schedule: ``"sequential" | "synchronous" | "asynchronous"``.
        optimizer: an optax ``GradientTransformation`` for the local steps (default ``adam(1e-2)``).
        local_steps: optimiser steps per client (per shard for update perturbation) per round.
        batch_size: rows per local step (``None``: the client's whole data; DP optimisation: the
            expected Poisson batch, or the fixed batch without replacement).
        num_samples: Monte Carlo draws of ``q`` per step, shared across the batch.
        damping: ``rho`` in ``t_m <- t_m + rho (q_new - q)``.
        server_steps: steps of the server's prior-factor refinement per round (non-Gaussian priors).
        privacy: a :class:`~numpyro_dppvi.privacy.Privacy`.
        rounds: the planned number of rounds; needed to calibrate the noise to a budget.
        shards: local partitions per client for update perturbation: an int or ``f(n_m) -> int``.
        invalid: rule for noisy updates with a non-positive precision: ``"reject"`` or ``"floor"``.
        precision_floor: the precision floor of ``invalid="floor"``.
        trusted_aggregator: synchronous update perturbation where each of the ``M`` participating
            clients adds noise ``sigma C / sqrt(M)`` and only the sum is revealed (DESIGN §5.3).
        privacy_unit: ``"example"`` (default) or ``"client"`` (client-level DP, synchronous,
            ``method="pvi"`` local steps; clients sampled with probability ``client_rate``).
    """

    def __init__(self, model, method: str = "pvi", schedule: str = "synchronous",
                 optimizer: optax.GradientTransformation | None = None, local_steps: int = 10,
                 batch_size: int | None = None, num_samples: int = 10, damping: float = 1.0,
                 server_steps: int = 50, privacy=None, rounds: int | None = None, shards=None,
                 invalid: str = "reject", precision_floor: float = 1e-3, trusted_aggregator: bool = False,
                 privacy_unit: str = "example", client_rate: float = 1.0, shard_seed: int = 0):
        from ..privacy import Privacy

        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
        if privacy_unit not in PRIVACY_UNITS:
            raise ValueError(f"unknown privacy_unit {privacy_unit!r}; choose one of {PRIVACY_UNITS}")
        if invalid not in INVALID_RULES:
            raise ValueError(f"unknown invalid-update rule {invalid!r}; choose one of {INVALID_RULES}")
        if privacy is not None and not isinstance(privacy, Privacy):
            raise TypeError("privacy must be dppvi.Privacy(...) or None")
        if method == "dp_optimisation":
            if privacy is None:
                raise TypeError(f"method={method!r} needs privacy=dppvi.Privacy(...) (a budget or a noise multiplier)")
            if batch_size is None:
                raise ValueError(f"method={method!r} needs a batch_size (the expected batch of each DP-SGD step)")
            if trusted_aggregator:
                raise ValueError("a trusted aggregator does not help DP optimisation (each step's noise is local); "
                                 "use an update-perturbation method or trusted_aggregator=False")
        if privacy is not None and privacy.adaptive_clip is not None and method != "dp_optimisation":
            raise ValueError("adaptive clipping applies to per-example gradient clipping: use "
                             "method='dp_optimisation' or a fixed clip")
        if method == "pvi" and privacy is not None and privacy_unit != "client":
            raise ValueError("method='pvi' is not private at the example level; use method='dp_optimisation' or an "
                             "update-perturbation method, or privacy_unit='client' for client-level DP")
        if privacy_unit == "client":
            if method != "pvi" or privacy is None or schedule != "synchronous":
                raise ValueError("client-level DP needs method='pvi', schedule='synchronous' and privacy=Privacy(...)")
        if trusted_aggregator and (method not in UPDATE_METHODS or schedule != "synchronous" or privacy is None):
            raise ValueError("trusted_aggregator=True needs a private update-perturbation method "
                             f"{UPDATE_METHODS} with schedule='synchronous'")
        if method in ("local_averaging", "virtual_clients") and shards is None:
            raise ValueError(f"method={method!r} needs shards= (an int, or a function of the client size)")
        if method == "parameter_perturbation":
            if shards not in (None, 1):
                raise ValueError("parameter perturbation uses one shard; use local_averaging for more")
            shards = 1
        if rounds is not None and (int(rounds) != rounds or rounds < 1):
            raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
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
        self.shards = shards
        self.invalid = invalid
        self.precision_floor = float(precision_floor)
        self.trusted_aggregator = bool(trusted_aggregator)
        self.privacy_unit = privacy_unit
        self.client_rate = float(client_rate)
        self.shard_seed = shard_seed
        self.adapter: ModelAdapter | None = None
        self.ledger = None
        self.plan = None

    # -- set-up --------------------------------------------------------------------------------
    def _setup(self, clients):
        clients = validate_clients(clients)
        self.clients = clients
        self.adapter = ModelAdapter(self.model, clients[0])
        for m, c in enumerate(clients):
            self.adapter.validate_data(c, f"client {m}")
        self.num_clients = len(clients)
        a = self.adapter
        if self.method in UPDATE_METHODS:
            layout = make_shards(clients, self.shards, self.shard_seed)
            self.num_shards = layout.num_shards
        else:
            layout = pad_clients(clients)
        self.data = tuple(jnp.asarray(x) for x in layout.arrays)
        self.mask = jnp.asarray(layout.mask)
        self.sizes = jnp.asarray(layout.sizes, jnp.float32)
        p = self.privacy
        if self.method == "dp_optimisation":
            self.plan = dp_sgd_plan(p, layout.sizes, self.batch_size, self.local_steps, self.planned_rounds)
            self.rule = DPOptimisation(a.log_lik_rows, a.dim, self.optimizer, self.local_steps, self.batch_size,
                                       self.num_samples, log_lik_row=a.log_lik_row_blocks, clip=p.clip,
                                       sampling=p.sampling, max_batch=self.plan.max_batch,
                                       blocks=a.site_sizes)
        elif self.method in UPDATE_METHODS:
            self.plan = None if p is None else shard_update_plan(p, self.num_clients, self.planned_rounds)
            cls = VirtualClients if self.method == "virtual_clients" else LocalAveraging
            self.rule = cls(a.log_lik_rows, a.dim, self.optimizer, self.local_steps, self.num_samples,
                            clip=None if p is None else p.clip, damping=self.damping, invalid=self.invalid,
                            precision_floor=self.precision_floor)
        else:
            if self.privacy_unit == "client":
                self.plan = client_level_plan(p, self.num_clients, self.planned_rounds, self.client_rate)
            self.rule = NonPrivate(a.log_lik_rows, a.dim, self.optimizer, self.local_steps, self.batch_size,
                                   self.num_samples)
        self.epsilon_max = None if self.plan is None else self.plan.epsilon_max(self.num_clients)
        self.server_step = (
            ServerFactorStep(a.server_log_density, a.server_mask, self.optimizer, self.server_steps, self.num_samples)
            if a.has_server_factor else None
        )
        self._round = jax.jit(self._round_fn)
        self._order = jax.jit(self._order_fn)

    def _adaptive_clip_state(self) -> dict:
        """Per-client adaptive clipping state, starting at ``Privacy.clip`` (stacked over clients)."""
        from ..privacy.adaptive_clip import adaptive_clip_init

        p, settings = self.privacy, self.privacy.adaptive_clip
        states = [adaptive_clip_init(p.clip, float(self.batch_size), p.count_noise_std(float(z)),
                                     settings.target_quantile, settings.learning_rate)
                  for z in self.plan.noise_multipliers]
        return {"clip": jax.tree.map(lambda *xs: jnp.stack(xs), *states),
                "noise_per_clip": jnp.asarray([p.gradient_noise_std(float(z), clip=1.0)
                                               for z in self.plan.noise_multipliers], jnp.float32)}

    def _noise_stds(self, active) -> np.ndarray:
        """Noise std each client adds this round (trusted aggregator: its share ``sigma C / sqrt(M)``)."""
        stds = np.array([self.plan.noise_std(m) for m in range(self.num_clients)])
        if self.trusted_aggregator:
            stds = stds / np.sqrt(max(int(np.sum(active)), 1))
        return stds

    def init(self, rng_key, clients) -> PVIState:
        """Validate and pad the clients, trace the model, and return the initial state (``q_0`` = prior)."""
        self._setup(clients)
        a, m = self.adapter, self.num_clients
        t0 = Gaussian(jnp.zeros(a.dim), jnp.where(a.server_mask, -0.5, 0.0))  # N(0, 1) on t_0's coordinates
        q = factors.multiply(a.prior, t0)
        zeros = Gaussian(jnp.zeros((m, a.dim)), jnp.zeros((m, a.dim)))
        key = _key_data(rng_key)
        init_key = jax.random.fold_in(jax.random.wrap_key_data(key), 0x7FFFFFFF)
        client_state = jax.vmap(self.rule.init_client_state)(self.data, self.mask, jax.random.split(init_key, m))
        if self.plan is not None and self.plan.kind != "client":
            client_state = dict(client_state, noise_std=jnp.asarray(self._noise_stds(np.ones(m)), jnp.float32))
        if self.privacy is not None and self.privacy.adaptive_clip is not None:
            client_state = dict(client_state, **self._adaptive_clip_state())
        state = PVIState(q=q, factors=zeros, server_factor=t0, q_seen=server._broadcast(q, m),
                         client_state=client_state, key=key, round=jnp.array(0, jnp.int32),
                         communications=jnp.array(0, jnp.int32), active=jnp.ones(m, bool))
        if self.server_step is not None:
            state = jax.jit(lambda s: server.refine_server_factor(self.server_step, s, init_key))(state)
        self.ledger = None if self.plan is None else self.privacy.ledger(m, self.trusted_aggregator)
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
        if self.privacy_unit == "client":
            return server.client_level(self.rule, self.damping, state, data, mask, sizes, k_clients,
                                       self.privacy.clip, self.plan.noise_std(0), self.client_rate)
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
                event = self.plan.event(int(m), int(arrivals[m]))
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
        if self.trusted_aggregator:
            stds = jnp.asarray(self._noise_stds(np.asarray(state.active)), jnp.float32)
            state = state._replace(client_state=dict(state.client_state, noise_std=stds))
        new_state, metrics = self._round(state, self.data, self.mask, self.sizes, order)
        if self.ledger is not None:  # the releases happened: charge them before anything can fail
            for m in np.flatnonzero(arrivals):
                self.ledger.record(int(m), self.plan.event(int(m), int(arrivals[m])))
        metrics = dict(metrics, stopped=stopped, rejected_round=False)
        if not bool(metrics["valid"]) and self.plan is not None and self.plan.kind in ("shard_update", "client"):
            # noisy releases whose sum would make q improper: the round is rejected as a whole (every
            # factor and client state kept; the releases stay charged); counted in the history
            return state._replace(round=new_state.round, communications=new_state.communications), \
                dict(metrics, rejected_round=True)
        if not bool(metrics["valid"]):
            raise FloatingPointError(
                f"round {int(state.round) + 1} produced an invalid posterior or cavity (non-finite or "
                "non-positive precision); the previous state is kept. Lower `damping`, the learning "
                "rate or `local_steps`."
            )
        return new_state, metrics

    def run(self, rng_key, clients, rounds: int, eval_data: Sequence | None = None,
            callback: Callable | None = None, progress: bool = False, state: PVIState | None = None,
            history: list | None = None, ledger=None, checkpoint=None) -> DPPVIResult:
        """Run ``rounds`` rounds from ``init``, or from ``state`` (with its ``history`` and privacy
        ``ledger``) to resume a saved fit, and return a result.

        ``checkpoint``: a path the result is saved to after every round (resume it with
        ``fit_dppvi(..., resume=path)``). If a round would make ``q`` invalid, :class:`FitDiverged` is
        raised carrying the last valid result (``err.result``) and the checkpoint keeps that state.
        """
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
            try:
                state, metrics = self.round(state)
            except FloatingPointError as exc:
                last = DPPVIResult(self.adapter, state, history, method=self.method, schedule=self.schedule,
                                   privacy=self.ledger, config=self.config())
                raise FitDiverged(str(exc), last) from exc
            jax.block_until_ready(state.q)
            entry = {"round": int(state.round), "communications": int(state.communications),
                     "participated": np.asarray(metrics["participated"]).tolist(),
                     "seconds": time.perf_counter() - start}
            if self.ledger is not None:
                entry["epsilon"] = self.ledger.epsilon
                if metrics["stopped"]:
                    entry["stopped"] = metrics["stopped"]
            if "invalid" in metrics:
                entry["invalid_updates"] = int(np.sum(np.asarray(metrics["invalid"])))
            if metrics["rejected_round"]:
                entry["rejected_round"] = True
            if "failed" in metrics and np.any(np.asarray(metrics["failed"])):
                entry["failed"] = np.flatnonzero(np.asarray(metrics["failed"])).tolist()
            if "order" in metrics and self.schedule == "asynchronous":
                entry["arrivals"] = np.asarray(metrics["order"]).tolist()
            if eval_arrays is not None:
                entry.update(evaluate(self.adapter, state.q, eval_arrays, eval_key))
            history.append(entry)
            if checkpoint is not None:
                DPPVIResult(self.adapter, state, history, method=self.method, schedule=self.schedule,
                            privacy=self.ledger, config=self.config()).save(checkpoint)
            if callback is not None:
                callback(state, entry)
        return DPPVIResult(self.adapter, state, history, method=self.method, schedule=self.schedule,
                           privacy=self.ledger, config=self.config())

    def config(self) -> dict:
        out = {"method": self.method, "schedule": self.schedule, "local_steps": self.local_steps,
               "batch_size": self.batch_size, "num_samples": self.num_samples, "damping": self.damping}
        if self.method in UPDATE_METHODS:
            out.update(shards=[int(k) for k in self.num_shards], invalid=self.invalid,
                       trusted_aggregator=self.trusted_aggregator)
        if self.plan is not None:
            out.update(noise_multiplier=[float(z) for z in self.plan.noise_multipliers], clip=self.privacy.clip,
                       sampling=self.privacy.sampling, neighbouring=self.privacy.neighbouring,
                       planned_rounds=self.planned_rounds, privacy_unit=self.privacy_unit)
        return out


def fit_dppvi(model, clients, *, method: str = "pvi", schedule: str = "synchronous", rounds: int = 10,
              local_steps: int = 10, batch_size: int | None = None, num_samples: int = 10,
              optimizer: optax.GradientTransformation | None = None, damping: float = 1.0,
              rng_key=None, eval_data=None, callback=None, progress: bool = False,
              server_steps: int = 50, privacy=None, checkpoint=None, resume=None, **options) -> DPPVIResult:
    """Fit a ``@dppvi.model`` to federated ``clients`` with (DP-)PVI; the one-call form of :class:`DPPVI`.

    ``method="dp_optimisation"`` with ``privacy=Privacy(epsilon=..., delta=..., clip=...)`` calibrates
    the noise so that every client's releases over ``rounds`` rounds meet the budget; the result's
    ``privacy`` ledger reports what was spent. ``options`` are the remaining :class:`DPPVI` arguments
    (``shards``, ``invalid``, ``precision_floor``, ``trusted_aggregator``, ``privacy_unit``, ``client_rate``).

    ``checkpoint=path`` saves the fit after every round; ``resume=path`` continues a saved fit (same
    model, clients and settings) up to ``rounds`` rounds in total, with its privacy ledger: a resumed
    fit gives the same result as an uninterrupted one and never re-spends or forgets budget.

    ``method="vips"``: federated VIPS for conjugate-exponential models (a ``ConjugateModel`` or a
    NumPyro model matching a supported pattern): exact local steps, each client releasing its clipped,
    noised expected sufficient statistics once per round; returns a ``VIPSResult``
    (see :func:`numpyro_dppvi.vips.federated_fit.fit_federated_vips`).
    """
    if method == "vips":
        from ..vips.federated_fit import fit_federated_vips

        unknown = set(options) - {"trusted_aggregator", "detect_options"}
        if unknown:
            raise ValueError(f"method='vips' does not take {sorted(unknown)}")
        return fit_federated_vips(model, clients, privacy=privacy, rounds=rounds, schedule=schedule, damping=damping,
                                  rng_key=rng_key, **options)
    driver = DPPVI(model, method=method, schedule=schedule, optimizer=optimizer, local_steps=local_steps,
                   batch_size=batch_size, num_samples=num_samples, damping=damping, server_steps=server_steps,
                   privacy=privacy, rounds=rounds, **options)
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    if resume is not None:
        template = driver.init(rng_key, clients)
        saved = DPPVIResult.load(resume, model, template_state=template)
        if saved.config.get("method") != method or saved.config.get("schedule") != schedule:
            raise ValueError(f"{resume} holds a {saved.config.get('method')}/{saved.config.get('schedule')} fit; "
                             f"resume it with the same method and schedule (asked: {method}/{schedule})")
        done = int(saved.state.round)
        if done > rounds:
            raise ValueError(f"{resume} already ran {done} rounds, more than rounds={rounds}")
        return driver.run(None, clients, rounds - done, eval_data=eval_data, callback=callback, progress=progress,
                          state=saved.state, history=saved.history, ledger=saved.privacy, checkpoint=checkpoint)
    return driver.run(rng_key, clients, rounds, eval_data=eval_data, callback=callback, progress=progress,
                      checkpoint=checkpoint)
