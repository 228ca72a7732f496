"""The cost of ``family="full_rank"`` and ``family="low_rank"`` against mean-field as the dimension grows (issue 22).

A logistic regression with ``D`` covariates (``D`` = 10, 100, 500; ``D + 1`` latents), 4 clients of 500
rows, non-private PVI with the defaults of each family (20 local steps, 10 antithetic draws, the whole
client per step). Per family and ``D``: the seconds of one sequential round (the second call of the
compiled round, median of ``--repeats``; both families interleaved, so drift in the machine's speed
hits both alike) and the bytes of the fit's state (``q``, the client factors and the asynchronous
schedule's ``q_seen``: ``O(M D)`` for mean-field, ``O(M D^2)`` for full-rank). A full-rank step costs
``D`` gradient evaluations of the batch per draw (the exact expected Hessian; ``O(|B| D^2)`` for a GLM)
and an ``O(D^3)`` Cholesky factorisation. ``low_rank`` (rank ``round(sqrt(D))``, the same sequential round) stores
``O(M D r)`` but takes the same dense Newton steps in this version, plus the decomposition of each answer and the
server's rebase of every factor.

Run from a checkout: ``python benchmarks/full_rank_scaling.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import time_interleaved, write  # noqa: E402

from numpyro_dppvi.example_models import logistic_regression as logistic  # noqa: E402
from numpyro_dppvi.pvi.driver import DPPVI  # noqa: E402


def clients(dim: int, num_clients: int = 4, rows: int = 500, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_clients * rows, dim)).astype(np.float32) / np.sqrt(dim)
    y = (rng.random(len(x)) < 1 / (1 + np.exp(-x @ rng.normal(size=dim)))).astype(np.float32)
    return [(x[i::num_clients], y[i::num_clients]) for i in range(num_clients)]


def state_bytes(state) -> int:
    return int(sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves((state.q, state.factors, state.q_seen))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="*", default=[10, 100, 500])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    for dim in args.dims:
        data = clients(dim)
        calls, sizes = {}, {}
        for family in ("mean_field", "full_rank", "low_rank"):
            driver = DPPVI(logistic, family=family, schedule="sequential")
            state = driver.init(jax.random.key(0), data)
            limits = driver.limits(state, 1)
            calls[family] = lambda driver=driver, state=state, limits=limits: driver._round(
                state, driver.data, driver.mask, driver.sizes, limits)[0].q
            sizes[family] = state_bytes(state)
        timing = time_interleaved(calls, args.repeats)
        row = {"dimension": dim + 1, "state_bytes": sizes,
               "round_seconds": {f: timing[f]["median_s"] for f in calls},
               "full_rank_over_mean_field": timing["full_rank"]["median_s"] / timing["mean_field"]["median_s"],
               "low_rank_over_mean_field": timing["low_rank"]["median_s"] / timing["mean_field"]["median_s"]}
        rows.append(row)
        print(f"D={dim + 1:4d} round: mean-field {row['round_seconds']['mean_field']:.3f} s, full-rank "
              f"{row['round_seconds']['full_rank']:.3f} s ({row['full_rank_over_mean_field']:.1f}x), low-rank "
              f"{row['round_seconds']['low_rank']:.3f} s ({row['low_rank_over_mean_field']:.1f}x); state "
              f"{sizes['mean_field'] / 1e6:.2f} MB vs {sizes['full_rank'] / 1e6:.2f} MB vs "
              f"{sizes['low_rank'] / 1e6:.2f} MB", flush=True)
    write("full_rank_scaling", {"settings": "logistic regression, 4 clients x 500 rows, sequential round, "
                                            "20 local steps, 10 draws, whole client per step", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
