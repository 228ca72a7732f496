"""One client's local update, built from the pieces ``fit_dppvi`` uses (nothing new is accounted).

* the model adapter (:func:`numpyro_dppvi.pvi.plan.model_adapter`, traced on the client's own rows);
* the privacy plan (:func:`numpyro_dppvi.pvi.privacy_plan.dp_sgd_plan` for this client alone: DP
  optimisation calibrates each client to its own sampling rate ``q_m = b / n_m``, so a client that
  knows only its own size calibrates exactly as ``fit_dppvi`` calibrates it among all clients);
* the local rule (:func:`numpyro_dppvi.pvi.plan.local_rule`, the simulation's, from the node's settings as one
  :class:`~numpyro_dppvi.pvi.fit_settings.FitSettings` resolved as ``fit_dppvi`` resolves it);
* the update of ``pvi.server``: cavity ``q / t_m``, ``q_new = rule.update(q, cavity, ...)`` on the
  client's unpadded rows, and the damped change ``delta = rho (eta(q_new) - eta(q))``, zero when
  ``q_new`` is not finite (post-processing of the client's releases, as in ``server.arrivals``).

Keys: a deployed client draws key ``k`` of its life as ``fold_in(seed, k)`` from its secret seed
(:func:`noise_key`). For tests, :func:`simulated_fit_key` derives the key ``fit_dppvi`` gives client
``m`` in round ``r`` (``fold_in(split(fold_in(fit_key, r), 3)[2], m)``, ``pvi.server.round_key``),
so that the in-process grid can reproduce a simulated fit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import importlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import checkpoint, factors, objectives
from ..program_cache import cached, jit
from ..data import validate_clients
from ..factors import Gaussian
from ..model_adapter import ModelAdapter
from ..privacy import Privacy
from ..privacy.ledger import extra_mass
from ..privacy.noise import float32_at_least
from ..pvi.plan import local_rule, model_adapter
from ..optim import Newton, PrivateNewton, cvi
from ..pvi import low_rank
from ..pvi.local import DPOptimisation, releases_pairs
from ..pvi.privacy_plan import PrivacyPlan, dp_sgd_plan
from .settings import LocalSettings, NodeSettings, SettingsError


def load_model(reference: str) -> Callable:
    """The NumPyro model ``"package.module:function"`` from this machine's installed code."""
    module_name, _, attribute = reference.partition(":")
    try:
        model = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise SettingsError(f"model {reference!r} cannot be imported here ({exc}); install the package that defines "
                            "it, or name an importable 'package.module:function'") from exc
    if not callable(model):
        raise SettingsError(f"model {reference!r} is not a function")
    return model


def load_data(node: NodeSettings) -> tuple[np.ndarray, ...]:
    """The node's data: the arrays ``data-arrays`` of ``data-file`` (``.npz``, read without pickle), checked
    as ``fit_dppvi`` checks a client (numeric, one row per individual), except for finiteness.

    A row holding NaN or inf is kept (the node's size, a public setting, does not change) and contributes
    nothing to a private release: its per-example gradient is not finite, and clipping zeroes such a
    term before the sum (:func:`~numpyro_dppvi.privacy.mechanisms.clipped_sum`), the rule every DP-SGD
    step applies to every record. Raising instead sent every message of the fit back as an unnoised
    "this node holds a non-finite record" (issue 24, finding 6). The count goes to the node's own log."""
    try:
        with np.load(node.data_file, allow_pickle=False) as f:
            missing = [name for name in node.data_arrays if name not in f.files]
            if missing:
                raise SettingsError(f"data-file {node.data_file} has no array(s) {missing} (it holds {f.files}); set "
                                    "data-arrays to its arrays in the model's argument order")
            arrays = tuple(f[name] for name in node.data_arrays)
    except FileNotFoundError as exc:
        raise SettingsError(f"data-file {node.data_file} does not exist; point data-file at the node's .npz data") from exc
    arrays = validate_clients([arrays], finite=False)[0]
    bad = sum(int(np.sum(~np.all(np.isfinite(a.reshape(len(a), -1)), axis=1)))
              for a in arrays if a.dtype.kind in "fc")
    if bad:
        logging.getLogger("numpyro_dppvi.flower.client").warning(
            "client %s: %d row(s) of %s hold NaN or inf; they contribute nothing to private releases (their "
            "gradients are zeroed by the clipping); impute or drop them in the data file", node.client_id, bad,
            node.data_file)
    return arrays


def adapter_for(model: Callable, arrays) -> ModelAdapter:
    """The model traced on the client's own rows (cached by model and row shapes, as in ``fit_dppvi``)."""
    adapter = model_adapter(model, [arrays])
    adapter.validate_data(arrays, "the node's data", finite=False)
    if adapter.has_server_factor:
        raise SettingsError("numpyro_dppvi.flower needs a model whose priors are Normal on real sites (no server-held "
                            "prior factor); reparametrise the other priors")
    return adapter


@functools.lru_cache(maxsize=None)
def optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
    """One optax object per setting, so equal rules share their compiled programs."""
    if name == "cvi":  # learning_rate: Adam's on the means (in posterior sds); the precision step is 0.5
        return cvi(mean_optimizer=optax.adam(learning_rate))
    if name == "newton":  # full-rank non-private PVI: learning_rate is the precision step
        return Newton(precision_step=learning_rate)
    if name == "private_newton":  # DP optimisation's default: learning_rate is the step towards the trace's answer
        return PrivateNewton(step=learning_rate)
    return {"adam": optax.adam, "sgd": optax.sgd}[name](learning_rate)


def privacy_of(node: NodeSettings, settings: LocalSettings, noise_multiplier: float | None = None) -> Privacy:
    """The client's :class:`Privacy`: its budget and units from the node config, the clip from the server."""
    return Privacy(epsilon=None if noise_multiplier is not None else node.epsilon, delta=node.delta,
                   clip=settings.clip, noise_multiplier=noise_multiplier, sampling=node.sampling,
                   neighbouring=node.neighbouring, accountant=node.accountant, adaptive_clip=None)


def calibrated_plan(node: NodeSettings, settings: LocalSettings, num_rows: int, dimension: int,
                    spent: tuple = ()) -> PrivacyPlan:
    """The plan of a new fit: noise calibrated so that the releases already in the client's ledger
    (``spent``) and ``planned_rounds`` participations of ``local_steps`` DP-SGD steps at rate
    ``q_m = b / n_m`` together meet the node's ``(epsilon, delta)``. With nothing spent this is
    ``fit_dppvi``'s calibration of this client (``PrivacyPlan.calibrate``). Raises ``ValueError``
    when no noise can meet the budget (it is spent)."""
    plan = pinned_plan(node, settings, num_rows, dimension, 1.0)  # the rate, overflow and chunk of this client
    plan.privacy = privacy_of(node, settings)
    # the node's ledger keeps the fixed share of delta for the charges of every fit on its data
    plan.privacy.accounting_delta(extra_mass(list(spent) + [plan.event(0, settings.planned_rounds, 1.0)]), fixed_reserve=True)
    if not spent:
        plan.calibrate(settings.planned_rounds)
        return plan
    z = plan.privacy.resolve(lambda z: list(spent) + [plan.event(0, settings.planned_rounds, z)])
    plan.noise_multipliers = np.asarray([z])
    return plan


def pinned_plan(node: NodeSettings, settings: LocalSettings, num_rows: int, dimension: int,
                noise_multiplier: float) -> PrivacyPlan:
    """The plan of a fit under way, with the noise multiplier fixed at its first step (no calibration)."""
    return dp_sgd_plan(privacy_of(node, settings, noise_multiplier), [num_rows], settings.batch_size,
                       settings.local_steps, settings.planned_rounds, dimension, budget_epsilon=node.epsilon)


def make_rule(method: str, adapter: ModelAdapter, settings: LocalSettings, plan: PrivacyPlan | None):
    """The local rule ``fit_dppvi`` runs for ``method`` with these settings: the node's settings as one
    :class:`~numpyro_dppvi.pvi.fit_settings.FitSettings` (:meth:`LocalSettings.fit_settings`, with the plan's
    privacy: the node's clip and sampler), resolved and completed by the model as the simulation's are, and built by
    the simulation's own :func:`~numpyro_dppvi.pvi.plan.local_rule`."""
    settings.check_method(method)
    resolved = settings.fit_settings(method, None if plan is None else plan.privacy).resolve().for_model(adapter.dim)
    resolved = dataclasses.replace(resolved, rank=settings.resolved_rank(adapter.dim) or None)
    return local_rule(resolved, adapter, plan)


def noise_dimension(settings: LocalSettings, dim: int) -> int:
    """The noise coordinates of one DP-SGD release (its ledger event's ``dimension``), as ``fit_dppvi`` counts
    them (:func:`~numpyro_dppvi.objectives.release_dimension`): the scaled variational gradient's for an optax step of
    a mean-field ``q``, else the pair release's (:func:`~numpyro_dppvi.pvi.local.releases_pairs`)."""
    pair = releases_pairs(optimizer(settings.optimizer, float(settings.learning_rate)), settings.family)
    return objectives.release_dimension(dim, settings.num_samples, pair)


def initial_rule_state(rule, plan: PrivacyPlan | None, arrays, mask, key):
    """The rule's client state at the start of a fit (``DPPVI._init`` for one client: the rule's own
    state, plus the noise std and sampling rate of a DP-SGD plan)."""
    state = rule.init_client_state(arrays, mask, key)
    if plan is None:
        return state
    extras = {"noise_std": float32_at_least(plan.noise_std(0)), "rate": np.asarray(plan.rates, np.float32)[0]}
    return dict(state, **extras) if isinstance(state, dict) else extras


def rule_state_from(template, leaves: list):
    """The rule state saved as ``leaves`` (tree order), checked leaf by leaf against ``template``. A state saved
    before the entries of ``DPOptimisation.ADDED_STATE`` existed lacks them (the other leaves keep their order):
    they start at zero, and the node logs it."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(template)[0]]
    older = [path for path in paths if getattr(path[-1], "key", None) not in DPOptimisation.ADDED_STATE]
    if len(leaves) not in (len(paths), len(older)):
        raise ValueError(f"the saved client state has {len(leaves)} arrays, the fit's rule expects {len(paths)}")
    saved = paths if len(leaves) == len(paths) else older
    named = {jax.tree_util.keystr(path): leaf for path, leaf in zip(saved, leaves)}
    named, filled = checkpoint.with_added_leaves(template, named, DPOptimisation.ADDED_STATE)
    if filled:
        logging.getLogger("numpyro_dppvi.flower.client").warning(
            "this client's state was saved by an older version without %s: they start at zero", ", ".join(filled))
    return checkpoint.unflatten_like(template, named)


def rule_state_leaves(rule_state) -> list:
    """The leaves of a rule state as NumPy arrays, in tree order: what the client's state file keeps
    (``ClientState.rule_leaves``, :mod:`~numpyro_dppvi.flower.client_store`) and :func:`rule_state_from` reads back."""
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(rule_state)]


def noise_key(seed, exchange: int) -> jax.Array:
    """Key number ``exchange`` of a deployed client: ``fold_in(seed, exchange)`` (never reused)."""
    return jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(seed, jnp.uint32)), int(exchange))


def simulated_fit_key(fit_key_data, round_index: int, client_index: int) -> jax.Array:
    """TEST ONLY: the key ``fit_dppvi`` (sequential or synchronous) hands client ``client_index`` in round
    ``round_index`` (0-based), ``fold_in(split(fold_in(fit_key, r), 3)[2], m)`` (``pvi.server.round_key``;
    the arrival ``i`` of client ``m`` is ``m`` in both schedules)."""
    round_key = jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(fit_key_data, jnp.uint32)), round_index)
    _, _, k_clients = jax.random.split(round_key, 3)
    return jax.random.fold_in(k_clients, client_index)


def _update(rule, damping: float, q: Gaussian, t_m: Gaussian, arrays, mask, n, key, rule_state):
    cavity = factors.divide(q, t_m)
    q_new, new_state, metrics = rule.update(q, cavity, arrays, mask, n, key, rule_state)
    finite = jnp.all(factors.finite_coordinates(q_new))
    if factors.is_low_rank(q):  # in the answer's basis [B, E] (pvi.server.arrivals: the server widens B by E)
        delta = low_rank.changes(q, q_new, finite, damping)
    else:
        delta = Gaussian(*(jnp.where(finite, damping * (new - old), 0.0) for new, old in zip(q_new, q)))
    kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, rule_state)
    return delta, kept, metrics["loss"], finite


def run_update(rule, damping: float, q: Gaussian, t_m: Gaussian, arrays, key, rule_state, size: int | None = None):
    """``(delta, rule_state, loss, finite)`` of one local update on the client's own (unpadded) rows,
    jitted once per rule and damping; ``size``: the public size the objective is scaled by (default the
    number of rows; :meth:`~numpyro_dppvi.flower.settings.NodeSettings.size_of`)."""
    program = cached(("flower-local-update", rule, float(damping)),
                     lambda: jit(functools.partial(_update, rule, float(damping))))
    arrays = tuple(jnp.asarray(a) for a in arrays)
    n = arrays[0].shape[0]
    mask = jnp.ones(n, bool)
    as32 = lambda g: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
    delta, rule_state, loss, finite = program(as32(q), as32(t_m), arrays, mask, jnp.float32(n if size is None else size),
                                              key, rule_state)
    return jax.tree.map(np.asarray, delta), rule_state, float(loss), bool(finite)
