"""Plots of what is particular to a private federated fit (matplotlib, an optional extra: ``pip install
numpyro_dppvi[examples]``).

ArviZ's conventions: each function takes a result (or several), draws on ``ax`` (a new figure's axes when
omitted) and returns the axes. Everything drawn is public: the history, the ledger and the results' configs
(what a saved result holds).

* :func:`plot_epsilon`: each client's epsilon against the rounds, recomputed from the ledger and the history;
* :func:`plot_convergence`: the history's ``change`` (the largest step of ``q`` in posterior sds) per round;
* :func:`plot_privacy_utility`: a metric of the last round (e.g. test ``accuracy``, with ``eval_data``) against
  the ledger's epsilon, over fits at several budgets;
* :func:`plot_calibration_check`: the coverage a :func:`~numpyro_dppvi.calibration_check` found, per level and site;
* :func:`plot_calibration`: the coverage of the true values by the posteriors' central credible intervals against
  their level (:func:`interval_coverage`), over fits to data sets simulated from known values (the check of
  ``benchmarks/coverage.py``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np

from .privacy import backends
from .privacy.events import merge_events


def _axes(ax):
    if ax is not None:
        return ax
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError("numpyro_dppvi.plots needs matplotlib: pip install 'numpyro_dppvi[examples]'") from exc
    return plt.subplots()[1]


def participations_per_round(result) -> np.ndarray:
    """``[rounds, M]`` int: how many participations each client had been charged by the end of each round.

    From the history's ``participated`` flags; a client-level fit publishes none (its client sample is private)
    and charges every client every round (each may have been sampled). An asynchronous round lists its
    ``arrivals`` (a client may arrive more than once), and an arrival past a client's budget is not charged: each
    client's participations are its ledger releases over the releases of one participation (all releases over all
    ``communications``), and the arrivals are charged in order up to them.

    Args:
      result: a private fit's :class:`~numpyro_dppvi.DPPVIResult` (its history and ledger).
    """
    ledger = result.privacy
    m = ledger.num_clients
    if not result.history:
        return np.zeros((0, m), np.int64)
    if "arrivals" in result.history[0]:
        releases = np.array([ledger.num_releases(j) for j in range(m)])
        per_participation = releases.sum() / max(int(result.history[-1]["communications"]), 1)
        allowed = np.rint(releases / per_participation).astype(np.int64)
        charged, rows = np.zeros(m, np.int64), []
        for entry in result.history:
            for j in np.asarray(entry["arrivals"], np.int64).reshape(-1):
                if charged[j] < allowed[j]:
                    charged[j] += 1
            rows.append(charged.copy())
        return np.stack(rows)
    rows = [np.asarray(entry["participated"], np.int64).reshape(-1) if "participated" in entry
            else np.ones(m, np.int64) for entry in result.history]
    return np.cumsum(np.stack(rows), axis=0)


def epsilon_per_round(result) -> np.ndarray:
    """``[rounds, M]``: each client's epsilon (at the ledger's delta, with its accountant) after each round.

    A client's ``K`` participations charge its merged events equally (each participation is the plan's event),
    so after ``k`` of them its events are the ledger's with every count scaled by ``k / K``; the last row equals
    :attr:`~numpyro_dppvi.privacy.PrivacyLedger.epsilon_per_client`. Raises when the counts do not split evenly
    (a ledger not written by one fit's rounds).

    Args:
      result: a private fit's :class:`~numpyro_dppvi.DPPVIResult` (its history and ledger); a non-private one
        raises.
    """
    ledger = result.privacy
    if not ledger:
        raise ValueError("the result has no privacy ledger (a non-private fit): there is no epsilon to plot")
    counts = participations_per_round(result)
    out = np.zeros(counts.shape, np.float64)
    memo: dict = {}
    for m in range(ledger.num_clients):
        events = ledger.events(m)
        total = int(counts[-1, m]) if len(counts) else 0
        if not events:
            continue
        if total == 0:
            raise ValueError(f"client {m} has releases in the ledger but no participation in the history")
        for r, k in enumerate(counts[:, m]):
            scaled = []
            for e in events:
                if (e.count * int(k)) % total:
                    raise ValueError(f"client {m}'s {e.count} releases do not split over its {total} participations")
                if k:
                    scaled.append(e.with_count(e.count * int(k) // total))
            key = tuple(sorted(e.mechanism + (e.count,) for e in scaled))
            if key not in memo:
                memo[key] = 0.0 if not scaled else backends.epsilon(
                    merge_events(scaled), ledger.delta, ledger.neighbouring, ledger.accountant)
            out[r, m] = memo[key]
    return out


def _clients_label(group: list[int]) -> str:
    """``client 3``, ``clients 0-4`` (a run of consecutive indices) or ``clients 0, 2, 5``."""
    if len(group) == 1:
        return f"client {group[0]}"
    if group == list(range(group[0], group[0] + len(group))):
        return f"clients {group[0]}-{group[-1]}"
    return "clients " + ", ".join(str(m) for m in group)


def plot_epsilon(result, ax=None, clients: Sequence[int] | None = None):
    """Each client's epsilon against the rounds (:func:`epsilon_per_round`), with the budget the fit was
    calibrated to (``config["privacy"]["epsilon"]``) as a dashed line.

    Args:
      result: a private fit's :class:`~numpyro_dppvi.DPPVIResult`.
      ax: the matplotlib axes to draw on; None (the default): a new figure's axes.
      clients: the indices of the clients to draw (default all); clients whose curves coincide share one line
        and one legend entry ("clients 0-4").

    Returns:
      the axes.
    """
    ax = _axes(ax)
    eps = epsilon_per_round(result)
    rounds = np.arange(1, eps.shape[0] + 1)
    groups: list[list[int]] = []
    for m in range(eps.shape[1]) if clients is None else clients:
        same = next((g for g in groups if np.array_equal(eps[:, g[0]], eps[:, m])), None)
        (same.append(m) if same is not None else groups.append([m]))
    for group in groups:
        ax.plot(rounds, eps[:, group[0]], marker=".", label=_clients_label(group))
    budget = ((result.config or {}).get("privacy") or {}).get("epsilon")
    if budget is not None:
        ax.axhline(budget, linestyle="--", color="grey", label=f"budget {budget:g}")
    ax.set_xlabel("round")
    ax.set_ylabel(f"epsilon (delta = {result.privacy.delta:.2g})")
    ax.legend(fontsize="small")
    return ax


def plot_convergence(results, ax=None, labels: Sequence[str] | None = None):
    """The history's ``change`` per round (the largest step of any coordinate of ``q``, in posterior sds; log
    scale) of one result or several, side by side.

    Args:
      results: a result, or a list or tuple of results, whose history records ``change`` (DP-PVI fits).
      ax: the matplotlib axes to draw on; None (the default): a new figure's axes.
      labels: one legend label per result. Default None: no legend.

    Returns:
      the axes.
    """
    ax = _axes(ax)
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    for i, result in enumerate(results):
        changes = [(e["round"], e["change"]) for e in result.history if e.get("change") is not None]
        if not changes:
            raise ValueError(f"result {i} has no per-round 'change' in its history (a one-round committee?)")
        rounds, values = zip(*changes)
        ax.plot(rounds, values, marker=".", label=None if labels is None else labels[i])
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("largest change of q (posterior sd)")
    if labels is not None:
        ax.legend(fontsize="small")
    return ax


def plot_privacy_utility(results, metric: str = "accuracy", ax=None, label: str | None = None):
    """A metric of each fit's last round (``history[-1][metric]``, e.g. ``accuracy`` or ``log_lik`` of fits run
    with ``eval_data``) against its ledger's epsilon, over fits at several budgets: the privacy/utility curve.

    Args:
      results: the private fits' results (an iterable), each with ``metric`` in its last history entry.
      metric: the history key to plot. Default ``"accuracy"``.
      ax: the matplotlib axes to draw on; None (the default): a new figure's axes.
      label: the curve's legend label. Default None: no legend.

    Returns:
      the axes.
    """
    ax = _axes(ax)
    points = []
    for i, result in enumerate(results):
        if not result.privacy:
            raise ValueError(f"result {i} is not private: its epsilon is not defined")
        if not result.history or metric not in result.history[-1]:
            raise ValueError(f"result {i}'s last round has no {metric!r}: fit with eval_data=... to record it")
        points.append((result.privacy.epsilon, result.history[-1][metric]))
    points.sort()
    ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("epsilon")
    ax.set_ylabel(metric)
    if label is not None:
        ax.legend(fontsize="small")
    return ax


#: Levels of the central credible intervals :func:`plot_calibration` checks by default.
LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def interval_coverage(results, truths: Sequence[Mapping], levels: Sequence[float] = LEVELS,
                      num_samples: int = 2000, rng_key=None) -> tuple[np.ndarray, np.ndarray]:
    """``(coverage, se)``, each ``[L]``: at each level ``a`` of ``levels``, the share of the true values inside the
    central ``a`` credible interval of their marginal posterior (the ``(1 - a) / 2`` and ``(1 + a) / 2`` quantiles
    of ``num_samples`` draws of ``result.sample``), averaged over the results, and its standard error over them.

    ``truths[i]`` maps site names of ``results[i]`` to the values the data set was simulated from (every
    coordinate of those sites is counted). A calibrated posterior covers about ``a`` at every level; the
    coordinates of one fit are not independent, so the se is taken across the fits (as in
    ``benchmarks/coverage.py``). Works for any result with ``sample`` (DP-PVI, VIPS, VFL).

    Args:
      results: the fits, one per simulated data set.
      truths: one mapping per result, from site names to the true values.
      levels: the credible levels, each strictly between 0 and 1. Default :data:`LEVELS`.
      num_samples: the draws of each posterior the quantiles are taken from.
      rng_key: a ``jax.random`` key, folded in per result; None (the default): fresh draws each call.
    """
    results, truths = list(results), list(truths)
    if len(results) != len(truths) or not results:
        raise ValueError(f"give one truth per result ({len(results)} results, {len(truths)} truths), at least one")
    levels = np.asarray(levels, np.float64)
    if np.any((levels <= 0) | (levels >= 1)):
        raise ValueError(f"levels must lie strictly between 0 and 1, got {levels.tolist()}")
    per_fit = []
    for i, (result, truth) in enumerate(zip(results, truths)):
        key = None if rng_key is None else jax.random.fold_in(rng_key, i)
        draws = result.sample(num_samples, key)
        inside = []
        for site, value in truth.items():
            if site not in draws:
                raise ValueError(f"result {i} has no site {site!r} (its sites: {sorted(draws)})")
            samples = np.asarray(draws[site], np.float64).reshape(num_samples, -1)
            value = np.broadcast_to(np.asarray(value, np.float64), np.shape(draws[site])[1:]).reshape(-1)
            lo = np.quantile(samples, (1.0 - levels) / 2.0, axis=0)
            hi = np.quantile(samples, (1.0 + levels) / 2.0, axis=0)
            inside.append((lo <= value) & (value <= hi))  # [L, coordinates]
        per_fit.append(np.concatenate(inside, axis=1).mean(axis=1))
    per_fit = np.stack(per_fit)
    se = per_fit.std(axis=0, ddof=1) / np.sqrt(len(per_fit)) if len(per_fit) > 1 else np.full(len(levels), np.nan)
    return per_fit.mean(axis=0), se


def plot_calibration(results, truths: Sequence[Mapping], levels: Sequence[float] = LEVELS, ax=None,
                     label: str | None = None, num_samples: int = 2000, rng_key=None):
    """The empirical coverage of :func:`interval_coverage` against the nominal level, with two standard errors as
    error bars and the diagonal a calibrated posterior follows (below it: over-confident intervals, as a private
    fit whose ``q`` leaves out the DP noise; above it: too wide).

    Args:
      results: the fits, one per simulated data set (as :func:`interval_coverage`).
      truths: one mapping per result, from site names to the true values.
      levels: the credible levels. Default :data:`LEVELS`.
      ax: the matplotlib axes to draw on; None (the default): a new figure's axes.
      label: the curve's legend label. Default None: no legend.
      num_samples: the draws of each posterior the quantiles are taken from.
      rng_key: a ``jax.random`` key; None (the default): fresh draws each call.

    Returns:
      the axes.
    """
    ax = _axes(ax)
    coverage, se = interval_coverage(results, truths, levels, num_samples, rng_key)
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey")
    ax.errorbar(np.asarray(levels), coverage, yerr=2.0 * se, marker="o", capsize=2, label=label)
    ax.set_xlabel("credible level")
    ax.set_ylabel("coverage of the true values")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    if label is not None:
        ax.legend(fontsize="small")
    return ax


def plot_calibration_check(report, ax=None, sites: Sequence[str] | None = None,
                           levels: Sequence[float] = LEVELS):
    """The coverage a :class:`~numpyro_dppvi.simulation_calibration.CalibrationReport` found, against the nominal
    level: pooled over every site (with two Monte Carlo standard errors) and, for each of ``sites``, per site; the
    diagonal is what a calibrated posterior follows (below it: intervals too narrow).

    Args:
      report: the :class:`~numpyro_dppvi.CalibrationReport` of :func:`~numpyro_dppvi.calibration_check`.
      ax: the matplotlib axes to draw on; None (the default): a new figure's axes.
      sites: the site names drawn one by one beside the pooled coverage. Default None: the pooled coverage
        only.
      levels: the credible levels. Default :data:`LEVELS`.

    Returns:
      the axes.
    """
    ax = _axes(ax)
    levels = np.asarray(levels, np.float64)
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey")
    for site in [None, *(sites or [])]:
        pairs = np.array([report.coverage(a, site) for a in levels])
        label = f"all sites ({report.num_datasets} data sets)" if site is None else site
        ax.errorbar(levels, pairs[:, 0], yerr=2.0 * pairs[:, 1], marker="o", capsize=2, label=label)
    ax.set_xlabel("credible level")
    ax.set_ylabel("coverage of the true values")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    return ax
