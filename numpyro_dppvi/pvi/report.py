"""What a (DP-)PVI fit publishes and says: the public history entry of a round, the settings JSON, the public
result with its calibration verdict, the convergence summary, the update counts, and the warnings a user acts on.

Every function takes the :class:`~numpyro_dppvi.pvi.driver.DPPVI` whose fit it reports, and reads only what may be
published (the releases' post-processing, public settings); the private state stays in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from .. import diagnostics
from ..diagnostics import ADVICE, convergence_advice
from ..results import DPPVIResult
from . import noise_aware, release_noise, release_saturation
from .defaults import NEWTON_MAX_DIM, UPDATE_METHODS
from .server import PVIState
from .shards import ROWS


def unrecovered_clients(history: list) -> list[int]:
    """The clients whose last update in ``history`` (the public history's ``participated`` and ``failed``) failed."""
    last: dict[int, bool] = {}
    for entry in history:
        part = entry.get("participated")
        if part is None:
            continue
        failed = set(entry.get("failed", []))
        for m in np.flatnonzero(np.asarray(part) > 0):
            last[int(m)] = int(m) in failed
    return sorted(m for m, failed in last.items() if failed)


class NoValidUpdates(FloatingPointError):
    """No client produced a valid update in the whole fit: ``q`` is still the prior (``result``).

    Args:
        message: what happened and what to change.
        result: the fit's (public) result, whose ``q`` is the prior; kept as ``err.result``.
    """

    def __init__(self, message: str, result: DPPVIResult):
        super().__init__(message)
        self.result = result


class FitDiverged(FloatingPointError):
    """A round would have made the posterior invalid; ``result`` holds the last valid (public) result.

    Args:
        message: which round failed and what to change.
        result: the public result of the last valid state; kept as ``err.result``.
    """

    def __init__(self, message: str, result: DPPVIResult):
        super().__init__(message)
        self.result = result


def public_settings(driver) -> dict:
    """The data-independent settings of the fit (JSON): published as ``result.config`` and
    compared on resume (:data:`RESUME_SETTINGS`)."""
    out = {"method": driver.method, "schedule": driver.schedule, "local_steps": driver.local_steps,
           "batch_size": driver.batch_size, "num_samples": driver.num_samples, "damping": driver.damping,
           "server_steps": driver.server_steps, "planned_rounds": driver.planned_rounds,
           "privacy_unit": driver.privacy_unit, "client_rate": driver.client_rate,
           "trusted_aggregator": driver.trusted_aggregator, "invalid": driver.invalid,
           "precision_floor": driver.precision_floor, "tail_average": driver.tail_average, "family": driver.family,
           "rank": driver.rank, "shards": None, "noise_aware": driver.noise_aware,
           "privacy": None}
    if driver.method in UPDATE_METHODS and driver.adapter is not None:
        out["shards"] = "rows" if driver.shards == ROWS else [int(k) for k in driver.num_shards]
    p = driver.privacy
    if p is not None and driver.plan is not None:
        out["privacy"] = {
            "epsilon": p.epsilon, "delta": p.delta, "clip": p.clip, "sampling": p.sampling,
            "neighbouring": p.neighbouring, "accountant": p.accountant,
            "epsilon_max": None if p.epsilon_max is None else
            [float(x) for x in np.atleast_1d(p.epsilon_max_per_client(driver.num_clients))],
            "adaptive_clip": None if p.adaptive_clip is None else dataclasses.asdict(p.adaptive_clip),
            "noise_multiplier": [float(z) for z in driver.plan.noise_multipliers],
        }
        if driver.declared_sizes is not None:  # absent otherwise, as in checkpoints written before it existed
            out["privacy"]["public_sizes"] = [int(n) for n in driver.declared_sizes]
    return out


def noise_aware_q(driver, state: PVIState):
    """``(q, precision rule)``: the noise-aware posterior, the fixed point of DP optimisation's noisy-observation
    factors with the rule its precision took (:mod:`.noise_aware`), or ``q`` with the noise virtual clients'
    releases left in it integrated out (:mod:`.release_noise`; no rule)."""
    if driver.method == "virtual_clients":
        return release_noise.posterior(state.q, state.client_state), None
    return noise_aware.posterior_and_rule(state.q, state.client_state)


def public_result(driver, state: PVIState, history: list) -> DPPVIResult:
    """The public result of ``state``. A private fit's ``calibration`` (post-processing of the releases):
    ``calibrated`` None (one fit alone does not tell: :func:`numpyro_dppvi.calibration_check` measures it) and,
    for a noise-aware DP optimisation fit, the noise-aware posterior's ``precision_rule``
    (:func:`.noise_aware.posterior_precision`, from the same program as its ``q``), with ``calibrated`` False
    where that rule cannot vouch for the intervals (:func:`.noise_aware.calibration`), and False for a private fit
    whose posterior does not account for the noise (:func:`.noise_aware.not_noise_aware`); its ``convergence`` then
    says ``converged`` False (``calibrated`` False beside it), whatever the iterates did."""
    q, rule = noise_aware_q(driver, state) if driver.noise_aware else (state.q, None)
    calibration = None
    if driver.plan is not None and not driver.noise_aware:
        calibration = noise_aware.not_noise_aware()
    elif driver.plan is not None and driver.method == "virtual_clients":
        per_client = not driver.trusted_aggregator and driver.privacy_unit == "example"  # one release per client
        calibration = release_saturation.calibration(history, driver.invalid == "floor" and per_client)
    elif driver.plan is not None:
        calibration = {"calibrated": None} if rule is None else noise_aware.calibration(rule)
    convergence = getattr(driver, "convergence", None)
    if convergence is not None and calibration is not None and calibration["calibrated"] is False:
        convergence = dict(convergence, converged=False, calibrated=False)
    return DPPVIResult(driver.adapter, q, history, method=driver.method, schedule=driver.schedule,
                       privacy=driver.ledger, config=public_settings(driver), rounds=int(state.round),
                       convergence=convergence,
                       q_fitted=state.q if driver.noise_aware else None, calibration=calibration)


def public_entry(driver, state, metrics, seconds) -> tuple[dict, dict]:
    """Split one round's record into what may be published and what stays in the private checkpoint."""
    client_level = driver.privacy_unit == "client"
    entry = {"round": int(state.round)}
    private = {"round": int(state.round)}
    # A round's time follows the realised (secret) Poisson batch sizes (poisson_fold's passes): a
    # private fit keeps it out of the published history (issue 24, finding 7).
    (private if driver.plan is not None else entry)["seconds"] = seconds
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
        if driver.invalid == "reject" and invalid.any():  # whose noisy update was not applied
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
            entry["failed_sites"] = driver.adapter.sites_of(np.asarray(metrics["failed_coordinates"]))
    # DP optimisation's answers held back by their trust region, and those whose factor's curvature estimate
    # was floored (pvi.noise_aware): computed from the releases, public
    for name, key in (("bound", "trust_region_bound"), ("floored", "curvature_floored")):
        if name in metrics and np.any(np.asarray(metrics[name])):
            entry[key] = int(np.sum(np.asarray(metrics[name])))
    if "saturation" in metrics:  # virtual clients' releases, the public clip and noise (pvi.release_saturation)
        summary = release_saturation.round_summary(metrics["saturation"], metrics["saturation_sd"])
        if summary is not None:
            entry["clip_saturation"], entry["clip_saturation_se"] = (round(v, 4) for v in summary)
    clip = state.client_state.get("clip") if isinstance(state.client_state, dict) else None
    if clip is not None and not client_level:  # the adaptive clip and its released counts' running sums
        entry["adaptive_clip"] = {"clip": np.round(np.asarray(clip.clip, float), 5).tolist(),
                                  "below_sum": np.asarray(clip.below_sum, float).round(4).tolist(),
                                  "releases": np.asarray(clip.releases, float).astype(int).tolist()}
    if "low_rank_truncation" in metrics:  # computed from q: public
        entry["low_rank_truncation"] = float(metrics["low_rank_truncation"])
    if "order" in metrics and driver.schedule == "asynchronous":
        entry["arrivals"] = np.asarray(metrics["order"]).tolist()
    return entry, private


def convergence_summary(driver, trajectory, history: list) -> dict:
    """:func:`diagnostics.convergence` of the last states, with the sites of drifting coordinates and of
    the updates that failed over the last ``2 * WINDOW`` rounds: a fit whose updates failed there is not
    converged, whatever q's steps say (a dropped update does not move q)."""
    private = driver.plan is not None
    from_start = len(trajectory) == len(history) + 1 and (not history or history[0].get("round") == 1)
    summary = diagnostics.convergence(list(trajectory), max_jitter=None if private else diagnostics.MAX_JITTER_SD,
                                      moderated=private, from_start=from_start)
    summary["drifting_sites"] = driver.adapter.sites_of(summary.pop("drifting_coordinates"))
    recent = history[-2 * diagnostics.WINDOW:]
    summary["failed_updates"] = sum(len(entry.get("failed", [])) for entry in recent)
    failed_sites = set().union(*(entry.get("failed_sites", []) for entry in recent))
    summary["failed_sites"] = [site.name for site in driver.adapter.sites if site.name in failed_sites]
    if summary["failed_updates"]:
        summary["converged"] = False
    return summary


def check_updates(driver, result: DPPVIResult, history: list) -> None:
    """Raise :class:`NoValidUpdates` when no client ever produced a valid update (``q`` is the
    prior), warn (:class:`~numpyro_dppvi.diagnostics.ClientUpdateWarning`) naming the clients that
    took part but never updated; both are recorded in ``result.updates`` (per client: rounds taken
    part, valid updates). Client-level DP: the client sample is private (publishing who took part
    would void the subsampling amplification), so nothing is counted, warned or raised from it and
    ``result.updates`` stays ``None``."""
    if driver.privacy_unit == "client":
        return
    taken, valid = np.zeros(driver.num_clients, int), np.zeros(driver.num_clients, int)
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
            f"{driver.caller}: no client produced a valid update in {len(history)} round(s) ({count}every one "
            "non-finite or rejected), so q is still the prior. The local objective is "
            "probably non-finite where the prior puts mass (e.g. a gradient that overflows or a log of a "
            f"negative number); check the model at prior draws, or {ADVICE[driver.caller]}. err.result holds "
            "the unrefined result.", result)
    if never:
        warnings.warn(f"{driver.caller}: client(s) {never[:20]} took part but never produced a valid update "
                      "(non-finite or rejected every time): their data is not in q. result.updates has the "
                      f"counts; {ADVICE[driver.caller]}.", diagnostics.ClientUpdateWarning,
                      stacklevel=diagnostics.user_stacklevel())
    failed_rounds = [entry for entry in history if entry.get("failed")]
    recent = driver.convergence["failed_updates"] if driver.convergence else 0
    total = sum(len(entry["failed"]) for entry in failed_rounds)
    # a client whose update failed and that updated validly since has its data in q again (its factor is
    # refitted from the cavity it then saw; PVI's fixed point does not depend on the rounds before): only
    # failures in the last rounds, or not yet made good, leave q without a client's data
    if total and (recent or unrecovered_clients(history)):
        sites = [s.name for s in driver.adapter.sites
                 if any(s.name in entry.get("failed_sites", []) for entry in failed_rounds)]
        where = f" (not finite on site(s) {', '.join(repr(n) for n in sites)})" if sites else ""
        warnings.warn(
            f"{driver.caller}: {total} of {int(taken.sum())} client updates failed{where} in {len(failed_rounds)} of "
            f"{len(history)} round(s), {recent} of them in the last {min(len(history), 2 * diagnostics.WINDOW)}; a "
            "failed update is dropped, so q lacks those clients' data where it failed and the fit is not "
            "converged. The local objective is not finite where q puts mass: check the model at draws of q "
            f"for {', '.join(repr(n) for n in sites) or 'those sites'} (e.g. an exp that overflows or a log of a "
            f"non-positive value), or {ADVICE[driver.caller]}. result.updates and the history's 'failed' have "
            "the counts.", diagnostics.ClientUpdateWarning, stacklevel=diagnostics.user_stacklevel())


def warn_if_noise_widens(driver, state: PVIState, quiet: bool = False) -> None:
    """Warn (:class:`~numpyro_dppvi.diagnostics.NoiseWarning`) when the releases' noise (the mechanism's and
    the Poisson batches') dominates a noise-aware posterior: some coordinate's sd is more than :data:`~numpyro_dppvi.diagnostics.NOISE_WIDENS` times
    what the clients' released curvature would give without the noise (:func:`.noise_aware.widening`,
    post-processing of the releases; virtual clients: what ``q`` gives, :func:`.release_noise.widening`). The
    intervals are honest, but most of their width is the noise. ``quiet``: computed (one program for every fit)
    but not said. Full-rank virtual clients do not say it: their intervals widen for the noise with ``q``'s full
    precision (eq. 3 of :mod:`.release_noise`) and cover on ``benchmarks/coverage.py`` where the noise carries
    most of their width (epsilon 1: the warning fired in 49 of 50 fits of a cell covering .86), and on
    ``benchmarks/calibration_zoo.py`` the fits whose sds the noise widened most covered as well as the others (the
    hierarchical logistic regression's widest 8 fits at epsilon 1, 266-582 times: 0.82 of their true values
    at 90%, the cell's 20 fits 0.80), so the warning would not change what a user concludes; the largest ratio is ``result.calibration["noise_widening"]``
    (``sd(q) / sd(q_fitted)``, both published). Returns the largest ratio."""
    virtual = driver.method == "virtual_clients"
    if virtual:
        ratio = np.asarray(release_noise.widening(state.q, state.client_state))
    else:
        ratio = np.asarray(noise_aware.noise_widening(state.q, state.client_state))
    quiet = quiet or (virtual and driver.family == "full_rank")
    if quiet or not float(ratio.max()) > diagnostics.NOISE_WIDENS:
        return float(ratio.max())
    worst = int(np.argmax(ratio))
    sites = driver.adapter.sites_of(ratio > diagnostics.NOISE_WIDENS)
    if virtual:  # the noise left in q grows as damping^2 x rounds x sigma^2, sigma itself growing with the rounds
        source, fix = "the DP mechanism's", (
            "a larger epsilon, fewer rounds or a smaller damping for the same epsilon (each virtual factor then "
            "moves less of the way to its optimum: a trade of noise for bias), or fewer clients with more data "
            "each would narrow them")
    else:
        batch = "" if driver.caller == "fit_global_vi" else ", fewer clients with more data each"
        source, fix = "the DP mechanism's and the batches' sampling", (
            f"a larger batch_size (the noise of a release is the same, its signal grows), a larger epsilon{batch}, "
            "or fewer rounds x local_steps for the same epsilon would narrow them")
    accounted = "The intervals account for it, but they are wide because of it"
    if virtual:  # issue 23: benchmarks/vc_noise_response.py, benchmarks/results/coverage.json
        accounted = (
            "The intervals widen for it to first order, but not fully: the virtual factors keep answering "
            "cavities that hold the noise, which moves the mean further where the coordinates are correlated "
            "than the intervals allow (measured on a logistic regression, benchmarks/coverage.py: 90% intervals "
            "of virtual clients covered 0.53-0.79 of the true values)")
    elif driver.caller != "fit_global_vi":  # DP optimisation (issue 23)
        accounted = (
            "The intervals account for the noise's spread but not fully for its pull: at this level the private "
            "mean of a non-Gaussian likelihood settles nearer the prior than the intervals allow (measured on a "
            "logistic regression, benchmarks/coverage.py: where the sds were 2-3 times the non-private fit's, "
            "90% intervals covered 0.76-0.86 of the true values; a Gaussian likelihood's covered)")
    warnings.warn(
        f"{driver.caller}: the noise of the releases ({source}) dominates the "
        f"posterior: its sds are up to {ratio[worst]:.2g} times what the clients' data would give without it "
        f"(sites {sites}; the noise carries "
        f"{1.0 - 1.0 / ratio[worst] ** 2:.0%} of the variance there). {accounted}: {fix}.",
        diagnostics.NoiseWarning, stacklevel=diagnostics.user_stacklevel())
    return float(ratio.max())


def finish(driver, state, trajectory, history: list, rounds: int) -> DPPVIResult:
    """The public result of a run that ended in ``state``, with its convergence (``driver.convergence``), its
    update counts (:func:`check_updates`) and the warnings a user acts on: the noise's share of the intervals
    (:func:`warn_if_noise_widens`), intervals the fit cannot vouch for (one CalibrationWarning), and a fit that had
    not converged (not said where a held-back clip is its cause)."""
    driver.convergence = convergence_summary(driver, trajectory, history)
    result = public_result(driver, state, history)
    check_updates(driver, result, history)
    if rounds and driver.noise_aware:  # a fit that flags its intervals gives that warning instead
        widening = warn_if_noise_widens(driver, state, quiet=result.calibrated is False)
        if driver.method == "virtual_clients" and result.calibration is not None:
            result.calibration["noise_widening"] = round(widening, 4)
    if rounds and result.calibrated is False and "reason" in result.calibration:
        release_saturation.warn_uncalibrated(driver.caller, result.calibration)
    elif rounds and result.calibrated is False:
        noise_aware.warn_uncalibrated(driver.caller, result.calibration["precision_rule"], driver.adapter.dim,
                                      NEWTON_MAX_DIM if driver.method == "dp_optimisation" else None)
    held_back = (result.calibration or {}).get("reason") == "clip"  # its warning names the drift's cause
    if rounds and not held_back:
        diagnostics.warn_if_unconverged(driver.convergence, driver.caller,
                                        *convergence_advice(driver.caller, driver.schedule, driver.family,
                                                            private=driver.plan is not None, method=driver.method))
    return result
