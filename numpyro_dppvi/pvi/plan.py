"""What a fit's settings make: the local rule, the privacy plan, the compiled round and its key.

``DPPVI`` (:mod:`.driver`) turns its settings into a :class:`RoundSpec` (the static part of a round, the
key of its compiled program: two fits with equal specs share one program), the local rule of its method
(:func:`privacy_plan_and_rule`), the server-factor step (:func:`server_factor_step`) and, for a private
fit, the privacy plan (:mod:`.privacy_plan`) with its warning when the calibrated noise swamps the
signal (:func:`warn_if_noise_swamps`). The functions here are pure over pytrees or read the driver's
settings; the driver holds the state.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import diagnostics, factors, objectives
from ..factors import Gaussian
from ..model_adapter import ModelAdapter
from ..optim import Newton
from ..privacy.adaptive_clip import adaptive_clip_init
from ..privacy.noise import float32_at_least
from ..persistent_cache import ExportedProgram
from ..program_cache import cached, jit, shapes, to_device
from . import full_rank, release_noise, server
from .defaults import UPDATE_METHODS
from .full_rank import NonPrivateFullRank, ServerFactorStepFullRank, client_batch, lapack_safe_chunk
from .local import DPOptimisation, NonPrivate, ServerFactorStep, releases_pairs
from .low_rank import NonPrivateLowRank, ServerFactorStepLowRank
from .privacy_plan import client_level_plan, dp_sgd_plan, shard_update_plan
from .server import PVIState
from .shards import ROWS
from .update_perturbation import LocalAveraging, VirtualClients, trusted_aggregator_round


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


def round_step(spec: RoundSpec, state: PVIState, data, mask, sizes, limits, server_noise_std):
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
    """``jit(round)`` for ``spec``, built once per spec in the process (:mod:`numpyro_dppvi.program_cache`) and kept
    across processes when the persistent cache is on (:class:`~numpyro_dppvi.persistent_cache.ExportedProgram`)."""
    key = ("pvi-round", spec)
    return cached(key, lambda: ExportedProgram(jit(functools.partial(round_step, spec)), key, "round_step"))


def initial_state(rule, server_step, num_clients, data, mask, key_data, prior, server_mask, extras) -> PVIState:
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


def local_posteriors(rule, priors, data, mask, sizes, client_state, key):
    """Every client's local update once, from its own prior: ``rule.update`` with start and cavity
    ``priors[m]`` on client ``m``'s data, key ``fold_in(key, m)``, vmapped over the clients; returns the
    stacked ``q_m`` (``[M, ...]``). Pure; jitted by ``DPPVI.local_posteriors``, which charges the releases."""
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(sizes.shape[0]))
    q_m, _, _ = full_rank.map_clients(rule.update, (priors, priors, data, mask, sizes, keys, client_state), priors)
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
    data of the same row shapes and dtypes (:mod:`numpyro_dppvi.program_cache`)."""
    rows = trace_rows(clients)
    key = ("adapter", model, shapes(tuple(a[:1] for a in rows)), getattr(model, "_dppvi_privacy_plate", None))

    def build():
        adapter = ModelAdapter(model, rows)
        adapter.persistent_key = key  # what it was built from, for the programs' persistent digest
        return adapter

    return cached(key, build)



def privacy_plan_and_rule(driver, sizes, dimension: int, calibrate: bool = True):
    """``(plan, rule)`` of a fit with ``driver``'s settings: the privacy plan of its method (None for a
    non-private fit; :mod:`.privacy_plan`), from the clients' public ``sizes`` and the ``dimension`` of one
    release, and the local rule it runs (:func:`local_rule`). ``calibrate=False``: the plan's noise is left for the
    caller to calibrate (``plan.calibrate(rounds)``; the rule does not depend on it)."""
    p, plan = driver.privacy, None
    if driver.method == "dp_optimisation":
        plan = dp_sgd_plan(p, sizes, driver.batch_size, driver.local_steps, driver.planned_rounds, dimension,
                           calibrate)
    elif driver.method in UPDATE_METHODS:
        plan = None if p is None else shard_update_plan(p, driver.num_clients, driver.planned_rounds, dimension,
                                                        one_record_per_shard=driver.shards == ROWS,
                                                        calibrate=calibrate)
    elif driver.privacy_unit == "client":
        plan = client_level_plan(p, driver.num_clients, driver.planned_rounds, driver.client_rate, dimension,
                                 calibrate)
    return plan, local_rule(driver, driver.adapter, plan, num_clients=driver.num_clients)


def local_rule(settings, adapter: ModelAdapter, plan, num_clients: int = 1):
    """The local rule (:mod:`.local`, :mod:`.full_rank`, :mod:`.low_rank`, :mod:`.update_perturbation`) that
    ``settings`` run on ``adapter``'s model: one function for the simulation (``DPPVI``, whose attributes are the
    settings) and the Flower nodes (a :class:`~.fit_settings.ResolvedSettings` completed by the model,
    :func:`numpyro_dppvi.flower.local_update.make_rule`), so that the same settings make the same rule on one
    machine and across many. ``settings`` has :class:`~.fit_settings.ResolvedSettings`' fields (``rank`` resolved
    for a low-rank family; ``privacy`` the clip and sampling); ``plan`` is the fit's privacy plan (None without
    one); ``num_clients`` sizes the full-rank shard chunk of the update-perturbation methods."""
    a, s = adapter, settings
    p = s.privacy
    if s.method == "dp_optimisation":
        return DPOptimisation(a.log_lik_rows, a.dim, s.optimizer, s.local_steps, s.batch_size, s.num_samples,
                              log_lik_row=a.log_lik_row_blocks, clip=p.clip, sampling=p.sampling,
                              max_batch=plan.max_batch, blocks=a.site_sizes, chunk=plan.chunk,
                              row_sampler=plan.row_sampler, average=s.tail_average, family=s.family,
                              rank=s.rank or 0, damping=s.damping, average_from=(s.planned_rounds or 1) // 2,
                              noise_aware=s.noise_aware)
    if s.method in UPDATE_METHODS:
        cls = VirtualClients if s.method == "virtual_clients" else LocalAveraging
        return cls(a.log_lik_rows, a.dim, s.optimizer, s.local_steps, s.num_samples,
                   clip=None if p is None else p.clip, damping=s.damping, invalid=s.invalid,
                   precision_floor=s.precision_floor, family=s.family, rank=s.rank or 0,
                   shard_chunk=lapack_safe_chunk(a.dim, client_batch(a.dim, num_clients))
                   if s.family in ("full_rank", "low_rank") else None)
    cls = {"full_rank": NonPrivateFullRank, "low_rank": NonPrivateLowRank}.get(s.family, NonPrivate)
    extra = {"rank": s.rank} if s.family == "low_rank" else {}
    return cls(a.log_lik_rows, a.dim, s.optimizer, s.local_steps, s.batch_size, s.num_samples,
               average=s.tail_average, **extra)


def server_factor_step(driver):
    """The step refining the server-held prior factor (priors that are not Normal), or None: Newton steps
    for the full-rank and low-rank families, the driver's optimiser on ``(loc, log_scale)`` otherwise."""
    a = driver.adapter
    if not a.has_server_factor:
        return None
    server_mask = tuple(bool(b) for b in np.asarray(a.server_mask))
    if driver.family in ("full_rank", "low_rank"):
        newton = driver.optimizer if isinstance(driver.optimizer, Newton) else Newton()
        cls = ServerFactorStepLowRank if driver.family == "low_rank" else ServerFactorStepFullRank
        return cls(a.server_log_density, server_mask, driver.server_steps, driver.num_samples, newton.precision_step)
    return ServerFactorStep(a.server_log_density, server_mask, driver.optimizer, driver.server_steps,
                            driver.num_samples)


def signal_terms(driver, plan) -> np.ndarray:
    """Per client: clipped contributions summed in one release (see :func:`diagnostics.noise_to_signal`)."""
    if plan.kind == "dp_sgd":
        return plan.rates * driver.public_sizes
    if plan.kind == "shard_update":
        return np.asarray(driver.num_shards, np.float64)
    return np.full(driver.num_clients, driver.client_rate * driver.num_clients)


def noise_to_signal(driver, plan) -> np.ndarray:
    """``[M]``: per client, the expected norm of one release's noise under ``plan`` over the largest norm of
    its signal (:func:`numpyro_dppvi.diagnostics.noise_to_signal`, with :func:`signal_terms`)."""
    noise = np.array([plan.noise_std(m) for m in range(driver.num_clients)])
    return diagnostics.noise_to_signal(noise, plan.dimension, signal_terms(driver, plan), driver.privacy.clip)


def warn_if_noise_swamps(driver) -> None:
    """Warn (:class:`~numpyro_dppvi.diagnostics.NoiseWarning`) before fitting when one release's noise
    is larger than any signal it can carry, with settings that would bring it to half of that."""
    ratio = noise_to_signal(driver, driver.plan)
    if float(ratio.max()) <= diagnostics.NOISE_SWAMPS:
        return
    worst = int(np.argmax(ratio))
    what = {"dp_sgd": f"a batch of {driver.plan.rates[worst] * driver.public_sizes[worst]:.0f} clipped gradients",
            "shard_update": f"{signal_terms(driver, driver.plan)[worst]:.0f} clipped shard change(s)",
            "client": "the clipped client changes"}[driver.plan.kind]
    warnings.warn(
        f"{driver.caller}: the calibrated noise swamps the signal: noise multiplier "
        f"{driver.plan.noise_multipliers[worst]:.3g}, so one release's noise has norm {ratio[worst]:.2g} times "
        f"the largest norm of {what} (client {worst}, {driver.plan.dimension} noise coordinates). "
        f"{noise_advice(driver)}", diagnostics.NoiseWarning, stacklevel=diagnostics.user_stacklevel())


def noise_advice(driver) -> str:
    """Fewer releases for the same budget (calibrated noise only): the first halving of the local steps
    (then of the rounds) that brings every client's ratio to ``NOISE_SWAMPS / 2``."""
    p = driver.privacy
    if p.epsilon is None:
        return "A smaller noise_multiplier (it costs more epsilon), a larger batch or more data per client would help."
    steps, rounds = driver.plan.steps_per_participation, driver.planned_rounds or 1
    for _ in range(8):
        if steps > 1:
            steps = max(steps // 2, 1)
        elif rounds > 1:
            rounds = max(rounds // 2, 1)
        else:
            break
        trial = dataclasses.replace(driver.plan, steps_per_participation=steps, noise_multipliers=None)
        trial.calibrate(rounds)
        if float(noise_to_signal(driver, trial).max()) <= diagnostics.NOISE_SWAMPS / 2:
            if driver.caller == "fit_global_vi":
                fewer = f"steps={rounds * steps} with steps_per_round={steps}"
            elif driver.plan.kind == "dp_sgd":
                fewer = f"rounds={rounds} with local_steps={steps}"
            else:
                fewer = f"rounds={rounds}"
            return (f"For epsilon={p.epsilon:g}, {fewer} would bring it to half the signal; more data per "
                    "client or a larger epsilon would too.")
    return f"No number of rounds brings it below the signal at epsilon={p.epsilon:g}: use a larger epsilon or more data per client."


def adaptive_clip_state(driver, plan) -> dict:
    """Per-client adaptive clipping state, starting at ``Privacy.clip`` (stacked over clients), with
    ``plan``'s noise."""
    p, settings = driver.privacy, driver.privacy.adaptive_clip
    states = [adaptive_clip_init(p.clip, float(driver.batch_size), p.count_noise_std(float(z)),
                                 settings.target_quantile, settings.learning_rate, settings.noise_scaled_rate,
                                 settings.fraction_noise)
              for z in plan.noise_multipliers]
    return {"clip": jax.tree.map(lambda *xs: to_device(np.stack(xs), np.float32), *states),
            "noise_per_clip": to_device(float32_at_least([p.gradient_noise_std(float(z), clip=1.0)
                                                          for z in plan.noise_multipliers]), np.float32)}


def initial_extras(driver, plan) -> dict:
    """Per-client settings the rule reads from its state, with ``plan``'s noise (NumPy: the programs take
    them as inputs, so that a placeholder plan of the same shape compiles the same programs)."""
    m = driver.num_clients
    extras = {}
    if driver.method in UPDATE_METHODS:
        extras.update(ids=np.asarray(driver.shard_ids), num_shards=np.asarray(driver.num_shards, np.float32),
                      noise_std=np.zeros(m, np.float32))
    if driver.method == "virtual_clients":
        extras[release_noise.KEY] = np.zeros(m, np.float32)
        dim = driver.adapter.dim
        if driver.family in ("mean_field", "full_rank"):  # the releases' centres (pvi.release_noise, eqs. 1, 3)
            extras[release_noise.CENTRE_KEYS[0]] = np.zeros((m, dim), np.float32)
            second = (dim, dim) if driver.family == "full_rank" else (dim,)
            extras[release_noise.CENTRE_KEYS[1]] = np.zeros((m,) + second, np.float32)
    if plan is not None and plan.kind != "client":
        extras["noise_std"] = float32_at_least([plan.noise_std(j) for j in range(m)])
    if plan is not None and plan.kind == "dp_sgd":
        extras["rate"] = np.asarray(plan.rates, np.float32)
    if driver.privacy is not None and driver.privacy.adaptive_clip is not None:
        extras.update(adaptive_clip_state(driver, plan))
    return extras


def release_dimension(driver) -> int:
    """Noise coordinates of one release of ``driver``'s fit (its model traced): a change of ``(eta1, eta2)`` (``2 D``,
    ``D (D + 3) / 2``, ...), or DP-SGD's pair release, ``2 P D``, or an optax step's scaled variational gradient of
    a mean-field ``q``, ``2 D`` (:func:`~numpyro_dppvi.objectives.release_dimension`)."""
    dim = driver.adapter.dim
    if driver.method == "dp_optimisation":
        return objectives.release_dimension(dim, driver.num_samples, releases_pairs(driver.optimizer, driver.family))
    return factors.num_coordinates(dim, driver.family, driver.rank or 0)
