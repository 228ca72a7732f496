"""How far virtual clients are from their fixed point after a fit, without the noise (issue 23).

The coverage study (``benchmarks/coverage.py``) finds the intervals of virtual clients too narrow at large
``N_m / sigma`` (many rows per client per unit of noise). This separates the two causes: it fits the coverage
study's logistic regression (``coverage.logistic_data``, 10 clients) with ``method="virtual_clients"`` at a
negligible noise (noise multiplier 0.01, clip 1, the RDP accountant: the privacy is meaningless, the
mechanism's path is the fit's own), so that what is left is the schedule's, and compares the posterior mean
with non-private PVI's (the same data set, its defaults).

Per schedule (``synchronous`` or ``sequential``, damping ``rho``, ``R`` rounds) and number of rows: the RMS and
the maximum over (data set, coordinate) of ``(mean - reference mean) / reference sd``, and the mean of
``sd / reference sd``. A virtual factor moves ``rho`` times its clipped change a round, so ``R`` rounds at
``rho`` leave it short of its fixed point; the noise a fit adds grows as ``rho^2 R sigma^2`` (``sigma`` itself
with ``R``), which is the trade-off a schedule makes.

Measured (``benchmarks/results/vc_convergence.json``, releases centred on ``q``'s mean): the default (synchronous,
damping 0.1, 10 rounds) is about 1.65 sd RMS off at 10,000 rows (1.8 before the releases were centred); the
sequential schedule at damping 0.5 comes within 0.43 sd in 10 rounds (0.34 before).

Run from a checkout: ``python benchmarks/vc_convergence.py`` (``--datasets 4``, about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import numpyro_dppvi as dppvi  # noqa: E402
from _common import write  # noqa: E402
from coverage import CLIENTS, loc_and_scale, logistic_data  # noqa: E402
from numpyro_dppvi.example_models import logistic_regression  # noqa: E402

#: ``(name, schedule, damping, rounds)``; the first is the method's default.
SCHEDULES = (("synchronous, damping 0.1, 10 rounds (default)", "synchronous", 0.1, 10),
             ("synchronous, damping 0.1, 40 rounds", "synchronous", 0.1, 40),
             ("synchronous, damping 0.5, 10 rounds", "synchronous", 0.5, 10),
             ("sequential, damping 0.1, 10 rounds", "sequential", 0.1, 10),
             ("sequential, damping 0.25, 10 rounds", "sequential", 0.25, 10),
             ("sequential, damping 0.5, 10 rounds", "sequential", 0.5, 10))
#: A noise multiplier small enough that the fit's path is its schedule's (the RDP accountant: PLD's grid
#: would not hold it).
NEGLIGIBLE_NOISE = dict(noise_multiplier=0.01, clip=1.0, accountant="rdp")


def deviations(n: int, count: int) -> list[dict]:
    """One row per schedule: the deviation of the virtual-clients mean from non-private PVI's, in its sds."""
    dev = {name: [] for name, *_ in SCHEDULES}
    ratio = {name: [] for name, *_ in SCHEDULES}
    for index in range(count):
        x, y, _ = logistic_data(index, n)
        clients = dppvi.partition((x, y), num_clients=CLIENTS, seed=index)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reference's and the fits' own warnings are not the measure
            reference = dppvi.fit_dppvi(logistic_regression, clients, rng_key=jax.random.key(index))
            ref_loc, ref_scale = loc_and_scale(reference)
            for name, schedule, damping, rounds in SCHEDULES:
                result = dppvi.fit_dppvi(logistic_regression, clients, method="virtual_clients",
                                         privacy=dppvi.Privacy(**NEGLIGIBLE_NOISE), schedule=schedule,
                                         damping=damping, rounds=rounds, rng_key=jax.random.key(index))
                loc, scale = loc_and_scale(result)
                dev[name].append((loc - ref_loc) / ref_scale)
                ratio[name].append(scale / ref_scale)
    rows = []
    for name, schedule, damping, rounds in SCHEDULES:
        d, r = np.concatenate(dev[name]), np.concatenate(ratio[name])
        rows.append({"n": n, "schedule": schedule, "damping": damping, "rounds": rounds, "datasets": count,
                     "rms_deviation_sd": round(float(np.sqrt(np.mean(d ** 2))), 3),
                     "max_deviation_sd": round(float(np.max(np.abs(d))), 3),
                     "mean_sd_ratio": round(float(np.mean(r)), 3)})
        print(name, rows[-1], flush=True)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="*", default=[2000, 10000])
    parser.add_argument("--out", default=None, help="folder of the JSON (default: see benchmarks/_common.py)")
    args = parser.parse_args(argv)
    rows = [row for n in args.rows for row in deviations(n, args.datasets)]
    result = {"setting": "coverage study's logistic regression, 10 clients, virtual clients at noise multiplier "
                         "0.01 (clip 1), against non-private PVI's defaults on the same data set",
              "rows": rows}
    write("vc_convergence", result, args.out)
    return result


if __name__ == "__main__":
    main()
