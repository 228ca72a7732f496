"""Coverage of private credible intervals over many simulated data sets (issue 23).

A private posterior is read as uncertainty: its central 50% and 90% intervals should contain the true
parameter 50% and 90% of the time when the truth is drawn from the prior. This measures it.

Data: a Bayesian logistic regression with ``d = 5`` covariates and an intercept (``numpyro_dppvi.example_models.
logistic_regression``), the truth drawn from its ``N(0, I)`` prior, ``x ~ N(0, I)``, split over 10
clients (``dppvi.partition``); data set ``k`` uses seed ``1000 + k`` for the data and ``k`` for the
fit's key. Cells: ``method x epsilon x n``,

* ``dp_optimisation``: ``fit_dppvi(method="dp_optimisation", batch_size=100)``, defaults otherwise;
* ``virtual_clients``: ``fit_dppvi(method="virtual_clients")``, defaults otherwise (full-rank factors, 20 rounds,
  damping 0.25 and ``pvi.defaults.virtual_clip``: 0.24 at epsilon 1 / 2,000 rows, 0.5 in the other cells; with
  ``noise_aware=False`` the mean-field defaults, 10 rounds at damping 0.1 and clip 1);
* ``dp_global_vi``: ``fit_global_vi(privacy=..., batch_size=100)`` on the pooled data, defaults otherwise;
* ``pvi`` (``epsilon`` None): non-private PVI with its defaults, the reference;

at ``epsilon in {1, 8}`` (``delta = 1e-5``) and ``n in {2000, 10000}``; and Bayesian linear regression
through ``fit_vips`` (5 covariates, noise sd 1, 2000 rows, batches of 200, features clipped to
``[-3, 3]`` and targets to ``[-10, 10]``, the model's public bounds); its intervals are read from the posterior's
own marginal CDF (for the noise-aware mixture, the mixture's); ``vips_federated``: the same data and model over 10
clients through ``fit_dppvi(method="vips")`` (one round, each client releasing its whole clipped statistics once).

And UCI Adult (10 clients, ``--cells adult``): test accuracy and the expected calibration error (10 bins) of
the posterior predictive probabilities, non-private defaults against DP optimisation at epsilon 1 (batches
of 100, 3 keys) with the default clipping (``"auto"``) and with the former fixed ``clip=1``.

For the private logistic cells, each data set is also fitted without privacy (the ``pvi`` reference, once per data
set): ``shrink_slope`` is the slope of the private mean's deviation from the reference's mean regressed on the
reference's mean (negative: pulled towards the prior's 0), and ``cover90_by_widening`` the 90% coverage of the
coordinates grouped by their sd over the reference's (``[coverage, coordinates]`` per group): what the
``NoiseWarning`` of a fit whose noise widens its sds more than twice quotes.

Per cell: the share of (data set, coordinate) pairs whose 50% / 90% interval contains the truth, its
Monte Carlo standard error (from the per-data-set shares: coordinates of one data set are not
independent), the RMSE of the posterior mean, the mean posterior sd, how many fits raised
``FitDiverged`` or warned, and with which warning classes (``warned_by``: fits per class), how many flagged their own intervals (``flagged``: ``result.calibrated`` False) and, for
virtual clients, each fit's ``clip_saturation`` (``pvi.release_saturation``), for an adaptive clip each fit's
``clipped_share`` over its last half of rounds (from the released counts), seconds. With 50 data sets of 6 coordinates the standard error of a
coverage near 0.9 is about 0.02 (0.03 near 0.5), so the issue's bars (0.85-0.95 and 0.42-0.58) are
judged at about two standard errors.

``--clipping default "clip 1" "clip 3" "adaptive 0.95" "adaptive 0.99"`` adds rows for DP optimisation and
global DP-VI with other clippings: a fixed clip (the former default 1, or 3), or Andrew et al.'s private quantile
estimate at other quantiles, against the default (``adaptive_clip="auto"``: the 0.999 quantile, its noisy count
released and accounted): the bias that clipping puts in the posterior against the noise a larger clip brings.

Run from a checkout: ``python benchmarks/coverage.py`` (``--datasets 50``; ``--cells dp_optimisation``
to run some methods only, ``--out`` to write them elsewhere); writes ``benchmarks/results/coverage.json`` (about
90 minutes on 2 cores, half of it the full-rank virtual clients at 10,000 rows).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import late_clipped_share, write  # noqa: E402
from scipy import stats  # noqa: E402

import numpyro_dppvi as dppvi  # noqa: E402
from numpyro_dppvi.diagnostics import FIT_WARNINGS  # noqa: E402
from numpyro_dppvi.example_models import logistic_regression  # noqa: E402
from numpyro_dppvi.vips.linear import BayesianLinearRegression, gaussian_moments  # noqa: E402

COVARIATES = 5
CLIENTS = 10
DELTA = 1e-5
Z50, Z90 = stats.norm.ppf(0.75), stats.norm.ppf(0.95)
BARS = {"cover50": (0.42, 0.58), "cover90": (0.85, 0.95)}


def logistic_data(index: int, n: int):
    """``(x, y, truth)`` of data set ``index``: truth ``(w, b)`` from the prior."""
    rng = np.random.default_rng(1000 + index)
    w, b = rng.normal(size=COVARIATES), rng.normal()
    x = rng.normal(size=(n, COVARIATES)).astype(np.float32)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(x @ w + b)))).astype(np.float32)
    return x, y, np.concatenate([w, [b]])


def loc_and_scale(result) -> tuple[np.ndarray, np.ndarray]:
    post = result.posterior
    loc = np.concatenate([np.ravel(post["w"]["loc"]), np.ravel(post["b"]["loc"])])
    scale = np.concatenate([np.ravel(post["w"]["scale"]), np.ravel(post["b"]["scale"])])
    return loc, scale


#: Clipping of DP optimisation measured beside the default (``--clipping``): the bias-noise trade-off.
CLIPPING = {
    "default": {},
    "clip 1": {"clip": 1.0, "adaptive_clip": None},
    "clip 3": {"clip": 3.0, "adaptive_clip": None},
    "adaptive 0.95": {"adaptive_clip": dppvi.privacy.AdaptiveClip(target_quantile=0.95)},
    "adaptive 0.99": {"adaptive_clip": dppvi.privacy.AdaptiveClip(target_quantile=0.99)},
}


def fit_logistic(method: str, epsilon, x, y, index: int, clipping: str = "default", noise_aware=None):
    """One fit of a cell; ``noise_aware``: the library's default (None) or ``False`` (q as fitted)."""
    clients = dppvi.partition((x, y), num_clients=CLIENTS, seed=index)
    key = jax.random.key(index)
    privacy = None if epsilon is None else dppvi.Privacy(epsilon=float(epsilon), delta=DELTA, **CLIPPING[clipping])
    if method == "pvi":
        return dppvi.fit_dppvi(logistic_regression, clients, rng_key=key)
    aware = {} if noise_aware is None else {"noise_aware": noise_aware}
    if method == "dp_global_vi":
        return dppvi.fit_global_vi(logistic_regression, clients, privacy=privacy, batch_size=100, rng_key=key,
                                   **aware)
    extra = {"batch_size": 100} if method == "dp_optimisation" else {}
    return dppvi.fit_dppvi(logistic_regression, clients, method=method, privacy=privacy, rng_key=key, **extra,
                           **aware)


def vips_data(index: int, n: int):
    rng = np.random.default_rng(5000 + index)
    w = rng.normal(size=COVARIATES)
    x = np.clip(rng.normal(size=(n, COVARIATES)), -3.0, 3.0)
    y = np.clip(x @ w + rng.normal(size=n), -10.0, 10.0)
    return x, y, w


def fit_vips_linear(epsilon, x, y, index: int, noise_aware=None, federated: bool = False):
    """The posterior mean, sd and, per coordinate of ``truth`` later, how far out in the posterior's own central
    intervals the truth lies: returns ``(loc, scale, central, applied)`` with ``central(truth)`` the
    normal-equivalent ``z = Phi^-1((1 + |2 F(truth) - 1|) / 2)`` of the marginal CDF ``F`` (``|loc - truth| / scale``
    for a Gaussian q; for the noise-aware mixture, ``F`` is the mixture of its components' normal CDFs), so that
    ``z < Z50`` says the 50% central interval holds the truth."""
    from scipy.stats import norm

    model = BayesianLinearRegression(COVARIATES, 1.0, feature_bound=3.0 * np.sqrt(COVARIATES), target_bound=10.0)
    privacy = None if epsilon is None else dppvi.Privacy(epsilon=float(epsilon), delta=DELTA)
    aware = {} if noise_aware is None or privacy is None else {"noise_aware": noise_aware}
    if federated:
        clients = dppvi.partition((x, y), num_clients=CLIENTS, seed=index)
        result = dppvi.fit_dppvi(model, clients, method="vips", privacy=privacy, rng_key=jax.random.key(index), **aware)
    else:
        result = dppvi.fit_vips(model, (x, y), privacy=privacy, batch_size=200, rng_key=jax.random.key(index),
                                **aware)
    mean, cov = gaussian_moments(result.params["eta"], result.params["precision"])
    loc, scale = np.asarray(mean, np.float64), np.sqrt(np.diag(np.asarray(cov, np.float64)))
    mixture = result.params.get("mixture")
    if mixture is None:
        weights, means, sds = np.ones(1), loc[None], scale[None]
    else:
        weights = np.asarray(mixture["weights"], np.float64)
        means = np.asarray(mixture["means"], np.float64)
        tril = np.asarray(mixture["scale_tril"], np.float64)
        sds = np.sqrt(np.einsum("kij,kij->ki", tril, tril))

    def central(truth):
        cdf = np.sum(weights[:, None] * norm.cdf((truth[None] - means) / sds), axis=0)
        return norm.ppf(np.clip((1.0 + np.abs(2.0 * cdf - 1.0)) / 2.0, 0.0, 1.0 - 1e-12))

    return loc, scale, central, result.noise_aware


WIDENING_GROUPS = ((0.0, 1.5), (1.5, 2.0), (2.0, 3.0), (3.0, float("inf")))


def against_reference(z: list, locs: list, scales: list, references: list) -> dict:
    """``shrink_slope`` and ``cover90_by_widening`` (module docstring) of a private cell, from its fits' ``z``
    (``|loc - truth| / scale``), means and sds and the non-private reference ``(loc, scale)`` of each data set."""
    z, loc, scale = (np.concatenate(v) for v in (z, locs, scales))
    ref_loc = np.concatenate([r[0] for r in references])
    ref_scale = np.concatenate([r[1] for r in references])
    widening = scale / ref_scale
    groups = {}
    for low, high in WIDENING_GROUPS:
        inside = (widening >= low) & (widening < high)
        name = f"{low:g}-{high:g}" if np.isfinite(high) else f">={low:g}"
        groups[name] = [round(float(np.mean(z[inside] < Z90)), 3) if inside.any() else None, int(inside.sum())]
    return {"shrink_slope": round(float(np.polyfit(ref_loc, loc - ref_loc, 1)[0]), 4), "cover90_by_widening": groups}


_REFERENCES: dict = {}


def reference_fit(x, y, index: int, n: int):
    """The non-private PVI ``(loc, scale)`` of data set ``index`` of size ``n`` (fitted once per process)."""
    if (index, n) not in _REFERENCES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _REFERENCES[index, n] = loc_and_scale(fit_logistic("pvi", None, x, y, index))
    return _REFERENCES[index, n]


def summarise(z: list, errors: list, scales: list, diverged: int, warned: int, seconds: float, count: int,
              flagged: int = 0) -> dict:
    out = {"datasets": count, "diverged": diverged, "warned": warned, "flagged": flagged, "seconds": round(seconds, 1)}
    if not z:
        return out
    z = np.stack(z)  # [datasets, coordinates]: |loc - truth| / scale
    for name, cut in (("cover50", Z50), ("cover90", Z90)):
        per_set = (z < cut).mean(axis=1)
        out[name] = round(float(per_set.mean()), 3)
        out[name + "_se"] = round(float(per_set.std(ddof=1) / np.sqrt(len(per_set))) if len(per_set) > 1 else float("nan"), 3)
        low, high = BARS[name]
        out[name + "_in_bar"] = bool(low <= out[name] <= high)
    out["rmse"] = round(float(np.sqrt(np.mean(np.square(errors)))), 4)
    out["mean_sd"] = round(float(np.mean(scales)), 4)
    return out


def run_cell(method: str, epsilon, n: int, count: int, clipping: str = "default", noise_aware=None) -> dict:
    z, errors, scales, diverged, warned, flagged, refused = [], [], [], 0, 0, 0, []
    saturation = []  # virtual clients: each fit's clip saturation (pvi.release_saturation)
    clipped = []  # an adaptive clip: each fit's clipped share over its last half of rounds
    warned_by: dict = {}  # per warning class, the fits that gave it (issue 60, item 8)
    locs, references = [], []
    start = time.perf_counter()
    applied = None
    for index in range(count):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if method in VIPS_CELLS:
                    x, y, truth = vips_data(index, n)
                    loc, scale, central, applied = fit_vips_linear(epsilon, x, y, index, noise_aware,
                                                                   federated=method == "vips_federated")
                else:
                    x, y, truth = logistic_data(index, n)
                    result = fit_logistic(method, epsilon, x, y, index, clipping, noise_aware)
                    applied = result.noise_aware
                    loc, scale = loc_and_scale(result)
                    flagged += result.calibrated is False
                    if (result.calibration or {}).get("clip_saturation") is not None:
                        saturation.append(result.calibration["clip_saturation"])
                    share = late_clipped_share(result.history)
                    if share is not None:
                        clipped.append(share["share"])
        except dppvi.FitDiverged:
            diverged += 1
            continue
        except ValueError as error:  # settings the accountant cannot meet (e.g. the sampler's charges use up delta)
            refused.append(str(error))
            continue
        warned += any(issubclass(w.category, FIT_WARNINGS) for w in caught)
        for name in {w.category.__name__ for w in caught if issubclass(w.category, FIT_WARNINGS)}:
            warned_by[name] = warned_by.get(name, 0) + 1
        z.append(central(truth) if method in VIPS_CELLS else np.abs(loc - truth) / scale)
        errors.append(loc - truth)
        scales.append(scale)
        if method not in VIPS_CELLS and epsilon is not None:
            locs.append(loc)
            references.append(index)
    seconds = time.perf_counter() - start
    extra = {}
    if references:  # fitted after the clock stopped
        extra = against_reference(z, locs, scales, [reference_fit(*logistic_data(i, n)[:2], i, n) for i in references])
    return dict(method=method, epsilon=epsilon, n=n, **({} if clipping == "default" else {"clipping": clipping}),
                noise_aware=applied, **summarise(z, errors, scales, diverged, warned, seconds, count, flagged), **extra,
                **({"clip_saturation": saturation} if saturation else {}),
                **({"clipped_share": clipped} if clipped else {}), **{"warned_by": warned_by},
                **({"refused": len(refused), "refusal": refused[0][:300]} if refused else {}))


def cells(methods) -> list[tuple]:
    out = []
    for method in methods:
        if method in VIPS_CELLS:
            out += [(method, eps, 2000) for eps in (None, 1, 8)]
            continue
        for n in (2000, 10000):
            out += [(method, None, n)] if method == "pvi" else [(method, eps, n) for eps in (1, 8)]
    return out


def expected_calibration_error(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    """ECE of predictive probabilities ``p = P(y = 1)``: ``sum_b (n_b / n) |mean p_b - mean y_b|`` over
    ``bins`` equal-width bins."""
    index = np.minimum((p * bins).astype(int), bins - 1)
    return float(sum(np.mean(index == b) * abs(p[index == b].mean() - y[index == b].mean())
                     for b in range(bins) if np.any(index == b)))


def adult_calibration(keys: int = 3) -> list[dict]:
    """UCI Adult, 10 clients: test accuracy and the ECE of the posterior predictive probabilities of the
    non-private defaults and of DP optimisation at epsilon 1 (batches of 100) with each clipping."""
    from numpyro_dppvi.evaluation import log_predictive_density

    x, y, x_test, y_test = dppvi.datasets.load_adult(split="train_test")
    clients = dppvi.partition((x, y), num_clients=CLIENTS, seed=0)
    runs = [("pvi", "default", 0)] + [("dp_optimisation", c, k) for k in range(keys) for c in ("default", "clip 1")]
    out = []
    for method, clipping, key in runs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if method == "pvi":
                result = dppvi.fit_dppvi(logistic_regression, clients, rng_key=jax.random.key(key))
            else:
                result = dppvi.fit_dppvi(logistic_regression, clients, method=method, batch_size=100,
                                         privacy=dppvi.Privacy(epsilon=1.0, delta=DELTA, **CLIPPING[clipping]),
                                         rng_key=jax.random.key(key))
        lpd = np.asarray(log_predictive_density(result.adapter, result.q, (x_test, y_test), jax.random.key(5), 200))
        p1 = np.where(y_test == 1, np.exp(lpd), 1.0 - np.exp(lpd))
        out.append({"method": method, "clipping": clipping, "key": key,
                    "epsilon": None if method == "pvi" else round(float(result.privacy.epsilon), 4),
                    "accuracy": round(float(np.mean((p1 > 0.5) == (y_test == 1))), 4),
                    "ece": round(expected_calibration_error(p1, np.asarray(y_test, float)), 4)})
        print(out[-1], flush=True)
    return out


METHODS = ("pvi", "dp_optimisation", "virtual_clients", "dp_global_vi", "vips_linear", "vips_federated")
VIPS_CELLS = ("vips_linear", "vips_federated")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=50)
    parser.add_argument("--cells", nargs="*", default=list(METHODS) + ["adult"], choices=list(METHODS) + ["adult"])
    parser.add_argument("--clipping", nargs="*", default=["default"], choices=list(CLIPPING),
                        help="clippings of dp_optimisation and dp_global_vi to measure (others: the default only)")
    parser.add_argument("--out", default=None, help="folder of the JSON (default: see benchmarks/_common.py)")
    parser.add_argument("--modes", nargs="*", default=["default", "off"], choices=["default", "off"],
                        help="the library's default (noise-aware where available) and noise_aware=False")
    args = parser.parse_args(argv)
    rows = []
    for method, epsilon, n in cells([c for c in args.cells if c != "adult"]):
        private_sgd = method in ("dp_optimisation", "dp_global_vi")
        modes = ["default"] if epsilon is None else args.modes
        for clipping in (args.clipping if private_sgd else ["default"]):
            for mode in modes:
                row = run_cell(method, epsilon, n, args.datasets, clipping, None if mode == "default" else False)
                rows.append(row)
                print({k: v for k, v in row.items() if not k.endswith("_in_bar")}, flush=True)
    result = {"note": "each private cell with the defaults (noise_aware as the fit applied it) and with "
                      "noise_aware=False; 'noise_aware' in a row says whether the fit's q was noise-aware",
              "bars": BARS, "cells": rows}
    if "adult" in args.cells:
        result["adult"] = adult_calibration()
    write("coverage", result, args.out)
    return result


if __name__ == "__main__":
    main()
