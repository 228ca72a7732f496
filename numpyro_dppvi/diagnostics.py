"""Fit diagnostics: how far a fit stopped from its fixed point, whether every client ever updated,
and whether the calibrated noise leaves a signal to learn from.

Convergence is measured on the unconstrained mean-field ``q = N(mu, diag(s^2))`` in posterior-sd
units. Round ``t`` moves coordinate ``i`` by

    d_{t,i} = (mu_{t,i} - mu_{t-1,i}) / s_{T,i}      (means)
    d_{t,i} = log s_{t,i} - log s_{t-1,i}            (log scales)

(the history's ``change`` is ``max_i |d_{t,i}|``). A fit with Monte Carlo local steps, or noise,
never stops moving, so a small change alone proves nothing and a large one may be jitter. Over the
last ``k = min(10, max(T // 2, 3))`` of the ``T`` steps seen (two windows from six steps on) a coordinate *drifts* when its mean step ``m_i`` is consistently signed,
``|m_i| > t * sd(d_i) / sqrt(k)`` with ``t`` the two-sided Student-t quantile at level
``0.05 / (2D)`` with ``k - 1`` degrees of freedom (a t-test per coordinate, Bonferroni-corrected over
the ``2D`` coordinates so that a fit whose steps are independent noise, e.g. the random walk of a
noisy DP fit, is flagged with probability at most 5%; jitter about a fixed point is anti-correlated
and passes less often still; a steady drift has a small ``sd`` and passes). For a drifting coordinate the rate ``r_i`` is the ratio of its mean
steps over the last two windows, ``(m_i / m'_i)^(1/k)``, or the rate inside the last window where that is
slower (:func:`rate_within`: a fast early transient makes the rate between windows too fast); if the steps shrink geometrically the last
one is ``c_i = k |m_i| / sum_{j<k} r_i^-j`` and the remaining distance ``c_i r_i / (1 - r_i)``
(infinite for ``r_i >= 1`` or a change of sign between the windows: the drift is not shrinking). The fit is *converged* when no coordinate's remaining distance exceeds
:data:`CONVERGED_SD`. With a single window (fewer than ``2k`` rounds) the remaining distance of a
drifting coordinate is only known to be at least ``|m_i|``: the fit is not converged when that
exceeds :data:`CONVERGED_SD`, undetermined (``None``) otherwise.

A private fit's steps carry its noise, and it has few rounds: from ``k = 5`` steps each coordinate's variance
has 4 df. Its drift test moderates the variances (:func:`moderated_variances`: each shrunk towards its group's,
the means' or the log scales', by an empirical Bayes estimate, Smyth 2004), which gives the t statistics more
df where the coordinates' noise is alike. Measured on mean-field virtual clients at their defaults (coverage study,
epsilon 8, 10,000 rows, 10 data sets, 10 rounds; the q each fit settles at from 60 rounds of the same noise):
of the 5 fits that ended 0.7-5.5 sd from it without a warning, 2 now warn (0.74 and 5.5 sd off); the other 3
(2.4-3.7 sd) stop where their steps reverse, after overshooting, and no test of the steps sees the distance. On
independent noise whose sds differ up to 2x between coordinates, 7-7.5% of 10-round fits are flagged (the
per-coordinate test: 4-6%). Steps correlated from round to round (AR(1) steps, correlation 0.3 / 0.5: a ``q``
that wanders rather than settles) are flagged in 31% / 64% of such fits (the per-coordinate test: 16% / 33%):
measured on the coverage study, DP optimisation with Adam steps and ``noise_aware=False`` at epsilon 8 /
10,000 rows, whose ``q`` jumps 1.5-2 sd a round and whose intervals cover .71, now warns in 15 of 50 fits (0
before).
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np
from scipy import special, stats

from . import factors

#: Largest estimated remaining movement (posterior sd) of any coordinate for a fit called converged.
CONVERGED_SD = 0.1
#: Largest sd of a non-private fit's round-to-round steps (posterior sd) for a fit called converged:
#: above it the final ``q`` is one point of an oscillation or of Monte Carlo noise that large.
MAX_JITTER_SD = 0.25
#: A fit is *far* from converged, and warns, when a coordinate's estimated remaining movement or the
#: round-to-round jitter exceeds this (posterior sd). Between CONVERGED_SD and FAR_SD a fit is reported
#: as not converged (``result.convergence``, ``summary()``) without a warning: its posterior means are
#: within half a posterior sd of the fixed point, accurate for practical use, and a warning on every
#: such fit would teach users to ignore the ones that matter.
FAR_SD = 0.5
#: Noise-to-signal ratio of one release above which the noise is said to swamp the signal.
NOISE_SWAMPS = 1.0
#: Ratio of a noise-aware posterior's sd to the sd without the DP noise above which a fit warns that the
#: noise dominates (pvi.noise_aware.widening): the noise then carries more than 3/4 of the variance.
NOISE_WIDENS = 2.0
#: Rounds per window of the drift test (two windows are compared for the rate).
WINDOW = 10
#: Family-wise false-alarm rate of the drift test over all coordinates.
FALSE_ALARM = 0.05


class NoiseWarning(UserWarning):
    """The calibrated noise of a private fit is larger than any signal a release can carry, or dominates
    the width of its noise-aware posterior."""


class ConvergenceWarning(UserWarning):
    """The fit stopped while ``q`` was still drifting."""


class ClientUpdateWarning(UserWarning):
    """Some client never produced a valid (finite, proper) update: its data is not in ``q``."""


class PosteriorRuleWarning(UserWarning):
    """A documented rule changed part of an invalid posterior (the history counts what it changed)."""


class CalibrationWarning(UserWarning):
    """A private fit cannot vouch for its credible intervals (``result.calibrated`` is False)."""


#: Every warning a fit gives about its own result (the command line reports them as notes).
FIT_WARNINGS = (ConvergenceWarning, NoiseWarning, ClientUpdateWarning, PosteriorRuleWarning, CalibrationWarning)

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the calling function point at the first frame
    outside this package: the user's line (``fit_dppvi(...)`` in a script or a notebook), however many of
    the package's own functions lie between (``warnings.warn(..., skip_file_prefixes=...)`` from Python 3.12)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def unconstrained_coordinates(q: factors.Gaussian) -> tuple[np.ndarray, np.ndarray]:
    """``(mu, log s)`` of ``q`` as float64 arrays: ``mu = -eta1 / (2 eta2)``, ``log s = -log(-2 eta2) / 2``;
    full-rank: ``mu = Lambda^{-1} eta1`` and the marginal ``log s = log diag(Lambda^{-1}) / 2`` (on the
    host, in numpy: no device program per call; low-rank: its dense form).

    Args:
      q: a Gaussian in natural parameters (mean-field, full-rank or low-rank), e.g. a result's ``q``.

    Returns:
      ``(mu, log s)``, each of the shape of ``q.eta1``; NaN for a full-rank ``q`` whose precision cannot be
      inverted.
    """
    eta1 = np.asarray(q.eta1, np.float64)
    if factors.is_low_rank(q):
        low = q.eta2
        basis = np.asarray(low.basis, np.float64)
        eta2 = np.diag(np.asarray(low.diag, np.float64)) + basis @ np.asarray(low.core, np.float64) @ basis.T
    else:
        eta2 = np.asarray(q.eta2, np.float64)
    if eta2.ndim == eta1.ndim + 1:
        try:
            covariance = np.linalg.inv(-2.0 * eta2)
        except np.linalg.LinAlgError:
            return np.full_like(eta1, np.nan), np.full_like(eta1, np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            return covariance @ eta1, 0.5 * np.log(np.diagonal(covariance, axis1=-2, axis2=-1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return -eta1 / (2.0 * eta2), -0.5 * np.log(-2.0 * eta2)


def steps_in_sd(trajectory: list) -> np.ndarray:
    """``[T-1, 2D]`` signed steps ``d_t`` of a trajectory of ``(mu, log s)`` pairs (module docstring),
    means scaled by the last round's ``s``."""
    locs = np.stack([mu for mu, _ in trajectory])
    log_scales = np.stack([ls for _, ls in trajectory])
    scale = np.exp(log_scales[-1])
    return np.concatenate([np.diff(locs, axis=0) / scale, np.diff(log_scales, axis=0)], axis=1)


def change(before: tuple, after: tuple) -> float:
    """``max_i |d_i|`` of one round between two states ``(mu, log s)`` (module docstring): the
    history's ``change``."""
    return float(np.max(np.abs(steps_in_sd([before, after])), initial=0.0))


def convergence(trajectory: list, window: int = WINDOW, max_jitter: float | None = None,
                moderated: bool = False, from_start: bool = False) -> dict:
    """Convergence summary of the last ``2 * window + 1`` states ``(mu, log s)`` (fewer: fewer checks).

    Returns ``{"rounds_checked": rounds seen, "change": last max step, "jitter": the largest sd of a
    coordinate's steps over the window (Monte Carlo or privacy noise), "drifting": number of drifting
    coordinates, "rate": the slowest drifting rate, "distance": largest remaining distance (sd),
    "converged": bool, or None when fewer than 3 rounds were seen, "oscillating": jitter above
    ``max_jitter``}``, and ``"drifting_coordinates"``, the indices of the drifting coordinates.

    Args:
      trajectory: the states of ``q`` round by round, each ``(mu, log s)`` as
        :func:`unconstrained_coordinates` gives them (the first may be the starting ``q``).
      window: the number of recent steps the tests look at (fewer while the trajectory is short; the drift
        rate compares the last two windows). Default :data:`WINDOW`.
      max_jitter: the largest sd of a coordinate's steps (in posterior sds) a converged fit may show
        (non-private fits: :data:`MAX_JITTER_SD`); a fit whose steps jitter more is not converged. None (the
        default, for noisy fits, whose steps carry the privacy noise): no jitter test.
      moderated: private fits: the drift test's variances are :func:`moderated_variances`. Default False.
      from_start: the first state is the fit's starting ``q`` (the prior); with ``max_jitter`` the first step,
        the approach from there, is left out of the jitter (its size is the distance from the prior, not
        jitter; the drift test keeps it), and fewer than 3 steps after it are too few to call ``q`` converged
        (None). Measured: a logistic regression's 3-round fit, whose means agree with a 20-round fit's to
        0.023 sd, was read as jumping 2 sd a round and advised more draws or a smaller learning rate. Default
        False.
    """
    out = {"rounds_checked": len(trajectory) - 1, "change": None, "jitter": None, "oscillating": False, "drifting": 0,
           "rate": None, "distance": None, "converged": None, "drifting_coordinates": []}
    if len(trajectory) < 2:
        return out
    d = steps_in_sd(trajectory)
    out["change"] = float(np.max(np.abs(d[-1])))
    k = min(window, max(len(d) // 2, 3))  # two windows as soon as there are 6 steps (a rate to extrapolate)
    if len(d) < k:
        return out
    recent = d[-k:]
    mean = recent.mean(0)
    spread = recent.std(0, ddof=1)
    out["jitter"] = float(np.max(spread))
    dof = k - 1
    if moderated:
        variance, dof = moderated_variances(recent)
        spread = np.sqrt(variance)
    t = stats.t.ppf(1.0 - FALSE_ALARM / (2.0 * d.shape[1]), dof)
    drifting = np.abs(mean) > t * spread / math.sqrt(k)
    out["drifting"] = int(drifting.sum())
    out["drifting_coordinates"] = sorted({int(i) % len(trajectory[0][0]) for i in np.flatnonzero(drifting)})
    if len(d) >= 2 * k:
        older = d[-2 * k:-k].mean(0)
        same_sign = np.sign(older) == np.sign(mean)
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = np.where(same_sign, np.abs(mean / older) ** (1.0 / k), np.inf)
            rate = np.fmax(rate, rate_within(recent))
            last = np.abs(mean) * k / np.sum(rate[None, :] ** -np.arange(k)[:, None], axis=0)
            remaining = np.where(rate < 1.0, last * rate / (1.0 - rate), np.inf)
        distance = np.where(drifting, remaining, 0.0)
    else:  # one window: no rate; a drifting coordinate has at least one more step to go
        rate = np.full(d.shape[1], np.nan)
        distance = np.where(drifting, np.abs(mean), 0.0)
    out["distance"] = float(np.max(distance))
    out["rate"] = float(np.nanmax(np.where(drifting, rate, 0.0))) if drifting.any() and len(d) >= 2 * k else None
    undetermined = drifting.any() and len(d) < 2 * k and out["distance"] <= CONVERGED_SD
    out["converged"] = None if undetermined else bool(out["distance"] <= CONVERGED_SD)
    if max_jitter is not None:
        judged = d[1:] if from_start else d  # the step out of the start is the approach, not jitter
        if len(judged) < 3:  # too few steps past the start to vouch for q either way
            out["jitter"] = None
            out["converged"] = None if out["converged"] is True else out["converged"]
        else:
            out["jitter"] = float(np.max(judged[-k:].std(0, ddof=1)))
            if out["jitter"] > max_jitter:
                out["oscillating"], out["converged"] = True, False
    return out


def moderated_variances(recent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per coordinate, the variance of the steps ``recent`` (``[k, 2D]``: means, then log scales) shrunk
    towards its group's, and the degrees of freedom of the drift test's t statistic with it, the moderated t
    statistic of Smyth (2004), "Linear models and empirical Bayes methods for assessing differential expression
    in microarray experiments", Stat. Appl. Genet. Mol. Biol. 3(1), eqs. (3)-(4) and section 6.2:

        s~_i^2 = (d s_i^2 + d_0 s_0^2) / (d + d_0),   t_i = m_i / (s~_i / sqrt(k)),   d + d_0 df,

    with ``s_i^2`` the coordinate's sample variance on ``d = k - 1`` df and ``(s_0^2, d_0)`` estimated from the
    group's (the means' or the log scales') ``log s_i^2`` by moments: ``trigamma(d_0 / 2) = var(log s_i^2) -
    trigamma(d / 2)`` (``d_0`` infinite when that is not positive: the variances differ no more than sampling
    does) and ``log s_0^2 = mean(log s_i^2) - digamma(d / 2) + log(d / 2) + digamma(d_0 / 2) - log(d_0 / 2)``.
    Variances that differ widely give a small ``d_0`` and little shrinkage; a group of one coordinate (``D = 1``)
    keeps its own variance on ``d`` df, the plain test. A private fit's steps are mostly
    its noise, whose variance differs between coordinates, but within a group not by orders of magnitude;
    from ``k = 5`` steps (10 rounds) a per-coordinate t statistic has 4 df and needs ``|t| > 6.1`` at 12
    coordinates, so a mean still moving 0.2 sd a round went unflagged while 4-6 sd from where more rounds took it
    (virtual clients, 10 rounds)."""
    k, width = recent.shape
    d = k - 1
    variance = np.maximum(recent.var(0, ddof=1), np.finfo(np.float64).tiny)
    moderated, dof = np.empty_like(variance), np.empty_like(variance)
    groups = np.arange(width) // max(width // 2, 1)
    for g in np.unique(groups):
        inside = groups == g
        if inside.sum() == 1:  # a one-coordinate group (D = 1): nothing to pool with, the plain t test
            moderated[inside], dof[inside] = variance[inside], d
            continue
        logs = np.log(variance[inside])
        excess = logs.var(ddof=1) - special.polygamma(1, d / 2.0)
        if excess > 0:
            d0 = 2.0 * inverse_trigamma(excess)
            log_s0 = logs.mean() - special.digamma(d / 2.0) + math.log(d / 2.0) + special.digamma(d0 / 2.0) - math.log(d0 / 2.0)
            moderated[inside] = (d * variance[inside] + d0 * math.exp(log_s0)) / (d + d0)
        else:  # d_0 infinite: the group's common variance, from the mean of log s_i^2
            d0 = np.inf
            moderated[inside] = math.exp(logs.mean() - special.digamma(d / 2.0) + math.log(d / 2.0))
        dof[inside] = min(d + d0, d * int(inside.sum()))  # s_0^2 is itself estimated: at most the group's df
    return moderated, dof


def inverse_trigamma(y: float) -> float:
    """``x`` with ``trigamma(x) = y`` (``y > 0``), by Newton's method on ``1 / trigamma`` (Smyth 2004, section 6.2)."""
    x = 0.5 + 1.0 / y if y < 1e6 else 1.0 / math.sqrt(y)
    for _ in range(50):
        tri = float(special.polygamma(1, x))
        step = tri * (1.0 - tri / y) / float(special.polygamma(2, x))
        x += step
        if -step / x < 1e-8:
            break
    return x


def rate_within(recent: np.ndarray) -> np.ndarray:
    """Per coordinate, the rate of the steps inside the last window ``recent`` (``[k, C]``): the ratio of the
    mean of its last ``h = k // 2`` steps to that of the ``h`` before, to the power ``1 / h``; NaN where the two
    differ in sign or ``k < 4``. :func:`convergence` takes the slower of it and the rate between the windows:
    steps that shrink fast early on (a fit leaving its prior, damped factors filling in) and slowly after make
    the rate between windows too fast, and the remaining distance too short (measured: virtual clients with
    damping 0.1 and 10 rounds were called converged 2.7 posterior sd from where 60 rounds took them)."""
    h = recent.shape[0] // 2
    if h < 2:
        return np.full(recent.shape[1], np.nan)
    late, early = recent[-h:].mean(0), recent[-2 * h:-h].mean(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.sign(late) == np.sign(early), np.abs(late / early) ** (1.0 / h), np.nan)


def warn_if_unconverged(summary: dict, caller: str, advice: str, jitter_advice: str) -> None:
    """A :class:`ConvergenceWarning` when the fit stopped *far* from converged (:data:`FAR_SD`)."""
    if summary.get("converged") is not False:
        return
    far_drift = summary["drifting"] and not summary["distance"] <= FAR_SD
    far_jitter = summary["oscillating"] and summary["jitter"] > FAR_SD
    if not (far_drift or far_jitter):
        return
    if far_drift:
        distance = summary["distance"]
        far = ("the steps are not shrinking" if not math.isfinite(distance)
               else f"at the current rate about {distance:.2g} posterior sd remain")
        sites = summary.get("drifting_sites")
        where = f" of site(s) {', '.join(repr(n) for n in sites)}" if sites else ""
        message = (f"q was still drifting when the fit stopped ({summary['drifting']} coordinate(s){where} moving "
                   f"steadily; {far}; last change {summary['change']:.2g} sd). {advice}")
    else:
        message = (f"q still jumps by about {summary['jitter']:.2g} posterior sd from round to round (an "
                   f"oscillation, or noisy local steps), so the final q is one point of that. {jitter_advice}")
    warnings.warn(f"{caller}: {message}. result.convergence has the details.", ConvergenceWarning,
                  stacklevel=user_stacklevel())


def noise_to_signal(noise_std: np.ndarray, dimension: int, terms: np.ndarray, clip: float) -> np.ndarray:
    """Per client: the expected norm of one release's noise over the largest norm its signal can have,

        ``sqrt(dimension) * noise_std / (terms * clip)``,

    ``terms`` being the number of clipped contributions summed in one release (the expected batch of
    DP optimisation, the shards of update perturbation, the expected number of clients of
    client-level DP). Above :data:`NOISE_SWAMPS`, even perfectly aligned contributions are smaller
    than the noise."""
    return math.sqrt(dimension) * np.asarray(noise_std, np.float64) / (np.asarray(terms, np.float64) * clip)


# ------------------------------------------------------------------ advice, in the options of the function called

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


#: Drift advice for private virtual clients: a virtual factor moves at most ``damping * clip`` a round
#: (benchmarks/vc_damping.py, results/vc_damping_travel.json).
TRAVEL_ADVICE = ("; a virtual factor moves at most damping x Privacy.clip a round, so damping x clip x rounds is "
                 "how far it can travel, and the noise grows with it too (docs/guide.md, virtual clients: travel)")


def convergence_advice(caller: str, schedule: str | None, family: str = "mean_field",
                       private: bool = False, method: str | None = None) -> tuple[str, str]:
    """``(drift advice, jitter advice)`` of a ConvergenceWarning, in the options of ``caller``."""
    sequential = schedule == "sequential"
    faster = ", or more `local_steps`" if sequential else ", or use schedule='sequential' or a larger `damping` for faster rounds"
    calmer = "" if sequential else "a smaller `damping` (synchronous rounds over M clients: about 1/M) or schedule='sequential', "
    template = PRIVATE_DRIFT_ADVICE if private and caller in ("fit_dppvi", "DPPVI") else CONVERGENCE_ADVICE[caller]
    drift = template.format(faster=faster)
    if family == "mean_field" and not private and caller != "fit_bcm":
        drift += FULL_RANK_ADVICE
    if private and method == "virtual_clients":
        drift += TRAVEL_ADVICE
    return drift, JITTER_ADVICE[caller].format(calmer=calmer)
