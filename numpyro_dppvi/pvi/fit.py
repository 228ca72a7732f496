"""``DPPVI``: the SVI-style driver of (DP-)PVI, and ``fit_dppvi``, its one-call form.

Wires the model adapter, a local update rule, the server schedule and (for private methods) the
privacy plan and ledger. ``init`` returns a :class:`PVIState` pytree and ``round`` advances it by
one jitted round. The state is **private** (it holds the fit's secret key and every client's private
state): ``run`` returns a :class:`~numpyro_dppvi.results.DPPVIResult` holding only what may be
published, and writes the state only to a private checkpoint (``checkpoint=path``), from which
``fit_dppvi(resume=path)`` continues with its ledger intact.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import functools
import json
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from .. import checkpoint as checkpoints
from .. import diagnostics, factors, keys
from ..cache import cached, shapes, to_device
from ..data import pad_clients, validate_clients
from ..evaluation import evaluate
from ..factors import Gaussian
from ..model import ModelAdapter
from ..privacy import Privacy, PrivacyLedger
from ..optim import Newton, cvi, natural_gradient
from ..privacy.adaptive_clip import adaptive_clip_init
from ..privacy.noise import float32_at_least
from ..privacy.sizes import public_client_sizes
from ..results import DPPVIResult
from . import server
from .full_rank import NonPrivateFullRank, ServerFactorStepFullRank
from .low_rank import NonPrivateLowRank, ServerFactorStepLowRank
from .local import DPOptimisation, NonPrivate, ServerFactorStep
from .privacy_plan import check_subsampled, client_level_plan, dp_sgd_plan, shard_update_plan
from .server import SCHEDULES, PVIState
from .shards import ROWS, make_shards, shard_counts
from .update_perturbation import INVALID_RULES, LocalAveraging, VirtualClients, trusted_aggregator_round

METHODS = ("pvi", "dp_optimisation", "local_averaging", "virtual_clients", "parameter_perturbation")
UPDATE_METHODS = ("local_averaging", "virtual_clients", "parameter_perturbation")
PRIVACY_UNITS = ("example", "client")
CHECKPOINT_FORMAT = "numpyro_dppvi.DPPVICheckpoint/1"
#: The optimiser of private local steps when none is given: one object, so that fits with the default
#: share compiled programs.
DEFAULT_OPTIMIZER = optax.adam(1e-2)
#: The local optimiser of non-private PVI (and of non-private global VI and BCM): conjugate-computation
#: steps for the precisions, Adam in posterior-sd units for the means (:func:`~numpyro_dppvi.optim.cvi`).
LOCAL_OPTIMIZER = cvi()
#: Non-private rounds when ``rounds`` is None: until ``q`` has converged (``diagnostics.convergence``,
#: checked from :data:`MIN_ROUNDS` on), at most :data:`MAX_ROUNDS`.
MIN_ROUNDS, MAX_ROUNDS = 2 * diagnostics.WINDOW, 100
#: Per-method defaults (the settings that work on the papers' problems and on the models of
#: ``benchmarks/fidelity.py``).
#: Non-private PVI (issue 21, measured against NUTS on 13 models and on Adult): the sequential schedule;
#: 20 local steps of :data:`LOCAL_OPTIMIZER` on antithetic draws, the client's answer the mean of the
#: last half of its iterates; rounds until converged. Measured: within max(0.5, AutoNormal + 0.25) NUTS
#: sd of NUTS on every model; the former defaults (10 steps of ``adam(1e-2)``, last iterate, 20 rounds)
#: left conjugate models 0.3-0.6 sd from the exact optimum and Adult's unbalanced split moving 5-13 sd a
#: round. Mean-field PVI on strongly correlated posteriors needs many rounds (NumPyro's zero-inflated
#: Poisson example: 40-65), which a fixed number of rounds cannot promise.
#: Virtual clients, one record each: natural-gradient local steps (Adam turns a sum of thousands of
#: one-record changes into a sum of signs), damping 0.1 and a precision floor of 1, the precision of a
#: standard-normal prior (noisy one-record changes often make a precision non-positive; flooring keeps
#: the update, rejecting would waste the round). On Adult at epsilon 1 these reach 0.844 accuracy
#: (rounds 5 or 10; docs/guide.md §3). DP optimisation: the sequential schedule. The update-perturbation
#: methods keep synchronous rounds (their defaults were tuned there; a trusted aggregator and
#: client-level DP need them).
METHOD_DEFAULTS = {
    "pvi": dict(schedule="sequential", rounds=None, optimizer=LOCAL_OPTIMIZER, local_steps=20, tail_average=0.5),
    # damping 0.5 (issue 23): at 1, 10 of 10 fits of a 5-covariate logistic regression (10 clients of 200 rows,
    # epsilon 1) raised FitDiverged within 40 rounds, and 27 of 30 at 10 clients of 1000; at 0.5 none, and the
    # posterior mean's RMSE at 10 rounds fell from 0.33 to 0.23 (n = 2000) and 0.41 to 0.34 (n = 10000)
    "dp_optimisation": dict(schedule="sequential", damping=0.5),
    "virtual_clients": dict(optimizer=natural_gradient(0.5), damping=0.1, invalid="floor", precision_floor=1.0),
    "local_averaging": dict(invalid="floor", precision_floor=1.0),
}
DEFAULT_LOCAL_STEPS = 10
#: Share of all client updates that may fail (non-finite, dropped) before a fit warns even when none
#: failed in its last rounds.
FAILED_UPDATES_TOLERATED = 0.05
DEFAULT_ROUNDS = 10


def did_you_mean(name, choices) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` to a misspelt ``name`` (``dp_optimization``,
    ``synchronus``), else ``""``."""
    close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def default_schedule(method: str, trusted_aggregator: bool = False, privacy_unit: str = "example") -> str:
    """The schedule used when none is given: synchronous where the mechanism needs it (a trusted
    aggregator, client-level DP), else the method's default (:data:`METHOD_DEFAULTS`)."""
    if trusted_aggregator or privacy_unit == "client":
        return "synchronous"
    return METHOD_DEFAULTS.get(method, {}).get("schedule", "synchronous")


def _shards_of_batch(batch_size: int, n: int) -> int:
    """``ceil(n_m / batch_size)`` shards (the DP-PVI paper's ``K = ceil(1 / q)``)."""
    return max(-(-n // batch_size), 1)


#: What to change when a round would make the posterior invalid, in the options of the function called.
ADVICE = {
    "fit_dppvi": "lower `damping`, the optimizer's learning rate or `local_steps`",
    "DPPVI": "lower `damping`, the optimizer's learning rate or `local_steps`",
    "fit_global_vi": "lower the optimizer's learning rate or `steps_per_round`",
    "fit_bcm": "lower `local_steps` or the optimizer's learning rate",
}
#: Added to ``ADVICE`` for a low-rank fit: its truncation can make a cavity improper (pvi/low_rank.py).
LOW_RANK_ADVICE = ("; with family='low_rank' a truncation to rank r can make a cavity improper: a higher `rank`, "
                   "or family='full_rank' (up to a few hundred latents), keeps more of each factor")
#: What to change when q is still drifting at the end of a fit.
CONVERGENCE_ADVICE = {
    "fit_dppvi": "Run more rounds (resume=checkpoint continues a fit){faster}",
    "DPPVI": "Run more rounds{faster}",
    "fit_global_vi": "Run more `steps` or raise the optimizer's learning rate",
    "fit_bcm": "Raise `local_steps`",
}
#: Adam moves every coordinate by about its learning rate per step whatever the gradient: with many
#: rows per client that is many posterior sd (Adult, 4000 rows per client: about 10 sd a round at 1e-2).
_ADAM = "a smaller learning rate (Adam moves each coordinate by about the learning rate per step, many posterior sd when the data are large)"
JITTER_ADVICE = {
    "fit_dppvi": "Use {calmer}more `num_samples`, or " + _ADAM,
    "DPPVI": "Use {calmer}more `num_samples`, or " + _ADAM,
    "fit_global_vi": "Use more `num_samples`, or " + _ADAM,
    "fit_bcm": "Raise `local_steps` or `num_samples`",
}


#: Drift advice for a non-private mean-field fit: on Adult, mean-field PVI still moved 0.1-0.3 sd a round
#: along the one-hot/intercept ridge after 100 rounds; full-rank converged in 20 (benchmarks/fidelity.py).
FULL_RANK_ADVICE = ("; mean-field q crosses correlated directions slowly, and family='full_rank' (for up to a few "
                    "hundred latents) converges in fewer rounds with the marginal sds")


#: Drift advice for a private fit: its noise is calibrated to the planned rounds, so resuming cannot add rounds.
PRIVATE_DRIFT_ADVICE = ("Plan more rounds in a new fit (rounds=..., its noise calibrated to them; its budget adds to "
                        "this one's on the same data; resuming cannot add rounds to a spent budget){faster}")


def convergence_advice(caller: str, schedule: str | None, family: str = "mean_field",
                       private: bool = False) -> tuple[str, str]:
    """``(drift advice, jitter advice)`` of a ConvergenceWarning, in the options of ``caller``."""
    sequential = schedule == "sequential"
    faster = ", or more `local_steps`" if sequential else ", or use schedule='sequential' or a larger `damping` for faster rounds"
    calmer = "" if sequential else "a smaller `damping` (synchronous rounds over M clients: about 1/M) or schedule='sequential', "
    template = PRIVATE_DRIFT_ADVICE if private and caller in ("fit_dppvi", "DPPVI") else CONVERGENCE_ADVICE[caller]
    drift = template.format(faster=faster)
    if family == "mean_field" and not private and caller != "fit_bcm":
        drift += FULL_RANK_ADVICE
    return drift, JITTER_ADVICE[caller].format(calmer=calmer)
#: Settings a resumed fit must share with its checkpoint (the privacy ones are checked against the
#: stored ledger too): any change would make the stored ledger count the wrong releases.
RESUME_SETTINGS = ("method", "schedule", "local_steps", "batch_size", "num_samples", "damping", "server_steps",
                   "shards", "invalid", "precision_floor", "trusted_aggregator", "privacy_unit", "client_rate",
                   "planned_rounds", "tail_average", "family", "rank", "privacy")
#: What a checkpoint written before a setting existed meant by it.
SAVED_BEFORE = {"family": "mean_field", "rank": None}


@dataclass(frozen=True)
class RoundSpec:
    """Everything static about one round: the key of its compiled program (:func:`round_program`).

    Two fits with equal specs (the same rule objects, hence the same adapter and optimiser, and the
    same settings) share one jitted program, so a second fit, a resume or a new ``init`` compiles
    nothing new for inputs of the same shapes.
    """

    rule: Any
    server_step: Any
    schedule: str
    damping: float
    privacy_unit: str
    trusted_aggregator: bool
    client_rate: float
    clip: float | None
    invalid: str
    precision_floor: float
    num_clients: int


def _round(spec: RoundSpec, state: PVIState, data, mask, sizes, limits, server_noise_std):
    """One round of the fit described by ``spec`` (pure; jitted by :func:`round_program`)."""
    key = server.round_key(state)
    k_server, k_order, k_clients = jax.random.split(key, 3)
    if spec.server_step is not None:
        state = server.refine_server_factor(spec.server_step, state, k_server)
    if spec.privacy_unit == "client":
        return server.client_level(spec.rule, spec.damping, state, data, mask, sizes, k_clients, limits,
                                   spec.clip, server_noise_std, spec.client_rate, spec.invalid, spec.precision_floor)
    if spec.trusted_aggregator:
        state, stopped = server.stop_over_budget(state, limits)
        new_state, metrics = trusted_aggregator_round(spec.rule, spec.damping, state, data, mask, sizes,
                                                      k_clients, state.active)
        return server.charge(new_state, state.active), dict(metrics, stopped=stopped)
    if spec.schedule == "synchronous":
        return server.synchronous(spec.rule, spec.damping, state, data, mask, sizes, k_clients, limits)
    if spec.schedule == "asynchronous":
        order = server.arrival_order(k_order, sizes, state.active, spec.num_clients)
    else:
        order = jnp.arange(spec.num_clients)
    return server.arrivals(spec.rule, spec.damping, state, data, mask, sizes, k_clients, order, limits,
                           stale=spec.schedule == "asynchronous")


def round_program(spec: RoundSpec) -> Callable:
    """``jit(round)`` for ``spec``, built once per spec in the process (:mod:`numpyro_dppvi.cache`)."""
    return cached(("pvi-round", spec), lambda: jax.jit(functools.partial(_round, spec)))


def _initial_state(rule, server_step, num_clients, data, mask, key_data, prior, server_mask, extras) -> PVIState:
    """The state before round 1 (``q_0`` = prior times the server's refined prior factor): one
    program, jitted and cached per (rule, server step, number of clients) by ``DPPVI.init``."""
    m, dim = num_clients, prior.eta1.shape[0]
    family = getattr(rule, "family", "mean_field")
    basis = factors.initial_basis(dim, rule.rank, prior.eta2.dtype) if family == "low_rank" else None
    half = jnp.full(dim, -0.5, prior.eta2.dtype)  # a strongly typed state: a resumed one compiles nothing new
    t0 = factors.as_family(Gaussian(jnp.zeros(dim, prior.eta1.dtype), jnp.where(server_mask, half, jnp.zeros_like(half))),
                           family, basis)
    prior = factors.as_family(prior, family, basis)
    q = factors.multiply(prior, t0)
    init_key = jax.random.fold_in(jax.random.wrap_key_data(key_data), 0x7FFFFFFF)
    client_state = jax.vmap(rule.init_client_state)(data, mask, jax.random.split(init_key, m))
    if extras:
        client_state = dict(client_state, **extras) if isinstance(client_state, dict) else dict(extras)
    state = PVIState(q=q, factors=server.broadcast(factors.zeros(dim, family=family, basis=basis), m), server_factor=t0,
                     noise_factor=factors.zeros(dim, family=family, basis=basis), q_seen=server.broadcast(q, m), client_state=client_state,
                     key=key_data, round=jnp.array(0, jnp.int32), communications=jnp.array(0, jnp.int32),
                     active=jnp.ones(m, bool), participations=jnp.zeros(m, jnp.int32))
    if server_step is not None:
        state = server.refine_server_factor(server_step, state, init_key)
    return state


def _local_posteriors(rule, priors, data, mask, sizes, client_state, key):
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(sizes.shape[0]))
    q_m, _, _ = jax.vmap(rule.update)(priors, priors, data, mask, sizes, keys, client_state)
    return q_m


def trace_rows(clients, count: int = 3) -> tuple:
    """The first ``count`` rows pooled across clients (in client order): enough rows to trace the model
    however small the clients are. Tracing sees them once and releases nothing."""
    taken, out = 0, [[] for _ in clients[0]]
    for client in clients:
        need = count - taken
        if need <= 0:
            break
        for j, a in enumerate(client):
            out[j].append(np.asarray(a)[:need])
        taken += min(need, len(client[0]))
    return tuple(np.concatenate(parts) for parts in out)


def model_adapter(model, clients) -> ModelAdapter:
    """The model traced on rows pooled across clients, reused for every fit of the same model with
    data of the same row shapes and dtypes (:mod:`numpyro_dppvi.cache`)."""
    rows = trace_rows(clients)
    key = ("adapter", model, shapes(tuple(a[:1] for a in rows)), getattr(model, "_dppvi_privacy_plate", None))
    return cached(key, lambda: ModelAdapter(model, rows))


class NoValidUpdates(FloatingPointError):
    """No client produced a valid update in the whole fit: ``q`` is still the prior (``result``)."""

    def __init__(self, message: str, result: DPPVIResult):
        super().__init__(message)
        self.result = result


class FitDiverged(FloatingPointError):
    """A round would have made the posterior invalid; ``result`` holds the last valid (public) result."""

    def __init__(self, message: str, result: DPPVIResult):
        super().__init__(message)
        self.result = result


class DPPVI:
    """Partitioned variational inference driver, in the manner of ``numpyro.infer.SVI``.

    Args:
        model: a NumPyro model taking the data arrays positionally (``@dppvi.model`` optional).
        method: ``"pvi"`` (non-private local steps), ``"dp_optimisation"`` (DP-SGD in the local step),
            ``"local_averaging"``, ``"virtual_clients"`` or ``"parameter_perturbation"`` (privacy by
            perturbing model updates; without ``privacy`` they run without clipping or noise).
        schedule: ``"sequential" | "synchronous" | "asynchronous"``; default sequential for ``"pvi"`` and
            ``"dp_optimisation"``, synchronous for the update-perturbation methods, a trusted aggregator
            and client-level DP (:data:`METHOD_DEFAULTS`).
        optimizer: an optax ``GradientTransformation`` for the local steps (default: ``optim.cvi()`` for
            ``"pvi"``, ``natural_gradient(0.5)`` for virtual clients, ``adam(1e-2)`` otherwise).
        local_steps: optimiser steps per client (per shard for update perturbation) per round (default
            20 for ``"pvi"``, 10 otherwise).
        batch_size: rows per local step (``None``: the client's whole data; DP optimisation: the
            expected Poisson batch, or the fixed batch without replacement).
        num_samples: Monte Carlo draws of ``q`` per step, shared across the batch.
        damping: ``rho`` in ``t_m <- t_m + rho (q_new - q)``.
        server_steps: steps of the server's prior-factor refinement per round (non-Gaussian priors).
        privacy: a :class:`~numpyro_dppvi.privacy.Privacy`.
        rounds: the planned number of rounds; needed to calibrate the noise to a budget.
        shards: local partitions per client for update perturbation: ``"rows"`` (one record per
            shard; the default of ``virtual_clients``), an int, or ``f(n_m) -> int`` (records are
            assigned by a keyed hash of their own values, see :mod:`numpyro_dppvi.pvi.shards`).
        invalid: rule for noisy updates with a non-positive precision: ``"reject"`` or ``"floor"``.
        precision_floor: the precision floor of ``invalid="floor"``.
        trusted_aggregator: synchronous update perturbation where each participating client adds a
            share of the noise and only the sum is revealed (DESIGN §5.3).
        privacy_unit: ``"example"`` (default) or ``"client"`` (client-level DP, synchronous,
            ``method="pvi"`` local steps; clients sampled with probability ``client_rate``).
        tail_average: the share of the last local iterates whose mean is the client's answer (default
            0.5 for ``"pvi"``, 0 otherwise; :func:`~numpyro_dppvi.pvi.local.optimise`).
        family: the Gaussian family of ``q`` and of every factor: ``"mean_field"`` (default: independent
            coordinates, ``O(D)`` per factor) or ``"full_rank"`` (a full precision matrix, ``O(D^2)``
            memory per client and ``O(D^3)`` per step; local steps by :class:`~numpyro_dppvi.optim.Newton`,
            :mod:`~numpyro_dppvi.pvi.full_rank`). Mean-field under-states the sds of correlated posteriors
            (docs/guide.md, "Choosing the family"). ``"full_rank"`` is available without privacy
            (``method="pvi"``, :func:`fit_global_vi`, :func:`fit_bcm`) and with every private method: update
            perturbation (with or without a trusted aggregator) and client-level DP release a clipped change
            of the whole precision matrix with symmetric noise
            (:func:`~numpyro_dppvi.pvi.update_perturbation.release_change`); DP optimisation moves the mean
            and the Cholesky factor of the covariance with an optax optimizer
            (:func:`~numpyro_dppvi.factors.to_params`). A private release has ``D (D + 3) / 2`` noise
            coordinates (mean-field ``2 D``).
        ``"low_rank"`` with ``rank=r`` (default ``round(sqrt(D))``): a diagonal plus rank-``r`` precision in one
            public basis shared by ``q`` and every factor (:mod:`~numpyro_dppvi.pvi.low_rank`); ``method="pvi"`` (Newton
            steps), ``"dp_optimisation"`` (parameters ``(loc, log s, W)``, ``2 D + D r``
            noise coordinates), parameter perturbation and local averaging (with or without a trusted aggregator) and
            client-level DP (releases in the public basis, ``2 D + r (r + 1) / 2 + (D - r) r`` noise coordinates),
            :func:`fit_global_vi`, :func:`fit_bcm` and the Flower deployment; not virtual clients. ``r = D`` is the
            full-rank fit.
    """

    def __init__(self, model, method: str = "pvi", schedule: str | None = None,
                 optimizer: optax.GradientTransformation | None = None, local_steps: int | None = None,
                 batch_size: int | None = None, num_samples: int = 10, damping: float | None = None,
                 server_steps: int = 50, privacy=None, rounds: int | None = None, shards=None,
                 invalid: str | None = None, precision_floor: float | None = None, trusted_aggregator: bool = False,
                 privacy_unit: str = "example", client_rate: float = 1.0, tail_average: float | None = None,
                 family: str = "mean_field", rank: int | None = None):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}{did_you_mean(method, METHODS)}; choose one of {METHODS}")
        factors.check_family(family, "DPPVI")
        if rank is not None and family != "low_rank":
            raise ValueError(f"rank= sets the rank of family='low_rank'; family={family!r} has none")
        if rank is not None and (int(rank) != rank or rank < 1 or isinstance(rank, bool)):
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        if method == "dp_optimisation" and isinstance(optimizer, Newton):
            raise ValueError("method='dp_optimisation' takes an optax optimizer on the privatised gradients "
                             "(optim.Newton needs the Hessians of the data, which DP-SGD does not release); with "
                             "family='full_rank' it moves the mean and the Cholesky factor of the covariance")
        if family == "low_rank" and method == "virtual_clients":
            raise ValueError("family='low_rank' is not available with virtual clients: a virtual factor written in "
                             "the shared rank-r basis loses its own directions, and its cavity double-counts them; "
                             "kept in a basis of its own, the part of its change outside the shared basis is released "
                             "again every round (measured at negligible noise on a 0.95-correlated regression, rank 1: "
                             "sds 2-4x and 1.3-2x the exact ones, means 4-140 sd off); take family='full_rank' or "
                             "'mean_field', or method='local_averaging'")
        if family in ("full_rank", "low_rank") and method != "dp_optimisation" and optimizer is not None and not isinstance(optimizer, Newton):
            raise ValueError(f"family={family!r} takes Newton steps with exact expected Hessians: pass "
                             "optimizer=optim.Newton(precision_step=...) or leave optimizer out (optax "
                             "transformations act on the (loc, log_scale) of a mean-field q)")
        if family == "mean_field" and isinstance(optimizer, Newton):
            raise ValueError("optim.Newton is the local step of family='full_rank'; pass family='full_rank' or an "
                             "optax optimizer")
        defaults = METHOD_DEFAULTS.get(method, {})
        schedule = default_schedule(method, trusted_aggregator, privacy_unit) if schedule is None else schedule
        if family in ("full_rank", "low_rank") and optimizer is None and method != "dp_optimisation":
            optimizer = Newton()
        optimizer = defaults.get("optimizer", DEFAULT_OPTIMIZER) if optimizer is None else optimizer
        local_steps = defaults.get("local_steps", DEFAULT_LOCAL_STEPS) if local_steps is None else local_steps
        damping = defaults.get("damping", 1.0) if damping is None else damping
        invalid = defaults.get("invalid", "reject") if invalid is None else invalid
        precision_floor = defaults.get("precision_floor", 1e-3) if precision_floor is None else precision_floor
        tail_average = defaults.get("tail_average", 0.0) if tail_average is None else tail_average
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}{did_you_mean(schedule, SCHEDULES)}; choose one of {SCHEDULES}")
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
        if method == "virtual_clients" and shards is None:
            shards = ROWS
        if method == "local_averaging" and shards is None:
            if batch_size is None:
                raise ValueError("method='local_averaging' needs shards= (\"rows\", an int, or a function of the "
                                 "client size) or a batch_size (then each client has ceil(n_m / batch_size) shards)")
            shards = functools.partial(_shards_of_batch, int(batch_size))
        if method == "parameter_perturbation":
            if shards not in (None, 1):
                raise ValueError("parameter perturbation uses one shard; use local_averaging for more")
            shards = 1
        if shards is not None and not (shards == ROWS or callable(shards)
                                       or (isinstance(shards, (int, np.integer)) and not isinstance(shards, bool)
                                           and shards >= 1)):
            raise ValueError(f"shards must be 'rows', a positive int or a function n_m -> int, got {shards!r}")
        if rounds is not None and (int(rounds) != rounds or rounds < 1):
            raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
        if not (0.0 < float(damping) <= 1.0):
            raise ValueError(f"damping must be in (0, 1], got {damping}")
        for name, value in (("local_steps", local_steps), ("num_samples", num_samples), ("server_steps", server_steps)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= float(tail_average) < 1.0:
            raise ValueError(f"tail_average must be in [0, 1) (the share of the last local iterates averaged), "
                             f"got {tail_average}")
        if batch_size is not None and (int(batch_size) != batch_size or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        self.model = model
        self.method = method
        self.schedule = schedule
        self.optimizer = optimizer
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
        self.tail_average = float(tail_average)
        self.family = family
        self.rank = None if rank is None else int(rank)
        self.adapter: ModelAdapter | None = None
        self.ledger = None
        self.plan = None
        self.caller = "DPPVI"  # the public function whose options error messages name

    # -- set-up --------------------------------------------------------------------------------
    def _setup(self, clients, key_data):
        """Validate and lay out the clients (shards keyed by a secret derived from ``key_data``),
        trace the model, make the privacy plan and the local rule, and compile the round."""
        clients = validate_clients(clients)
        self.clients = clients
        observed = [len(c[0]) for c in clients]
        # every size-derived setting below (rates, charges, shard counts, scales, shapes, arrival weights)
        # comes from these: declared public bounds, else the observed sizes (privacy.sizes)
        p = self.privacy
        sizes = np.asarray(observed, np.int64) if p is None or self.privacy_unit == "client" else \
            public_client_sizes(p, observed, self.caller)
        if self.method == "dp_optimisation":  # before tracing the model: a quick, clear error
            check_subsampled(self.batch_size, sizes, self.caller)
        self.adapter = model_adapter(self.model, clients)
        for m, c in enumerate(clients):
            self.adapter.validate_data(c, f"client {m}")
        self.num_clients = len(clients)
        a = self.adapter
        # noise coordinates of one release: a change of (eta1, eta2), or DP-SGD's gradient of (loc, log_scale) or
        # of the full-rank (loc, log_diag, offdiag), as many: 2 D or D (D + 3) / 2
        if self.family == "low_rank":
            self.rank = factors.resolved_rank(a.dim, self.rank)
        dimension = (factors.num_parameters if self.method == "dp_optimisation" else factors.num_coordinates)(
            a.dim, self.family, self.rank or 0)
        declared = p is not None and p.public_sizes is not None
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
        if self.method == "dp_optimisation":
            self.plan = dp_sgd_plan(p, sizes, self.batch_size, self.local_steps, self.planned_rounds, dimension)
            self.rule = DPOptimisation(a.log_lik_rows, a.dim, self.optimizer, self.local_steps, self.batch_size,
                                       self.num_samples, log_lik_row=a.log_lik_row_blocks, clip=p.clip,
                                       sampling=p.sampling, max_batch=self.plan.max_batch,
                                       blocks=a.site_sizes, chunk=self.plan.chunk, average=self.tail_average,
                                       family=self.family, rank=self.rank or 0)
        elif self.method in UPDATE_METHODS:
            self.plan = None if p is None else shard_update_plan(p, self.num_clients, self.planned_rounds, dimension,
                                                                 one_record_per_shard=self.shards == ROWS)
            cls = VirtualClients if self.method == "virtual_clients" else LocalAveraging
            self.rule = cls(a.log_lik_rows, a.dim, self.optimizer, self.local_steps, self.num_samples,
                            clip=None if p is None else p.clip, damping=self.damping, invalid=self.invalid,
                            precision_floor=self.precision_floor, family=self.family, rank=self.rank or 0)
        else:
            if self.privacy_unit == "client":
                self.plan = client_level_plan(p, self.num_clients, self.planned_rounds, self.client_rate, dimension)
            cls = {"full_rank": NonPrivateFullRank, "low_rank": NonPrivateLowRank}.get(self.family, NonPrivate)
            extra = {"rank": self.rank} if self.family == "low_rank" else {}
            self.rule = cls(a.log_lik_rows, a.dim, self.optimizer, self.local_steps, self.batch_size,
                            self.num_samples, average=self.tail_average, **extra)
        if self.plan is not None:
            self._warn_if_noise_swamps()
        server_mask = tuple(bool(b) for b in np.asarray(a.server_mask))
        if not a.has_server_factor:
            self.server_step = None
        elif self.family in ("full_rank", "low_rank"):
            newton = self.optimizer if isinstance(self.optimizer, Newton) else Newton()
            cls = ServerFactorStepLowRank if self.family == "low_rank" else ServerFactorStepFullRank
            self.server_step = cls(a.server_log_density, server_mask, self.server_steps,
                                                        self.num_samples, newton.precision_step)
        else:
            self.server_step = ServerFactorStep(a.server_log_density, server_mask, self.optimizer, self.server_steps,
                                                self.num_samples)
        self.spec = RoundSpec(self.rule, self.server_step, self.schedule, self.damping, self.privacy_unit,
                              self.trusted_aggregator, self.client_rate, None if p is None else p.clip, self.invalid,
                              self.precision_floor, self.num_clients)
        self._program = round_program(self.spec)
        self._server_noise_std = to_device(float32_at_least(
            self.plan.noise_std(0) if self.plan is not None and self.plan.kind == "client" else 0.0), np.float32)

    def shard_layout(self, clients, key_data, counts=None):
        """The shards of ``clients`` as this fit derives them (update-perturbation methods): keyed by a
        secret derived from ``key_data``, by the records' bytes, or by their positions under the
        substitute relation (:mod:`.shards`); ``counts``: the planned shard counts (a neighbouring data
        set is laid out under the settings of the original)."""
        p = self.privacy
        return make_shards(clients, self.shards, keys.derived_bytes(key_data, keys.SHARD_HASH_TAG), counts=counts,
                           by_position=p is not None and p.neighbouring == "substitute")

    def _signal_terms(self, plan) -> np.ndarray:
        """Per client: clipped contributions summed in one release (see :func:`diagnostics.noise_to_signal`)."""
        if plan.kind == "dp_sgd":
            return plan.rates * self.public_sizes
        if plan.kind == "shard_update":
            return np.asarray(self.num_shards, np.float64)
        return np.full(self.num_clients, self.client_rate * self.num_clients)

    def _noise_to_signal(self, plan) -> np.ndarray:
        noise = np.array([plan.noise_std(m) for m in range(self.num_clients)])
        return diagnostics.noise_to_signal(noise, plan.dimension, self._signal_terms(plan), self.privacy.clip)

    def _warn_if_noise_swamps(self) -> None:
        """Warn (:class:`~numpyro_dppvi.diagnostics.NoiseWarning`) before fitting when one release's noise
        is larger than any signal it can carry, with settings that would bring it to half of that."""
        ratio = self._noise_to_signal(self.plan)
        if float(ratio.max()) <= diagnostics.NOISE_SWAMPS:
            return
        worst = int(np.argmax(ratio))
        what = {"dp_sgd": f"a batch of {self.plan.rates[worst] * self.public_sizes[worst]:.0f} clipped gradients",
                "shard_update": f"{self._signal_terms(self.plan)[worst]:.0f} clipped shard change(s)",
                "client": "the clipped client changes"}[self.plan.kind]
        warnings.warn(
            f"{self.caller}: the calibrated noise swamps the signal: noise multiplier "
            f"{self.plan.noise_multipliers[worst]:.3g}, so one release's noise has norm {ratio[worst]:.2g} times "
            f"the largest norm of {what} (client {worst}, {self.plan.dimension} noise coordinates). "
            f"{self._noise_advice()}", diagnostics.NoiseWarning, stacklevel=diagnostics.user_stacklevel())

    def _noise_advice(self) -> str:
        """Fewer releases for the same budget (calibrated noise only): the first halving of the local steps
        (then of the rounds) that brings every client's ratio to ``NOISE_SWAMPS / 2``."""
        p = self.privacy
        if p.epsilon is None:
            return "A smaller noise_multiplier (it costs more epsilon), a larger batch or more data per client would help."
        steps, rounds = self.plan.steps_per_participation, self.planned_rounds or 1
        for _ in range(8):
            if steps > 1:
                steps = max(steps // 2, 1)
            elif rounds > 1:
                rounds = max(rounds // 2, 1)
            else:
                break
            trial = dataclasses.replace(self.plan, steps_per_participation=steps, noise_multipliers=None)
            trial.calibrate(rounds)
            if float(self._noise_to_signal(trial).max()) <= diagnostics.NOISE_SWAMPS / 2:
                if self.caller == "fit_global_vi":
                    fewer = f"steps={rounds * steps} with steps_per_round={steps}"
                elif self.plan.kind == "dp_sgd":
                    fewer = f"rounds={rounds} with local_steps={steps}"
                else:
                    fewer = f"rounds={rounds}"
                return (f"For epsilon={p.epsilon:g}, {fewer} would bring it to half the signal; more data per "
                        "client or a larger epsilon would too.")
        return f"No number of rounds brings it below the signal at epsilon={p.epsilon:g}: use a larger epsilon or more data per client."

    def _adaptive_clip_state(self) -> dict:
        """Per-client adaptive clipping state, starting at ``Privacy.clip`` (stacked over clients)."""
        p, settings = self.privacy, self.privacy.adaptive_clip
        states = [adaptive_clip_init(p.clip, float(self.batch_size), p.count_noise_std(float(z)),
                                     settings.target_quantile, settings.learning_rate)
                  for z in self.plan.noise_multipliers]
        return {"clip": jax.tree.map(lambda *xs: jnp.stack(xs), *states),
                "noise_per_clip": to_device(float32_at_least([p.gradient_noise_std(float(z), clip=1.0)
                                                              for z in self.plan.noise_multipliers]), np.float32)}

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
        extras = {}  # per-client settings the rule reads from its state (numpy: the program takes them as inputs)
        if self.method in UPDATE_METHODS:
            extras.update(ids=np.asarray(self.shard_ids), num_shards=np.asarray(self.num_shards, np.float32),
                          noise_std=np.zeros(m, np.float32))
        if self.plan is not None and self.plan.kind != "client":
            extras["noise_std"] = float32_at_least([self.plan.noise_std(j) for j in range(m)])
        if self.plan is not None and self.plan.kind == "dp_sgd":
            extras["rate"] = np.asarray(self.plan.rates, np.float32)
        if self.privacy is not None and self.privacy.adaptive_clip is not None:
            extras.update(self._adaptive_clip_state())
        program = cached(("pvi-initial-state", self.rule, self.server_step, m),
                         lambda: jax.jit(functools.partial(_initial_state, self.rule, self.server_step, m)))
        state = program(self.data, self.mask, to_device(key_data, np.uint32), self.adapter.prior,
                        self.adapter.server_mask, extras)
        self.seed = seed
        self.ledger = None if self.plan is None else self.privacy.ledger(
            m, self.trusted_aggregator, seed=seed, charges=self.plan.charges(self.planned_rounds),
            sizes="unused" if self.privacy_unit == "client" else None)
        return state

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

    def local_posteriors(self, state: PVIState, priors: Gaussian) -> Gaussian:
        """Every client's local update, once, from its own prior: ``q_m`` fitted with start and cavity
        ``priors[m]`` (``[M, D]``) on its own data (Bayesian committee machines). A private rule's
        releases are charged to :attr:`ledger` (one participation per client)."""
        program = cached(("pvi-local-posteriors", self.rule), lambda: jax.jit(functools.partial(
            _local_posteriors, self.rule)))
        q_m = program(priors, self.data, self.mask, self.sizes, state.client_state,
                      jax.random.fold_in(jax.random.wrap_key_data(state.key), 1))
        if self.ledger is not None:
            for m in range(self.num_clients):
                self.ledger.record(m, self.plan.event(m, 1))
        return q_m

    def settings(self) -> dict:
        """The data-independent settings of the fit (JSON): published as ``result.config`` and
        compared on resume (:data:`RESUME_SETTINGS`)."""
        out = {"method": self.method, "schedule": self.schedule, "local_steps": self.local_steps,
               "batch_size": self.batch_size, "num_samples": self.num_samples, "damping": self.damping,
               "server_steps": self.server_steps, "planned_rounds": self.planned_rounds,
               "privacy_unit": self.privacy_unit, "client_rate": self.client_rate,
               "trusted_aggregator": self.trusted_aggregator, "invalid": self.invalid,
               "precision_floor": self.precision_floor, "tail_average": self.tail_average, "family": self.family,
               "rank": self.rank, "shards": None,
               "privacy": None}
        if self.method in UPDATE_METHODS and self.adapter is not None:
            out["shards"] = "rows" if self.shards == ROWS else [int(k) for k in self.num_shards]
        p = self.privacy
        if p is not None and self.plan is not None:
            out["privacy"] = {
                "epsilon": p.epsilon, "delta": p.delta, "clip": p.clip, "sampling": p.sampling,
                "neighbouring": p.neighbouring, "accountant": p.accountant,
                "epsilon_max": None if p.epsilon_max is None else
                [float(x) for x in np.atleast_1d(p.epsilon_max_per_client(self.num_clients))],
                "adaptive_clip": None if p.adaptive_clip is None else dataclasses.asdict(p.adaptive_clip),
                "noise_multiplier": [float(z) for z in self.plan.noise_multipliers],
            }
            if p.public_sizes is not None:  # absent otherwise, as in checkpoints written before it existed
                out["privacy"]["public_sizes"] = [int(n) for n in self.public_sizes]
        return out

    config = settings

    def _result(self, state: PVIState, history: list) -> DPPVIResult:
        return DPPVIResult(self.adapter, state.q, history, method=self.method, schedule=self.schedule,
                           privacy=self.ledger, config=self.settings(), rounds=int(state.round),
                           convergence=getattr(self, "convergence", None))

    def _public_entry(self, state, metrics, seconds) -> tuple[dict, dict]:
        """Split one round's record into what may be published and what stays in the private checkpoint."""
        client_level = self.privacy_unit == "client"
        entry = {"round": int(state.round)}
        private = {"round": int(state.round)}
        # A round's time follows the realised (secret) Poisson batch sizes (poisson_fold's passes): a
        # private fit keeps it out of the published history (issue 24, finding 7).
        (private if self.plan is not None else entry)["seconds"] = seconds
        participated = np.asarray(metrics["participated"]).tolist()
        if client_level:  # the client sample and its size would void the subsampling amplification
            private.update(participated=participated, communications=int(state.communications))
        else:
            entry.update(communications=int(state.communications), participated=participated)
        if metrics["stopped"]:
            entry["stopped"] = metrics["stopped"]
        if "invalid" in metrics:
            invalid = np.asarray(metrics["invalid"])
            entry["invalid_updates"] = int(np.sum(invalid))
            if self.invalid == "reject" and invalid.any():  # whose noisy update was not applied
                if invalid.ndim == 0:  # one aggregate (trusted aggregator): nobody's
                    who = np.flatnonzero(np.asarray(metrics["participated"]))
                elif "order" in metrics:  # one flag per arrival
                    who = np.unique(np.asarray(metrics["order"])[invalid])
                else:
                    who = np.flatnonzero(invalid)
                (private if client_level else entry)["invalid_clients"] = who.tolist()
        if metrics["rejected_round"]:
            entry["rejected_round"] = True
        failed = np.flatnonzero(np.asarray(metrics["failed"])).tolist()
        if failed:
            entry["failed"] = failed
            if "failed_coordinates" in metrics:  # where the failed updates were not finite (post-processing)
                entry["failed_sites"] = self.adapter.sites_of(np.asarray(metrics["failed_coordinates"]))
        if "low_rank_truncation" in metrics:  # computed from q: public
            entry["low_rank_truncation"] = float(metrics["low_rank_truncation"])
        if "order" in metrics and self.schedule == "asynchronous":
            entry["arrivals"] = np.asarray(metrics["order"]).tolist()
        return entry, private

    def save_checkpoint(self, path, state: PVIState, history: list, private_history: list,
                        hmac_key: bytes | None = None) -> None:
        """Write the **private** checkpoint: the whole state (secret key included), the ledger, the
        public and private histories and a keyed fingerprint of the clients' data. Never publish it."""
        meta = {"kind": "DPPVICheckpoint", "format": CHECKPOINT_FORMAT, "seed": self.seed,
                "result": self._result(state, history).public_meta(), "private_history": private_history,
                "settings": self.settings(), "fingerprint": keys.keyed_fingerprint(state.key, self.clients)}
        checkpoints.save(path, state, meta, hmac_key=hmac_key, private=True)

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
        if int(rounds) != rounds or rounds < 0:
            raise ValueError(f"rounds must be a non-negative integer, got {rounds!r}")
        if state is None:
            state = self.init(rng_key, clients)
        else:
            if self.adapter is None:
                raise RuntimeError("resume through fit_dppvi(..., resume=path), or call init first")
            if self.privacy is not None:
                if ledger is None:
                    raise ValueError("resuming a private fit needs its ledger so spent budget is kept")
                self.ledger = ledger
        history = list(history or [])
        private_history = list(private_history or [])
        eval_arrays = None if eval_data is None else self.adapter.validate_data(eval_data, "eval_data")
        eval_key = None if eval_data is None else jax.random.fold_in(jax.random.wrap_key_data(state.key), 0x5EED)
        limits = self.limits(state, rounds)
        if self.plan is not None and int(rounds) > 0 and int(state.round) > 0:
            able = np.asarray(state.active) & (np.asarray(limits) > np.asarray(state.participations))
            if not able.any():
                raise ValueError(
                    f"{self.caller}: every client's budget is spent after round {int(state.round)} (the noise was "
                    f"calibrated to {self.planned_rounds} planned rounds), so {int(rounds)} more round(s) would release "
                    "nothing and change nothing: the checkpoint's result is final. More rounds need a new fit planned "
                    "for them (rounds=..., its noise calibrated to them), whose budget adds to this one's on the same data")
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
                raise FitDiverged(str(exc), self._result(state, history)) from exc
            jax.block_until_ready(state.q)
            entry, private = self._public_entry(state, metrics, time.perf_counter() - start)
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
            if stop_when_converged and int(state.round) >= MIN_ROUNDS and self._convergence(trajectory, history)["converged"]:
                break
        self.convergence = self._convergence(trajectory, history)
        result = self._result(state, history)
        self._check_updates(result, history)
        if rounds:
            diagnostics.warn_if_unconverged(self.convergence, self.caller,
                                            *convergence_advice(self.caller, self.schedule, self.family,
                                                                private=self.plan is not None))
        return result

    def _convergence(self, trajectory, history: list) -> dict:
        """:func:`diagnostics.convergence` of the last states, with the sites of drifting coordinates and of
        the updates that failed over the last ``2 * WINDOW`` rounds: a fit whose updates failed there is not
        converged, whatever q's steps say (a dropped update does not move q)."""
        summary = diagnostics.convergence(list(trajectory),
                                          max_jitter=diagnostics.MAX_JITTER_SD if self.plan is None else None)
        summary["drifting_sites"] = self.adapter.sites_of(summary.pop("drifting_coordinates"))
        recent = history[-2 * diagnostics.WINDOW:]
        summary["failed_updates"] = sum(len(entry.get("failed", [])) for entry in recent)
        failed_sites = set().union(*(entry.get("failed_sites", []) for entry in recent))
        summary["failed_sites"] = [site.name for site in self.adapter.sites if site.name in failed_sites]
        if summary["failed_updates"]:
            summary["converged"] = False
        return summary

    def _check_updates(self, result: DPPVIResult, history: list) -> None:
        """Raise :class:`NoValidUpdates` when no client ever produced a valid update (``q`` is the
        prior), warn (:class:`~numpyro_dppvi.diagnostics.ClientUpdateWarning`) naming the clients that
        took part but never updated; both are recorded in ``result.updates`` (per client: rounds taken
        part, valid updates). Client-level DP: the client sample is private (publishing who took part
        would void the subsampling amplification), so nothing is counted, warned or raised from it and
        ``result.updates`` stays ``None``."""
        if self.privacy_unit == "client":
            return
        taken, valid = np.zeros(self.num_clients, int), np.zeros(self.num_clients, int)
        for entry in history:
            part = entry.get("participated")
            if part is None:
                continue
            part = np.asarray(part) > 0
            ok = part.copy()
            ok[entry.get("failed", [])] = False
            if entry.get("rejected_round"):
                ok[:] = False
            ok[entry.get("invalid_clients", [])] = False
            taken += part
            valid += ok
        result.updates = {"taken_part": taken.tolist(), "valid": valid.tolist()}
        never = np.flatnonzero((taken > 0) & (valid == 0)).tolist()
        if never and len(never) == int(np.sum(taken > 0)):
            count = f"{int(taken.sum())} update(s), "
            raise NoValidUpdates(
                f"{self.caller}: no client produced a valid update in {len(history)} round(s) ({count}every one "
                "non-finite or rejected), so q is still the prior. The local objective is "
                "probably non-finite where the prior puts mass (e.g. a gradient that overflows or a log of a "
                f"negative number); check the model at prior draws, or {ADVICE[self.caller]}. err.result holds "
                "the unrefined result.", result)
        if never:
            warnings.warn(f"{self.caller}: client(s) {never[:20]} took part but never produced a valid update "
                          "(non-finite or rejected every time): their data is not in q. result.updates has the "
                          f"counts; {ADVICE[self.caller]}.", diagnostics.ClientUpdateWarning,
                          stacklevel=diagnostics.user_stacklevel())
        failed_rounds = [entry for entry in history if entry.get("failed")]
        recent = self.convergence["failed_updates"] if self.convergence else 0
        total = sum(len(entry["failed"]) for entry in failed_rounds)
        if total and (recent or total > FAILED_UPDATES_TOLERATED * int(taken.sum())):
            sites = [s.name for s in self.adapter.sites
                     if any(s.name in entry.get("failed_sites", []) for entry in failed_rounds)]
            where = f" (not finite on site(s) {', '.join(repr(n) for n in sites)})" if sites else ""
            warnings.warn(
                f"{self.caller}: {total} of {int(taken.sum())} client updates failed{where} in {len(failed_rounds)} of "
                f"{len(history)} round(s), {recent} of them in the last {min(len(history), 2 * diagnostics.WINDOW)}; a "
                "failed update is dropped, so q lacks those clients' data where it failed and the fit is not "
                "converged. The local objective is not finite where q puts mass: check the model at draws of q "
                f"for {', '.join(repr(n) for n in sites) or 'those sites'} (e.g. an exp that overflows or a log of a "
                f"non-positive value), or {ADVICE[self.caller]}. result.updates and the history's 'failed' have "
                "the counts.", diagnostics.ClientUpdateWarning, stacklevel=diagnostics.user_stacklevel())

    def resume(self, path, clients, rounds: int, hmac_key: bytes | None = None, rng_key=None,
               **run_options) -> DPPVIResult:
        """Continue the fit saved in the private checkpoint ``path`` until ``rounds`` rounds in total.

        Refuses a checkpoint whose settings (method, schedule, shards, clip, relation, sampling,
        accountant, delta, noise multiplier, ...) differ from this driver's, or whose data
        fingerprint does not match ``clients``. The fit continues with the checkpoint's own key;
        ``rng_key``, if given, must be that key.
        """
        arrays, meta = checkpoints.load(path, hmac_key=hmac_key)
        if meta.get("kind") != "DPPVICheckpoint" or meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not a DPPVI private checkpoint (format {CHECKPOINT_FORMAT}); a published "
                             "result cannot be resumed (it holds no state)")
        saved = meta["settings"]
        if saved.get("planned_rounds") is not None and self.planned_rounds != saved["planned_rounds"]:
            self.planned_rounds = saved["planned_rounds"]  # the noise was calibrated for the original plan
        key_data = to_device(arrays[".key"], np.uint32)
        if rng_key is not None and not np.array_equal(np.asarray(keys.key_data(rng_key)), np.asarray(key_data)):
            raise ValueError(f"rng_key differs from the key of the fit saved in {path}; a resumed fit continues "
                             "with its own key: drop rng_key")
        template = self._init(key_data, meta.get("seed", "unspecified"), clients)
        mine = self.settings()
        changed = [name for name in RESUME_SETTINGS
                   if _json(mine.get(name)) != _json(saved.get(name, SAVED_BEFORE.get(name)))]
        if changed:
            detail = "; ".join(f"{n}: saved {saved.get(n)!r}, now {mine.get(n)!r}" for n in changed)
            raise ValueError(f"{path} was fitted with other settings, so its ledger would count the wrong releases; "
                             f"resume with exactly the saved settings ({detail})")
        ledger = None
        saved_result = meta["result"]
        if self.privacy is not None:
            if saved_result.get("privacy") is None:
                raise ValueError(f"{path} holds a non-private fit; it cannot be resumed with privacy")
            ledger = PrivacyLedger.from_dict(saved_result["privacy"])
            expected = self.privacy.ledger(self.num_clients, self.trusted_aggregator, seed=ledger.seed,
                                           charges=self.plan.charges(self.planned_rounds))
            for name in ("delta", "neighbouring", "accountant", "trusted_aggregator", "num_clients"):
                if getattr(ledger, name) != getattr(expected, name):
                    raise ValueError(f"{path}: the stored ledger has {name}={getattr(ledger, name)!r} but this fit "
                                     f"uses {getattr(expected, name)!r}; resume with the saved privacy settings")
        if keys.keyed_fingerprint(key_data, self.clients) != meta["fingerprint"]:
            raise ValueError(f"{path} was fitted on other client data; resume it with the same clients in the same order")
        state = checkpoints.unflatten_like(template, arrays)
        done = int(state.round)
        if done > rounds:
            raise ValueError(f"{path} already ran {done} rounds, more than rounds={rounds}")
        return self.run(None, clients, rounds - done, state=state, history=saved_result["history"], ledger=ledger,
                        private_history=meta["private_history"], hmac_key=hmac_key, **run_options)


def _json(value):
    """Normalise a settings value for comparison (tuples vs lists, ints vs floats)."""
    return json.dumps(value, sort_keys=True, default=str)


def fit_dppvi(model, clients, *, method: str = "pvi", schedule: str | None = None, rounds: int | None = None,
              local_steps: int | None = None, batch_size: int | None = None, num_samples: int = 10,
              optimizer: optax.GradientTransformation | None = None, damping: float | None = None,
              rng_key=None, eval_data=None, callback=None, progress: bool = False,
              server_steps: int = 50, privacy=None, checkpoint=None, resume=None, hmac_key: bytes | None = None,
              track_epsilon: bool = False, **options) -> DPPVIResult:
    """Fit a NumPyro model to federated ``clients`` with (DP-)PVI; the one-call form of :class:`DPPVI`.

    ``method="dp_optimisation"`` with ``privacy=Privacy(epsilon=..., delta=..., clip=...)`` calibrates
    the noise so that every client's releases over ``rounds`` rounds meet the budget; the result's
    ``privacy`` ledger reports what was spent. ``options`` are the remaining :class:`DPPVI` arguments
    (``shards``, ``invalid``, ``precision_floor``, ``trusted_aggregator``, ``privacy_unit``, ``client_rate``,
    ``tail_average``, ``family``, ``rank``).

    Defaults (:data:`METHOD_DEFAULTS`): ``schedule`` sequential for ``"pvi"`` and ``"dp_optimisation"``,
    synchronous otherwise; ``rounds=None``: non-private fits run until ``q`` has converged (checked
    from round :data:`MIN_ROUNDS`, at most :data:`MAX_ROUNDS`; ``result.rounds`` says how many ran),
    private ones 10 rounds (their noise is calibrated to the planned rounds).

    ``rng_key``: leave it out for a private fit. The fit then draws its key from the operating system
    and the noise cannot be recomputed by anyone. A key you pass makes the fit reproducible, and the
    guarantee then rests on that key staying secret (the ledger records which kind of seed was used).

    ``checkpoint=path`` writes a **private checkpoint** after every round (it holds the secret key and
    the clients' private states; never publish it); ``resume=path`` continues it, with the same model,
    clients and settings, up to ``rounds`` rounds in total, with its privacy ledger: a resumed fit
    gives the same result as an uninterrupted one and never re-spends or forgets budget. Publish
    ``result.save(path)``, which holds only differentially private outputs. ``hmac_key`` (bytes)
    authenticates the checkpoint so that a tampered one is refused.

    ``numpyro_dppvi.fit_dppvi`` also takes ``method="vips"`` (federated VIPS, :mod:`numpyro_dppvi.fit`).
    """
    unknown = set(options) - {"shards", "invalid", "precision_floor", "trusted_aggregator", "privacy_unit",
                              "client_rate", "tail_average", "family", "rank"}
    if unknown:
        hint = " (a privacy budget goes in privacy=dppvi.Privacy(epsilon=..., delta=...))" if unknown & {
            "epsilon", "delta", "clip", "noise_multiplier"} else ""
        raise TypeError(f"fit_dppvi() got unexpected option(s) {sorted(unknown)}{hint}")
    until_converged = False
    if rounds is None:
        rounds = METHOD_DEFAULTS.get(method, {}).get("rounds", DEFAULT_ROUNDS)
        if rounds is None and privacy is None:  # non-private: until q has converged
            until_converged = True
        elif rounds is None:
            rounds = DEFAULT_ROUNDS
    driver = DPPVI(model, method=method, schedule=schedule, optimizer=optimizer, local_steps=local_steps,
                   batch_size=batch_size, num_samples=num_samples, damping=damping, server_steps=server_steps,
                   privacy=privacy, rounds=None if until_converged else rounds, **options)
    driver.caller = "fit_dppvi"
    rounds = MAX_ROUNDS if until_converged else rounds
    if resume is not None:
        return driver.resume(resume, clients, rounds, hmac_key=hmac_key, rng_key=rng_key, eval_data=eval_data,
                             callback=callback, progress=progress, checkpoint=checkpoint, track_epsilon=track_epsilon,
                             stop_when_converged=until_converged)
    return driver.run(rng_key, clients, rounds, eval_data=eval_data, callback=callback, progress=progress,
                      checkpoint=checkpoint, hmac_key=hmac_key, track_epsilon=track_epsilon,
                      stop_when_converged=until_converged)
