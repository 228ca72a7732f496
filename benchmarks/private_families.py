"""Private fits of a correlated posterior: mean-field against full-rank factors (issue 22).

A logistic regression with ``D = 3`` covariates correlated ``0.9`` (no intercept; weights from the
``N(0, I)`` prior), 2000 rows in 10 clients, ``--datasets`` data sets. The yardstick of each data set is
the non-private full-rank PVI fit (``family="full_rank"``, run to convergence: within 0.01-0.02 sd of
NUTS and sd ratios 0.97-1.02 on such models, ``benchmarks/fidelity.py``). For each private method
(defaults otherwise: 10 rounds, ``Privacy(epsilon, delta=1e-5)``; global DP-VI: ``fit_global_vi``'s
defaults, 1000 DP-SGD steps on the pooled data) and family: the largest error of the
posterior mean in the reference's posterior sds, and the ratio of each sd to the reference's.

Run from a checkout: ``python benchmarks/private_families.py`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from _common import write  # noqa: E402

import numpyro_dppvi as dppvi  # noqa: E402
from numpyro_dppvi import factors  # noqa: E402

METHODS = {
    "dp_optimisation (batch 100)": dict(method="dp_optimisation", batch_size=100),
    "global DP-VI (batch 100)": dict(method="global_vi"),
    "virtual_clients": dict(method="virtual_clients"),
    "virtual_clients, trusted aggregator": dict(method="virtual_clients", trusted_aggregator=True),
    "local_averaging (batch 100)": dict(method="local_averaging", batch_size=100),
}


@dppvi.model
def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def data(seed: int, n: int = 2000, dim: int = 3, correlation: float = 0.9, num_clients: int = 10):
    rng = np.random.default_rng(seed)
    cov = correlation * np.ones((dim, dim)) + (1 - correlation) * np.eye(dim)
    x = rng.multivariate_normal(np.zeros(dim), cov, size=n, method="cholesky").astype(np.float32)  # unique, unlike the SVD
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-x @ rng.normal(size=dim)))).astype(np.float32)
    return [(x[i::num_clients], y[i::num_clients]) for i in range(num_clients)]


def moments(result):
    mean, precision = factors.mean_and_precision(factors.as_family(result.q, "full_rank"))
    return np.asarray(mean, np.float64), np.linalg.inv(np.asarray(precision, np.float64))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=3)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0])
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    rows = []
    for seed in range(args.datasets):
        clients = data(seed)
        reference = dppvi.fit_dppvi(logistic, clients, family="full_rank", rng_key=jax.random.key(seed))
        ref_mean, ref_cov = moments(reference)
        ref_sd = np.sqrt(np.diag(ref_cov))
        for epsilon in args.epsilons:
            for name, settings in METHODS.items():
                for family in ("mean_field", "full_rank"):
                    start = time.perf_counter()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        privacy = dppvi.Privacy(epsilon=epsilon, delta=1e-5)
                        try:
                            if settings["method"] == "global_vi":
                                fit = dppvi.fit_global_vi(logistic, clients, family=family, privacy=privacy,
                                                          rng_key=jax.random.key(100 + seed))
                            else:
                                fit = dppvi.fit_dppvi(logistic, clients, family=family, privacy=privacy,
                                                      rng_key=jax.random.key(100 + seed), **settings)
                        except ValueError as refused:  # e.g. a budget whose delta the sampler's charges use up
                            row = {"dataset": seed, "epsilon": epsilon, "method": name, "family": family,
                                   "refused": str(refused)}
                            print(row, flush=True)
                            rows.append(row)
                            continue
                    mean, cov = moments(fit)
                    row = {"dataset": seed, "epsilon": epsilon, "method": name, "family": family,
                           "mean_error_sd": float(np.max(np.abs(mean - ref_mean) / ref_sd)),
                           "sd_ratios": [round(float(v), 3) for v in np.sqrt(np.diag(cov)) / ref_sd],
                           "warnings": sorted({type(w.message).__name__ for w in caught}),
                           "seconds": round(time.perf_counter() - start, 2)}
                    print(row, flush=True)
                    rows.append(row)
    summary = {}
    for epsilon in args.epsilons:
        for name in METHODS:
            for family in ("mean_field", "full_rank"):
                sel = [r for r in rows if r["epsilon"] == epsilon and r["method"] == name and r["family"] == family
                       and "refused" not in r]
                if not sel:
                    summary[f"eps {epsilon:g} | {name} | {family}"] = {"refused": True}
                    continue
                ratios = [v for r in sel for v in r["sd_ratios"]]
                errors = [r["mean_error_sd"] for r in sel]
                summary[f"eps {epsilon:g} | {name} | {family}"] = {
                    "mean error in sds, least": round(min(errors), 2), "mean error in sds, largest": round(max(errors), 2),
                    "sd ratio, least": round(min(ratios), 2), "sd ratio, largest": round(max(ratios), 2)}
    path = write("private_families", {
        "setting": "logistic regression, 3 covariates correlated 0.9, 2000 rows, 10 clients, 10 rounds, "
                    "delta 1e-5; reference: non-private full-rank PVI", "summary": summary, "rows": rows},
                 args.out)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
