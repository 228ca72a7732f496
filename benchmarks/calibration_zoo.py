"""The calibration zoo (issue 59): do private intervals cover on the models users bring, not only on the one the
defaults were tuned on?

Model classes (``tests/calibration_zoo_models.py``): hierarchical logistic regression over 20 groups, centred and
non-centred; a non-centred hierarchical Poisson regression over 10 groups; a censored Weibull regression with a
``HalfNormal(2)`` shape; an ordered-logistic regression with 3 cut-points; a Gamma regression with an unknown shape;
a negative-binomial regression with an unknown dispersion; a Student-t regression with unknown degrees of freedom;
a logistic regression on 60 binary columns (above ``NEWTON_MAX_DIM``).

A cell is ``model x method x rows x epsilon``: ``rows`` split over 5 clients of equal size (declared as their
``public_sizes``), ``epsilon`` at ``delta = 1e-5``; methods ``dp_optimisation`` (``batch_size=100``, defaults
otherwise), ``virtual_clients`` (defaults) and ``pvi`` (non-private defaults, no epsilon). Each cell runs
:func:`numpyro_dppvi.calibration_check` from the prior (simulation-based calibration: the parameters drawn from the
prior, the observations simulated at fixed covariates, seed 0, ``rng_key = key(cell index)``) over ``--datasets``
data sets, and records the pooled 50% and 90% coverage with its Monte Carlo standard error (over data sets), the
per-site 90% coverage and widening, the smallest VSBC and uniformity KS p-values, the rank histogram (10 bins of the
ranks among 99 draws, pooled), how many fits raised, warned (per warning class) or were called converged, and each
fit's round-to-round jitter (posterior sd) and own coverage; how many fits flagged themselves (``result.calibrated``
False, ``flagged``) and the coverage of the others (``cover90_unflagged``, ``cover50_unflagged``). A cell holds the
promise (``private_cells_in_bar_or_flagged``) when it covers, when every fit is flagged, or when its unflagged fits
cover; a flag is earned when no covering cell flags more than one fit in ten
(``covering_cells_flagging_more_than_one_in_ten`` lists those that do). ``warning_rates``: per method, the share of
its fits that gave each warning class (a cell's ``warned`` counts its fits, not its warnings). ``pvi`` cells also fit NUTS (500 + 500) on the pooled data of the first ``--nuts`` data sets:
the worst mean gap to it in NUTS posterior sds.

Bars (issue 59): 90% coverage within 0.85-0.95 and 50% within 0.42-0.58 (the unflagged fits' coverage is read
against the same bars).

Run from a checkout: ``python benchmarks/calibration_zoo.py`` runs every cell (``--models``, ``--methods``,
``--rows``, ``--epsilons`` to run some; ``--jobs N`` splits the cells over N processes). Cells are merged into
``benchmarks/results/calibration_zoo.json`` by name, so that runs of some cells add to the file (other top-level
entries, e.g. ``before_precision_rule``, are kept). Time on 2 cores, one process: 25-60 s a DP optimisation cell,
20-100 s a ``pvi`` cell with its NUTS references, 65-170 s a virtual-clients cell of up to 6 or above 32 latents
and 720-880 s one of the 23-latent hierarchical models (full-rank virtual factors).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # tests.calibration_zoo_models: the models shared with the test suite

import jax  # noqa: E402
import numpy as np  # noqa: E402
from scipy.stats import norm  # noqa: E402
from _common import late_clipped_share, results_dir, write  # noqa: E402

import numpyro_dppvi as dppvi  # noqa: E402
from numpyro_dppvi.diagnostics import unconstrained_coordinates  # noqa: E402
from tests import calibration_zoo_models as Z  # noqa: E402

CLIENTS = 5
DELTA = 1e-5
METHODS = ("dp_optimisation", "virtual_clients", "pvi")
ROWS = (2000, 10000)
EPSILONS = (1.0, 8.0)
NAME = "calibration_zoo"


def cell_name(model: str, method: str, rows: int, epsilon) -> str:
    return f"{model}:{method}:{rows}:{'none' if epsilon is None else f'{float(epsilon):g}'}"


def settings(method: str, rows: int, epsilon, rounds=None) -> dict:
    if method == "pvi":
        return {}
    privacy = dppvi.Privacy(epsilon=float(epsilon), delta=DELTA, public_sizes=[rows // CLIENTS] * CLIENTS)
    extra = {"batch_size": 100} if method == "dp_optimisation" else {}
    if rounds is not None:  # --rounds: a tested alternative to the method's planned rounds
        extra["rounds"] = int(rounds)
    return {"method": method, "privacy": privacy, **extra}


def nuts_gap(model, clients, result, seed=0) -> float:
    """Worst |mean - NUTS mean| / NUTS sd over the unconstrained coordinates (tests/pvi/numpyro_models.gap)."""
    from tests.pvi import numpyro_models as M

    reference = M.nuts_moments(model, Z.pooled(clients), seed=seed)
    return M.gap(M.flat_loc(result), reference)


def fit_record(result, z) -> dict:
    """One fit's public diagnostics beside its own 90% coverage: what a flag of a fit that cannot vouch for its
    intervals can be built from (the convergence summary, the history's counts, the noise-aware widening)."""
    if result is None:
        return {"raised": True, "cover90": 0.0}
    conv = result.convergence or {}
    history = result.history
    _, log_s = unconstrained_coordinates(result.q)
    _, log_s_fitted = unconstrained_coordinates(result.q_fitted)
    widening = np.exp(log_s - log_s_fitted)
    rounded = lambda v: None if v is None else round(float(v), 3)
    clipped = late_clipped_share(history)
    return {"raised": False, "cover90": round(float(np.mean(np.abs(z) < 1.6448536269514722)), 3),
            "converged": conv.get("converged"), "jitter": rounded(conv.get("jitter")),
            "change": rounded(conv.get("change")), "drifting": conv.get("drifting"),
            "trust_region_bound": int(sum(h.get("trust_region_bound", 0) for h in history)),
            "curvature_floored": int(sum(h.get("curvature_floored", 0) for h in history)),
            "invalid_updates": int(sum(h.get("invalid_updates", 0) for h in history)),
            "noise_widening_max": rounded(np.max(widening)), "noise_widening_median": rounded(np.median(widening)),
            "precision_rule": (result.calibration or {}).get("precision_rule"),
            "clip_saturation": (result.calibration or {}).get("clip_saturation"),
            "floored_share": (result.calibration or {}).get("floored_share"),
            "clipped_share": clipped}


def run_cell(model_name: str, method: str, rows: int, epsilon, datasets: int, nuts: int, index: int,
             rounds=None) -> dict:
    zoo = Z.ZOO[model_name]
    covariates = Z.client_covariates(model_name, rows, CLIENTS)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = dppvi.calibration_check(zoo.model, covariates, settings(method, rows, epsilon, rounds),
                                         num_datasets=datasets, rng_key=jax.random.key(index),
                                         simulate=zoo.simulate)
    seconds = time.perf_counter() - start
    c50, se50 = report.coverage(0.5)
    c90, se90 = report.coverage(0.9)
    tests = report.ks()
    ranks = np.concatenate([report.ranks[s] for s in report.sites], axis=1)
    ranks = ranks[np.all(ranks >= 0, axis=1)]
    histogram = np.histogram(ranks, bins=10, range=(0, report.num_draws + 1))[0].tolist()
    fits = []
    z = report.errors()
    for k, result in enumerate(report.results):
        fits.append(fit_record(result, z[k]))
    flagged = np.array([r is not None and r.calibrated is False for r in report.results])
    unflagged = z[~flagged & np.array([r is not None for r in report.results])]
    within = lambda level: round(float(np.mean(np.abs(unflagged) < norm.ppf(0.5 + level / 2))), 4) \
        if unflagged.size else None
    out = {"model": model_name, "method": method, "rows": rows, "epsilon": epsilon, "datasets": datasets,
           "cover50": round(c50, 4), "se50": round(se50, 4), "cover90": round(c90, 4), "se90": round(se90, 4),
           "in_bar": bool(0.85 <= c90 <= 0.95 and 0.42 <= c50 <= 0.58),
           "calibrated_by_check": report.calibrated,
           "cover90_by_site": {s: round(report.coverage(0.9, s)[0], 3) for s in report.sites},
           "widening": {s: round(v, 3) for s, v in report.widening().items()},
           "min_vsbc_pvalue": float(np.nanmin(tests["vsbc_pvalue"], initial=np.nan)),
           "min_uniform_pvalue": float(np.nanmin(tests["uniform_pvalue"], initial=np.nan)),
           "rank_histogram": histogram, "raised": len(report.failures),
           "failures": [f[1][:200] for f in report.failures[:3]],
           "warned": report.warnings,
           "converged_true": sum(f.get("converged") is True for f in fits),
           "flagged": int(flagged.sum()), "cover90_unflagged": within(0.9), "cover50_unflagged": within(0.5),
           "precision_rules": {rule: sum(f.get("precision_rule") == rule for f in fits)
                               for rule in {f.get("precision_rule") for f in fits} if rule is not None},
           "fits": fits, "seconds": round(seconds, 1), **({} if rounds is None else {"rounds": int(rounds)})}
    if method == "pvi" and nuts:
        gaps = [round(nuts_gap(zoo.model, report.data[k], report.results[k]), 3)
                for k in range(min(nuts, datasets)) if report.results[k] is not None]
        out["nuts_gap"] = gaps
        out["worst_nuts_gap"] = max(gaps) if gaps else None
    return out


def cells(args) -> list[tuple]:
    out = []
    for model in args.models:
        for method in args.methods:
            for rows in args.rows:
                for epsilon in ([None] if method == "pvi" else args.epsilons):
                    if method == "pvi" and rows != min(args.rows):
                        continue  # the non-private reference at the smaller size (NUTS's cost)
                    out.append((model, method, rows, epsilon))
    return out


def merge(parts: list[dict], directory=None) -> Path:
    path = results_dir(directory) / f"{NAME}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    existing = previous.get("cells", {})
    kept = {k: v for k, v in previous.items() if k not in (
        "benchmark", "machine", "bars", "commit", "private_cells_in_bar", "private_cells_in_bar_or_flagged",
        "covering_cells_flagging_more_than_one_in_ten", "warning_rates", "cells")}
    for part in parts:
        existing[cell_name(part["model"], part["method"], part["rows"], part["epsilon"])] = part
    in_bar = {name: c["in_bar"] for name, c in existing.items() if c["method"] != "pvi"}
    # a cell holds the promise when it covers, or when its fits that do not flag themselves cover (all flagged: none
    # left); a flag is earned when a covering cell flags at most one fit in ten
    honest = {name: c["in_bar"] or c.get("flagged", 0) == c["datasets"] or (
        c.get("cover90_unflagged") is not None and c.get("flagged", 0) > 0
        and 0.85 <= c["cover90_unflagged"] <= 0.95 and 0.42 <= c["cover50_unflagged"] <= 0.58)
        for name, c in existing.items() if c["method"] != "pvi"}
    overflagged = sorted(name for name, c in existing.items()
                         if c["method"] != "pvi" and c["in_bar"] and c.get("flagged", 0) > c["datasets"] / 10)
    rates: dict = {}  # per method and warning class: the share of fits that gave it (issue 60, item 8)
    for c in existing.values():
        entry = rates.setdefault(c["method"], {"fits": 0})
        entry["fits"] += c["datasets"]
        for category, count in (c.get("warned") or {}).items():
            entry[category] = entry.get(category, 0) + count
    warning_rates = {method: {k: round(v / entry["fits"], 3) for k, v in sorted(entry.items()) if k != "fits"}
                     | {"fits": entry["fits"]} for method, entry in sorted(rates.items())}
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    return write(NAME, {"bars": {"cover90": [0.85, 0.95], "cover50": [0.42, 0.58]}, "commit": commit,
                        "private_cells_in_bar": f"{sum(in_bar.values())} of {len(in_bar)}",
                        "private_cells_in_bar_or_flagged": f"{sum(honest.values())} of {len(honest)}",
                        "covering_cells_flagging_more_than_one_in_ten": overflagged,
                        "warning_rates": warning_rates,
                        **kept, "cells": dict(sorted(existing.items()))}, directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(Z.ZOO), choices=list(Z.ZOO))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    parser.add_argument("--datasets", type=int, default=20)
    parser.add_argument("--nuts", type=int, default=3, help="NUTS references of the pvi cells (data sets)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None,
                        help="planned rounds of the private cells instead of the method's (a tested alternative: write "
                             "it elsewhere with --out)")
    parser.add_argument("--cell", help="internal: run one cell (model:method:rows:epsilon) and print its JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.cell:
        model, method, rows, epsilon = args.cell.split(":")
        index = [cell_name(*c) for c in cells(argparse.Namespace(
            models=list(Z.ZOO), methods=list(METHODS), rows=list(ROWS), epsilons=list(EPSILONS)))].index(args.cell)
        part = run_cell(model, method, int(rows), None if epsilon == "none" else float(epsilon), args.datasets,
                        args.nuts, index, args.rounds)
        print("CELL " + json.dumps(part), flush=True)
        return
    command = [sys.executable, __file__, "--datasets", str(args.datasets), "--nuts", str(args.nuts)] + (
        [] if args.rounds is None else ["--rounds", str(args.rounds)]) + ["--cell"]

    def one(name):
        done = subprocess.run(command + [name], stdout=subprocess.PIPE, text=True)
        return [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("CELL ")]

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for parts in pool.map(one, [cell_name(*c) for c in cells(args)]):
            for part in parts:
                print(f"{cell_name(part['model'], part['method'], part['rows'], part['epsilon'])}: cover90 "
                      f"{part['cover90']:.3f} +- {part['se90']:.3f}, cover50 {part['cover50']:.3f}, raised "
                      f"{part['raised']}, converged {part['converged_true']}/{part['datasets']}, "
                      f"{part['seconds']} s", flush=True)
                merge([part], args.out)

if __name__ == "__main__":
    main()
