"""Empirical privacy audit: a statistical lower bound on epsilon from a distinguishing attack.

Run ``mechanism(key, D)`` and ``mechanism(key, D')`` many times on a neighbouring pair, reduce
each output to a scalar statistic, and guess "D" when the statistic exceeds a threshold. If the
mechanism is ``(epsilon, delta)``-DP, every test's false positive rate ``a`` and false negative
rate ``b`` satisfy ``a + e^epsilon b >= 1 - delta`` and ``b + e^epsilon a >= 1 - delta``
(Kairouz, Oh, Viswanath 2015), hence

    epsilon >= max(log((1 - delta - b) / a), log((1 - delta - a) / b)).

With one-sided Clopper-Pearson upper bounds ``a_ub``, ``b_ub`` at level ``(1 - confidence) / 2``
each (Bonferroni), plugging them in gives a lower bound on epsilon that holds with probability
``>= confidence`` (Jagielski, Ullman, Oprea 2020; Nasr et al. 2021). The statistic's direction
and the threshold are chosen on one half of the runs and the rates counted on the other half,
so the selection does not bias the bound.

An audit passes if the lower bound does not exceed the ledger's epsilon. A lower bound above it
proves (at the stated confidence) that the implementation is less private than claimed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from ..program_cache import jit


@dataclass(frozen=True)
class AuditResult:
    """What :func:`audit` found.

    Attributes:
      epsilon_lower_bound: the lower bound on epsilon that holds with probability ``confidence``;
        above the ledger's epsilon it proves the mechanism less private than claimed.
      false_positive_rate: the chosen test's rate of guessing ``dataset`` on runs of ``neighbour``, on the
        evaluation half.
      false_negative_rate: its rate of guessing ``neighbour`` on runs of ``dataset``, on the evaluation half.
      threshold: the statistic's threshold chosen on the selection half.
      runs_per_dataset: runs of the mechanism on each of the two data sets.
      delta: the delta of the audited claim.
      confidence: the probability with which the bound holds.
    """

    epsilon_lower_bound: float
    false_positive_rate: float
    false_negative_rate: float
    threshold: float
    runs_per_dataset: int
    delta: float
    confidence: float


def clopper_pearson_upper(failures: int, trials: int, alpha: float) -> float:
    """One-sided ``1 - alpha`` Clopper-Pearson upper bound on a binomial rate.

    Args:
      failures: the number of events counted, in ``[0, trials]``.
      trials: the number of trials, at least 1.
      alpha: the bound's error probability, in (0, 1).
    """
    if trials < 1 or not 0 <= failures <= trials:
        raise ValueError(f"need 0 <= failures <= trials and trials >= 1, got {failures}/{trials}.")
    if failures == trials:
        return 1.0
    return float(stats.beta.ppf(1.0 - alpha, failures + 1, trials - failures))


def epsilon_lower_bound(false_positives: int, negatives: int, false_negatives: int,
                        positives: int, delta: float, confidence: float = 0.95) -> float:
    """Lower bound on epsilon (>= 0) from error counts, valid with probability ``confidence``.

    Args:
      false_positives: runs on the neighbour the test took for the data set.
      negatives: the runs on the neighbour.
      false_negatives: runs on the data set the test took for the neighbour.
      positives: the runs on the data set.
      delta: the delta of the audited claim, in [0, 1).
      confidence: the probability with which the bound holds, in (0, 1); each rate's Clopper-Pearson bound
        is taken at level ``(1 - confidence) / 2``. Default 0.95.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}.")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must lie in [0, 1), got {delta}.")
    alpha = (1.0 - confidence) / 2.0
    a = clopper_pearson_upper(false_positives, negatives, alpha)
    b = clopper_pearson_upper(false_negatives, positives, alpha)
    best = 0.0
    for numerator, denominator in ((1.0 - delta - b, a), (1.0 - delta - a, b)):
        if numerator > 0 and denominator > 0:
            best = max(best, math.log(numerator / denominator))
    return best


def _cp_upper_array(failures, trials, alpha):
    failures = np.asarray(failures)
    safe = np.minimum(failures, trials - 1)
    bound = stats.beta.ppf(1.0 - alpha, safe + 1, trials - safe)
    return np.where(failures >= trials, 1.0, bound)


def _lower_bounds_for_thresholds(stat_pos, stat_neg, thresholds, delta, confidence):
    """Bound for each threshold of the test "D if statistic > t" (vectorised over thresholds;
    same formula as :func:`epsilon_lower_bound`)."""
    pos = np.sort(stat_pos)
    neg = np.sort(stat_neg)
    false_neg = np.searchsorted(pos, thresholds, side="right")  # D runs with stat <= t
    false_pos = neg.size - np.searchsorted(neg, thresholds, side="right")
    alpha = (1.0 - confidence) / 2.0
    a = _cp_upper_array(false_pos, neg.size, alpha)
    b = _cp_upper_array(false_neg, pos.size, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.where((1 - delta - b > 0) & (a > 0), np.log((1 - delta - b) / a), 0.0)
        second = np.where((1 - delta - a > 0) & (b > 0), np.log((1 - delta - a) / b), 0.0)
    return np.maximum(np.maximum(first, second), 0.0)


def _batched(mechanism):
    return jit(jax.vmap(mechanism, in_axes=(0, None)))


def _run(batched, key, dataset, num_runs, chunk):
    chunk = min(chunk, num_runs)
    padded = -(-num_runs // chunk) * chunk
    keys = jax.random.split(key, padded)
    outputs = []
    for start in range(0, padded, chunk):
        out = batched(keys[start:start + chunk], dataset)
        leaves = [jnp.reshape(leaf, (leaf.shape[0], -1)) for leaf in jax.tree_util.tree_leaves(out)]
        outputs.append(np.asarray(jnp.concatenate(leaves, axis=1), dtype=np.float64))
    return np.concatenate(outputs, axis=0)[:num_runs]


def audit(
    mechanism: Callable,
    dataset,
    neighbour,
    key,
    delta: float,
    num_runs: int = 20000,
    statistic: Callable[[np.ndarray], np.ndarray] | None = None,
    confidence: float = 0.95,
    num_thresholds: int = 256,
) -> AuditResult:
    """Distinguishing audit of ``mechanism`` on the neighbouring pair ``(dataset, neighbour)``.

    Args:
      mechanism: ``mechanism(key, data) -> array or pytree``, jit- and vmap-able (static shapes:
        pad and mask to express add/remove neighbours).
      dataset: one data set of the neighbouring pair, ideally worst case for the mechanism.
      neighbour: its neighbour (one record added, removed or replaced), of the same shapes.
      key: PRNG key; runs on ``dataset`` and ``neighbour`` use independent sub-keys.
      delta: the delta of the claim being audited.
      num_runs: runs per dataset (half choose the test, half evaluate it).
      statistic: ``outputs [r, d] -> [r]``; default: projection on the difference of the mean
        outputs of the two datasets divided by the per-coordinate variance, both estimated on
        the selection half (the likelihood-ratio test for Gaussian noise on a sum).
      confidence: probability with which the returned bound holds.
      num_thresholds: the candidate thresholds of the test, quantiles of the selection half's statistics.

    Returns:
      :class:`AuditResult` with the lower bound and the evaluation-half error rates.
    """
    if num_runs < 100:
        raise ValueError(f"num_runs must be >= 100 for a meaningful audit, got {num_runs}.")
    key_pos, key_neg = jax.random.split(key)
    batched = _batched(mechanism)
    out_pos = _run(batched, key_pos, dataset, num_runs, 16384)
    out_neg = _run(batched, key_neg, neighbour, num_runs, 16384)
    half = num_runs // 2
    sel_pos, ev_pos = out_pos[:half], out_pos[half:]
    sel_neg, ev_neg = out_neg[:half], out_neg[half:]
    if statistic is None:
        # Fisher discriminant with diagonal covariance: the likelihood-ratio statistic for
        # Gaussian noise of possibly different scales per coordinate
        variance = 0.5 * (sel_pos.var(axis=0) + sel_neg.var(axis=0))
        direction = (sel_pos.mean(axis=0) - sel_neg.mean(axis=0)) / np.maximum(variance, 1e-300)
        if not np.any(direction):
            direction = np.ones_like(direction)

        def statistic(outputs):
            return outputs @ direction

    s_sel_pos, s_sel_neg = np.asarray(statistic(sel_pos)), np.asarray(statistic(sel_neg))
    pooled = np.concatenate([s_sel_pos, s_sel_neg])
    thresholds = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, num_thresholds)))
    bounds = _lower_bounds_for_thresholds(s_sel_pos, s_sel_neg, thresholds, delta, confidence)
    threshold = float(thresholds[int(np.argmax(bounds))])
    s_ev_pos, s_ev_neg = np.asarray(statistic(ev_pos)), np.asarray(statistic(ev_neg))
    false_negatives = int(np.sum(s_ev_pos <= threshold))
    false_positives = int(np.sum(s_ev_neg > threshold))
    bound = epsilon_lower_bound(false_positives, s_ev_neg.size, false_negatives, s_ev_pos.size,
                                delta, confidence)
    return AuditResult(
        epsilon_lower_bound=bound,
        false_positive_rate=false_positives / s_ev_neg.size,
        false_negative_rate=false_negatives / s_ev_pos.size,
        threshold=threshold,
        runs_per_dataset=num_runs,
        delta=float(delta),
        confidence=float(confidence),
    )
