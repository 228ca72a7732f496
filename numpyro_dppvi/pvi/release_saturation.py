"""Whether virtual clients' clip lets their factors arrive: the saturation of a release (issue 59).

**The statistic.** A virtual-clients round releases ``R_m = S_m + xi_m`` with ``S_m = sum_k clip_C(Delta_k)``, one
clipped change per record (:class:`~numpyro_dppvi.pvi.update_perturbation.VirtualClients`), and ``xi_m`` the
Gaussian mechanism's noise, std ``s_m = sigma_m C`` on each of the ``P`` coordinates of a change
(:func:`~numpyro_dppvi.factors.num_coordinates`). Where the virtual factors have arrived at their records'
likelihoods, each ``Delta_k`` is what is left of the local fit's Monte Carlo scatter: changes of mean near zero,
independent over records, of norm at most ``C``. Then

    E ||S_m||^2 = sum_k E ||clip_C(Delta_k)||^2 <= N_m C^2,

so ``z_m = ||S_m||^2 / (N_m C^2)`` is at most 1 in expectation (``N_m`` the planned shards, public). Where the clip
holds the factors back, the records' changes share a direction ``mu`` (each record still asks for more than the
clip lets through), and ``z_m ~ N_m ||mu||^2 / C^2`` grows with the client's size: ``z = 10`` is a common change of
``sqrt(10) C / sqrt(N_m)`` a record. From the release alone (post-processing: ``R_m``, the public ``C``, ``s_m``, ``N_m``),

    z^_m = (||R_m||^2 - P s_m^2) / (N_m C^2),        sd(z^_m) = sqrt(2 P) s_m^2 / (N_m C^2)                     (1)

is unbiased for ``z_m`` (``E ||xi||^2 = P s^2``, ``Var ||xi||^2 = 2 P s^4``; the cross term ``2 <S, xi>`` is left out
of the sd, which it changes by a factor ``sqrt(1 + 2 z N_m / (P sigma^2))``). A full-rank change's norm is the joint
Frobenius norm :func:`~numpyro_dppvi.pvi.update_perturbation.clip_change` clips, on which the noise has ``P``
coordinates of variance ``s^2`` (the off-diagonal pairs at ``s^2 / 2`` each, counted twice).

**The verdict** (:func:`calibration`). The mean of ``z^`` over the clients' releases of the last quarter of the rounds
(at least one round), ``z-bar``, with its standard error from (1). The fit flags its intervals (``calibrated`` False)
when ``z-bar - 2 se > SATURATION_BOUND``: the releases at the end of the fit still carry a common change that the
clip holds back, the virtual factors are short of their records' likelihoods, and ``q`` is biased towards where
the factors started (the prior). A second rule: under ``invalid="floor"``, when the floor fired in at least
:data:`FLOORED_SHARE_MAX` of the client-rounds (``history[r]["invalid_updates"]``): the posterior's precision was
then set by the documented floor in nearly every round, not by the releases, and :mod:`.release_noise`'s account of
the noise (a first-order expansion in the noise about a precision the noise leaves positive) does not hold.

How the bound was chosen, and checked (``benchmarks/calibration_zoo.py``, virtual clients at their defaults, 2,000
rows over 5 clients, epsilon 1 and 8, 20 data sets a cell; each fit's ``z-bar`` and own 90% coverage in
``benchmarks/results/calibration_zoo.json``): on the ordered logistic and censored Weibull regressions, the 58
fits with ``z-bar`` below 10 covered 0.87 of their true values at 90%, the 42 above 0.52 (10-12: 0.75, 2 fits;
12-16: 0.52, 5; above 16: 0.49, 35); the Weibull cells, which miss (0.40 and 0.60), sit at 12-110, the ordered
logistic cells, which cover, at most 7.2 but for three fits (11.8, 15.6 and 58; coverage 0.5, 0.83, 0.5). The
bound was then checked on models it was not chosen on: the 61-column logistic regression (at most 6.3) and the
20-group hierarchical logistic regression of the zoo, and the logistic regression of ``benchmarks/coverage.py``
(10 clients). The clip is the cause, not a symptom: the same Weibull fits with ``Privacy(clip=10)`` covered 0.96
and read below 1. The floor rule fired in 0.98-1.0 of the client-rounds of every fit of the 61-column logistic
regression at epsilon 1 (coverage 0.59), and in 0.18-0.88 (median 0.46) at epsilon 8 (0.87).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .. import diagnostics

#: ``z-bar`` above which (by two standard errors) a virtual-clients fit's clip holds its factors back (module
#: docstring): a common change of ``sqrt(10) C / sqrt(N_m)`` per record at the end of the fit; on the zoo the fits
#: above it covered 0.52 at 90%, those below 0.87.
SATURATION_BOUND = 10.0
#: Share of the client-rounds in which the floor rule fired from which the precision is the rule's, not the data's:
#: the zoo's fits that missed measured 0.98-1.0, those of covering cells at most 0.88 (module docstring).
FLOORED_SHARE_MAX = 0.95


def statistic(released, noise_std, clip, num_shards, num_coordinates: int):
    """``(z^, sd)`` of eq. (1) for one release ``released`` (a Gaussian change or a sum of them, as released: centred
    where the rule centres) of noise std ``noise_std`` on each of its ``num_coordinates`` coordinates, with clip
    ``clip`` and ``num_shards`` planned records (public). Post-processing of the release."""
    square = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(released))
    scale = num_shards * clip ** 2
    return (square - num_coordinates * noise_std ** 2) / scale, math.sqrt(2 * num_coordinates) * noise_std ** 2 / scale


def round_summary(saturation, saturation_sd) -> tuple[float, float] | None:
    """One round's ``(mean z^, its standard error)`` over the releases that were applied (the others NaN), or None."""
    z, sd = (np.asarray(a, np.float64).reshape(-1) for a in (saturation, saturation_sd))
    took = np.isfinite(z) & np.isfinite(sd)
    if not took.any():
        return None
    return float(np.mean(z[took])), float(np.sqrt(np.sum(sd[took] ** 2)) / took.sum())


def calibration(history: list, floor_rule: bool) -> dict:
    """What a private virtual-clients fit knows of its intervals, from its public history (module docstring):
    ``{"calibrated": None | False, "clip_saturation": z-bar, "clip_saturation_se": se, "floored_share": f,
    "reason": None | "clip" | "floor"}``; ``floored_share`` None without ``invalid="floor"``."""
    rounds = [h for h in history if "clip_saturation" in h]
    out = {"calibrated": None, "clip_saturation": None, "clip_saturation_se": None, "floored_share": None,
           "reason": None}
    if rounds:
        last = rounds[-max(len(rounds) // 4, 1):]
        z = float(np.mean([h["clip_saturation"] for h in last]))
        se = float(np.sqrt(np.sum([h["clip_saturation_se"] ** 2 for h in last])) / len(last))
        out.update(clip_saturation=round(z, 4), clip_saturation_se=round(se, 4))
        if z - 2 * se > SATURATION_BOUND:
            out.update(calibrated=False, reason="clip")
    if floor_rule:
        took = sum(int(np.sum(h["participated"])) for h in history if "participated" in h)
        fired = sum(int(h.get("invalid_updates", 0)) for h in history if "participated" in h)
        if took:
            out["floored_share"] = round(fired / took, 4)
            if fired / took >= FLOORED_SHARE_MAX and out["reason"] is None:
                out.update(calibrated=False, reason="floor")
    return out


def warn_uncalibrated(caller: str, calibration: dict) -> None:
    """The one :class:`~numpyro_dppvi.diagnostics.CalibrationWarning` of a virtual-clients fit whose
    :func:`calibration` is False: what the releases showed and what to do."""
    check = ("run numpyro_dppvi.calibration_check(model, covariates, result) on synthetic or public covariates and "
             "take report.recalibrate(result)")
    if calibration["reason"] == "clip":
        warnings.warn(
            f"{caller}: the posterior's intervals are not calibrated (result.calibrated is False): the clip holds the "
            "virtual factors back. At the end of the fit the records' clipped changes still point the same way "
            f"(result.calibration['clip_saturation'] = {calibration['clip_saturation']:.3g}, against at most 1 for "
            f"factors that have arrived and {SATURATION_BOUND:g} for this flag), so q is biased towards the prior; "
            "such fits' 90% intervals covered 0.52 of the true values on benchmarks/calibration_zoo.py. Pass a "
            "larger clip (dppvi.Privacy(clip=...): the zoo's censored Weibull regression covered 0.96 at 90% with "
            f"clip=10, 0.40-0.60 with the default), or {check}.",
            diagnostics.CalibrationWarning, stacklevel=diagnostics.user_stacklevel())
    else:
        warnings.warn(
            f"{caller}: the posterior's intervals are not calibrated (result.calibrated is False): the releases' noise "
            "made some precision fall below the floor in "
            f"{100 * calibration['floored_share']:.0f}% of the client-rounds (result.calibration['floored_share']), so "
            "the posterior's precision is the floor rule's, not the data's, and such fits' 90% intervals covered 0.59 "
            "of the true values on benchmarks/calibration_zoo.py. Give each release more signal (a larger epsilon, "
            f"more rows per client, fewer rounds), or {check}.",
            diagnostics.CalibrationWarning, stacklevel=diagnostics.user_stacklevel())
