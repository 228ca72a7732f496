"""Baselines of the DP-PVI paper (Heikkila et al. 2023, §5): global VI and Bayesian committee machines.

* Global VI: VI on the pooled data, as if a trusted server held every row. It is PVI with one client
  holding everything; each optimiser step needs one exchange with every client (gradients on their
  data), so a step counts as ``M`` communications. With ``privacy``: DP-SGD on the pooled data at
  rate ``batch_size / n`` (a trusted aggregator sums the clients' clipped gradients and adds the noise
  once); every row takes part in every step's sampling, so every client's ledger row carries the
  same events.
* BCM (Tresp 2000), one round: every client fits ``q_k`` to its own data from a local prior, and the
  server combines them. ``prior="same"``: local prior ``p``, ``eta_q = sum_k eta_qk - (K - 1) eta_p``.
  ``prior="split"``: local prior ``p^(n_k / n)``, ``eta_q = sum_k eta_qk``.
  With ``privacy``: each client trains by DP-SGD for ``local_steps`` steps, once.
  The combination is post-processing of the clients' DP releases; it can be improper on a coordinate
  the data barely inform (``K - 1`` prior precisions are subtracted from ``K`` noisy ones). Rule
  ``invalid="prior"`` (default): a coordinate whose combined precision is below the prior's falls back
  to the prior on that coordinate (a likelihood approximation cannot make ``q`` less certain than the
  prior), and the fit counts and reports the coordinates (``history[0]["reset_to_prior"]``, a
  warning). ``invalid="raise"``: ``q`` as combined, a ValueError if it is improper.
"""

from __future__ import annotations

import dataclasses
import functools

import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import factors
from ..data import validate_clients
from ..diagnostics import PosteriorRuleWarning, user_stacklevel
from ..evaluation import evaluate
from ..privacy.ledger import PrivacyLedger
from ..program_cache import cached, jit
from ..results import DPPVIResult
from . import low_rank, plan
from .driver import DPPVI


def fit_global_vi(model, clients, *, steps: int = 1000, steps_per_round: int = 100, batch_size: int | None = 100,
                  num_samples: int = 10, optimizer: optax.GradientTransformation | None = None, rng_key=None,
                  eval_data=None, progress: bool = False, privacy=None, family: str = "mean_field",
                  rank: int | None = None, noise_aware: bool | None = None) -> DPPVIResult:
    """VI (``privacy=None``) or DP-SGD VI on the pooled data of ``clients``; history every ``steps_per_round`` steps.

    Args:
      model: a NumPyro model taking the data arrays positionally (``@dppvi.model`` optional).
      clients: one tuple of arrays per client, e.g. ``[(x_1, y_1), (x_2, y_2)]``; their rows are pooled.
      steps: optimiser steps on the pooled data in all, a multiple of ``steps_per_round``; a private fit's noise
        is calibrated to them.
      steps_per_round: steps between two history entries (each entry counts one exchange with every client per
        step as communications).
      batch_size: rows per step (None: every pooled row). With ``privacy``: the expected Poisson batch, sampling
        rate ``batch_size / n`` over the pooled rows.
      num_samples: Monte Carlo draws of ``q`` per step, shared across the batch.
      optimizer: the step: an optax ``GradientTransformation``, ``optim.Newton`` or ``optim.PrivateNewton``. None:
        as in :class:`~numpyro_dppvi.DPPVI`: without privacy ``optim.cvi()`` (mean-field) or ``optim.Newton()``
        (full-rank, low-rank); with privacy ``optim.PrivateNewton()`` for a mean-field or full-rank ``q`` of up to
        :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent dimensions (``noise_aware`` not False), else
        ``adam(1e-2)``.
      rng_key: the fit's key; None draws it from the operating system (see :func:`~numpyro_dppvi.fit_dppvi`).
      eval_data: held-out rows (a tuple of the model's arrays with the observations) evaluated in every history
        entry, as in :func:`~numpyro_dppvi.fit_dppvi`. Default None.
      progress: show a progress bar. Default False.
      privacy: a :class:`~numpyro_dppvi.privacy.Privacy` for DP-SGD on the pooled data, as if a trusted aggregator
        summed the clients' clipped gradients and added the noise once; every client's ledger row carries the
        same events. Per-client ``public_sizes`` are summed into one bound for the pool. None: not private.
      family: ``"mean_field"`` (default) or ``"full_rank"`` (private or not; see :class:`~numpyro_dppvi.DPPVI`), or
        ``"low_rank"`` with ``rank`` (private or not).
      rank: the rank of ``family="low_rank"`` (default ``round(sqrt(D))``).
      noise_aware: as in :func:`~numpyro_dppvi.fit_dppvi` (private fits with a mean-field or full-rank ``q``:
        the pooled data are one client whose releases the noise-aware step reads). Default None: wherever
        available.

    Returns:
      a :class:`~numpyro_dppvi.DPPVIResult` (method ``"global_vi"`` or ``"dp_global_vi"``).
    """
    clients = validate_clients(clients)
    if steps % steps_per_round:
        raise ValueError(f"fit_global_vi: steps ({steps}) must be a multiple of steps_per_round ({steps_per_round})")
    pooled = tuple(np.concatenate(parts) for parts in zip(*clients))
    rounds = steps // steps_per_round
    if privacy is not None and isinstance(privacy.public_sizes, tuple):  # one bound per client: the pool's is their sum
        if len(privacy.public_sizes) != len(clients):
            raise ValueError(f"fit_global_vi: Privacy(public_sizes=...) has {len(privacy.public_sizes)} values for "
                             f"{len(clients)} client(s); give one bound per client, or one int for the pooled data.")
        privacy = dataclasses.replace(privacy, public_sizes=sum(privacy.public_sizes))
    driver = DPPVI(model, method="pvi" if privacy is None else "dp_optimisation", schedule="sequential",
                   optimizer=optimizer, local_steps=steps_per_round, batch_size=batch_size, num_samples=num_samples,
                   damping=1.0, privacy=privacy, rounds=rounds, family=family, rank=rank, noise_aware=noise_aware)
    driver.caller = "fit_global_vi"
    pooled_result = driver.run(rng_key, [pooled], rounds, eval_data=eval_data, progress=progress)
    history = [dict(entry, communications=entry["round"] * steps_per_round * len(clients),
                    participated=[True] * len(clients)) for entry in pooled_result.history]
    ledger = None
    if privacy is not None:  # every row was in every step's sampling: each client carries the pooled events
        pooled = pooled_result.privacy  # its delta is the pooled plan's (charges taken out of the requested one)
        ledger = PrivacyLedger(len(clients), pooled.delta, privacy.neighbouring, privacy.accountant, seed=pooled.seed,
                               sizes=pooled.sizes)
        for event in pooled_result.privacy.events(0):
            ledger.record_all(event)
    config = dict(pooled_result.config, steps=steps, steps_per_round=steps_per_round)
    return DPPVIResult(pooled_result.adapter, pooled_result.q, history, "global_vi" if privacy is None else "dp_global_vi",
                       None, ledger, config, pooled_result.rounds, convergence=pooled_result.convergence,
                       q_fitted=pooled_result.q_fitted, calibration=pooled_result.calibration)


def fit_bcm(model, clients, *, prior: str = "same", local_steps: int = 1000, batch_size: int | None = 100,
            num_samples: int = 10, optimizer: optax.GradientTransformation | None = None, rng_key=None,
            eval_data=None, privacy=None, invalid: str = "prior", family: str = "mean_field",
            rank: int | None = None) -> DPPVIResult:
    """Bayesian committee machine in one round (``prior="same" | "split"``), optionally with DP-SGD training.

    Every client fits ``q_k`` to its own data, once, from a local prior, and the server combines them.

    Args:
      model: a NumPyro model taking the data arrays positionally (``@dppvi.model`` optional).
      clients: one tuple of arrays per client, e.g. ``[(x_1, y_1), (x_2, y_2)]``.
      prior: the local prior: ``"same"`` (the default: the prior ``p``; ``eta_q = sum_k eta_qk - (K - 1) eta_p``)
        or ``"split"`` (``p^(n_k / n)``; ``eta_q = sum_k eta_qk``).
      local_steps: optimiser steps of each client's local fit.
      batch_size: rows per step (None: the client's whole data). With ``privacy``: the expected Poisson batch of
        each DP-SGD step.
      num_samples: Monte Carlo draws of ``q`` per step, shared across the batch.
      optimizer: the local step. None: without privacy ``optim.cvi()`` (mean-field) or ``optim.Newton()``
        (full-rank, low-rank); with privacy ``adam(1e-2)``.
      rng_key: the fit's key; None draws it from the operating system (see :func:`~numpyro_dppvi.fit_dppvi`).
      eval_data: held-out rows (a tuple of the model's arrays with the observations), evaluated once in the
        history's one entry. Default None.
      privacy: a :class:`~numpyro_dppvi.privacy.Privacy`: each client trains by DP-SGD for ``local_steps`` steps,
        once; the combination is post-processing of the releases. None: not private.
      invalid: ``"prior"`` (default) resets coordinates whose combined precision falls below the prior's to the
        prior (counted in ``history[0]["reset_to_prior"]``, with a warning); ``"raise"`` raises instead.
      family: ``"mean_field"`` (default), ``"full_rank"`` or ``"low_rank"`` with ``rank`` (private or not; the
        low-rank committee is widened by every client's directions and truncated to rank ``r``,
        :func:`~numpyro_dppvi.pvi.baselines.low_rank_committee`); with ``"full_rank"`` or ``"low_rank"`` a
        combined precision that is not positive definite raises (the reset rule is per coordinate, which a full
        precision matrix does not have).
      rank: the rank of ``family="low_rank"`` (default ``round(sqrt(D))``).

    Returns:
      a :class:`~numpyro_dppvi.DPPVIResult` (method ``"bcm_same"`` or ``"bcm_split"``).
    """
    if prior not in ("same", "split"):
        raise ValueError(f"fit_bcm: prior must be 'same' or 'split', got {prior!r}")
    if invalid not in ("prior", "raise"):
        raise ValueError(f"fit_bcm: invalid must be 'prior' or 'raise', got {invalid!r}")
    driver = DPPVI(model, method="pvi" if privacy is None else "dp_optimisation", schedule="synchronous",
                   optimizer=optimizer, local_steps=local_steps, batch_size=batch_size, num_samples=num_samples,
                   damping=1.0, privacy=privacy, rounds=1, family=family, rank=rank, noise_aware=False)
    driver.caller = "fit_bcm"
    start = time.perf_counter()
    state = driver.init(rng_key, clients)
    q0 = state.q  # prior (times the server's prior factor for non-Gaussian priors)
    sizes = np.asarray(driver.public_sizes, np.float32)
    weights = sizes / sizes.sum() if prior == "split" else np.ones_like(sizes)
    local_priors = jax.vmap(lambda w: factors.scale(q0, w))(jnp.asarray(weights, jnp.float32))
    q_k = local_posteriors(driver, state, local_priors)
    if factors.is_low_rank(q0):
        q = low_rank_committee(q0, local_priors, q_k, driver.rank)
    else:
        t_k = factors.divide(q_k, local_priors)  # each client's factor
        q = factors.multiply(q0, factors.product(t_k))
    q, reset = reset_to_prior(q, q0, invalid)
    num_clients = len(sizes)
    entry = {"round": 1, "communications": num_clients, "participated": [True] * num_clients,
             "reset_to_prior": reset}
    if privacy is None:  # a private fit's time follows its secret batch sizes (issue 24, finding 7)
        entry["seconds"] = time.perf_counter() - start
    if eval_data is not None:
        arrays = driver.adapter.validate_data(eval_data, "fit_bcm eval_data")
        entry.update(evaluate(driver.adapter, q, arrays, jax.random.fold_in(jax.random.wrap_key_data(state.key), 0x5EED)))
    return DPPVIResult(driver.adapter, q, [entry], method=f"bcm_{prior}", schedule=None, privacy=driver.ledger,
                       config=dict(driver.settings(), prior=prior), rounds=1)


def low_rank_committee(q0, local_priors, q_k, rank: int):
    """``q0 * prod_k (q_k / p_k)`` for low-rank Gaussians: each client's posterior ``q_k`` comes in its own basis
    ``[B, V_k]`` (:func:`~numpyro_dppvi.pvi.low_rank.answer`), so its factor ``q_k / p_k`` is taken there (``p_k``
    padded into it, exact), ``B`` is widened by every ``V_k``, the factors are added and the sum is truncated to
    rank ``r`` as a PVI round's is (:func:`~numpyro_dppvi.pvi.low_rank.truncate_tree`, keeping the mean of the
    untruncated product)."""
    t_k = factors.divide(q_k, low_rank.in_basis_of(local_priors, q_k))
    wide = low_rank.widened_basis(q0.eta2.basis, t_k.eta2.basis)
    q0, t_k = low_rank.rebase_tree((q0, t_k), wide)
    q = factors.multiply(q0, factors.product(t_k))
    return low_rank.truncate_tree(q, q, rank)[0]


#: Relative precision below the prior's that the reset rule ignores: float32 rounding of natural
#: parameters summed over clients. A coordinate the data do not inform (a scale whose only role is in the
#: server-held prior factor) combines to the prior's precision up to that rounding, and was reset.
PRIOR_TOLERANCE = 1e-4


def reset_to_prior(q, prior, invalid: str = "prior"):
    """``(q', count)``. ``invalid="prior"``: every coordinate whose precision ``-2 eta2`` is below the
    prior's (by more than :data:`PRIOR_TOLERANCE`, relative) is replaced by the prior's coordinate and
    counted. ``invalid="raise"``: ``q`` unchanged,
    a ValueError if it is improper. A non-finite ``q`` (a diverged local fit) raises under both rules:
    resetting it would return the prior as a posterior."""
    advice = "lower `local_steps` or the optimizer's learning rate"
    if factors.is_full_rank(q) or factors.is_low_rank(q):
        factors.check_proper(q, f"the {factors.family_of(q).replace('_', '-')} BCM posterior (fit_bcm)",
                             advice + ", or use family='mean_field'")
        return q, 0
    if invalid == "raise" or not (bool(jnp.all(jnp.isfinite(q.eta1))) and bool(jnp.all(jnp.isfinite(q.eta2)))):
        factors.check_proper(q, "the BCM posterior (fit_bcm)",
                             advice + ("" if invalid == "prior" else ", or pass invalid='prior'"))
        return q, 0
    below = q.eta2 > prior.eta2 * (1.0 - PRIOR_TOLERANCE)  # equal up to float rounding is not below
    count = int(jnp.sum(below))
    if count:
        warnings.warn(f"fit_bcm: {count} of {below.size} coordinates of the combined posterior had a precision "
                      "below the prior's (noisy or uninformative clients) and were reset to the prior "
                      "(invalid='prior'; history[0]['reset_to_prior'] counts them)", PosteriorRuleWarning,
                      stacklevel=user_stacklevel())
    return factors.Gaussian(*(jnp.where(below, p, a) for a, p in zip(q, prior))), count


def local_posteriors(driver, state, priors: factors.Gaussian) -> factors.Gaussian:
    """Every client's local update, once, from its own prior: ``q_m`` fitted with start and cavity
    ``priors[m]`` (``[M, D]``) on its own data (Bayesian committee machines). A private rule's
    releases are charged to the driver's ledger (one participation per client)."""
    program = cached(("pvi-local-posteriors", driver.rule), lambda: jit(functools.partial(
        plan.local_posteriors, driver.rule)))
    q_m = program(priors, driver.data, driver.mask, driver.sizes, state.client_state,
                  jax.random.fold_in(jax.random.wrap_key_data(state.key), 1))
    if driver.ledger is not None:
        for m in range(driver.num_clients):
            driver.ledger.record(m, driver.plan.event(m, 1))
    return q_m
