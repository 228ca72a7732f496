"""How far a default virtual-clients fit stops from where its ``q`` settles (issue 23).

A fit that warns ``ConvergenceWarning`` says its ``q`` was still moving when the planned rounds ended. This
measures how far from where it settles: each default fit (``fit_dppvi(method="virtual_clients")`` on the coverage
study's logistic regression, ``benchmarks/coverage.py``) is run again for 60 rounds with the *same* noise multiplier,
clip, damping and key, so that its first rounds reproduce the default fit exactly (checked), and the settled point
is the mean of rounds 41-60 (precision averaged likewise). Reported per data set: the warnings the default fit gave
and the largest distance of its mean from the settled one, in the settled ``q``'s sds. The continuation adds the
noise of 40 more releases, which moves ``q`` too: a distance well under 1 sd says little either way, a steady one
of several says the fit stopped short.

Measured (``results/vc_settle.json``, epsilon 8 / 2,000 rows, 5 data sets, full-rank defaults: 20 rounds, damping
0.25, clip 0.5): every fit warned that ``q`` was still moving, and they end 0.51-1.25 sd from where they settle
(median 0.80).

Run from a checkout: ``python benchmarks/vc_settle.py --rows 2000 --epsilon 8 --datasets 5`` (about 3 minutes on
2 cores).
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
from coverage import CLIENTS, DELTA, logistic_data  # noqa: E402
from numpyro_dppvi import factors  # noqa: E402
from numpyro_dppvi.example_models import logistic_regression  # noqa: E402

CONTINUED, SETTLED_FROM = 60, 40


def settle_row(index: int, rows: int, epsilon: float) -> dict:
    x, y, _ = logistic_data(index, rows)
    clients = dppvi.partition((x, y), num_clients=CLIENTS, seed=index)
    key = jax.random.key(index)
    privacy = dppvi.Privacy(epsilon=epsilon, delta=DELTA)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = dppvi.fit_dppvi(logistic_regression, clients, method="virtual_clients", privacy=privacy, rng_key=key)
    warned = sorted({w.category.__name__ for w in caught if issubclass(w.category, dppvi.diagnostics.FIT_WARNINGS)})
    config = fit.config
    planned = dppvi.DPPVI(logistic_regression, method="virtual_clients", rounds=config["planned_rounds"],
                          privacy=privacy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned.init(key, clients)
        moments = []
        dppvi.fit_dppvi(logistic_regression, clients, method="virtual_clients", rounds=CONTINUED,
                        family=config["family"], damping=config["damping"], noise_aware=False, rng_key=key,
                        privacy=dppvi.Privacy(noise_multiplier=float(np.max(planned.plan.noise_multipliers)),
                                              clip=planned.privacy.clip, delta=DELTA),
                        callback=lambda state, entry: moments.append(
                            factors.mean_and_precision(factors.Gaussian(*state.q))))
    mean, _ = factors.mean_and_precision(factors.Gaussian(*map(np.asarray, fit.q_fitted)))
    stopped = moments[config["planned_rounds"] - 1][0]
    np.testing.assert_allclose(stopped, mean, rtol=1e-4, atol=1e-5)  # the continuation reproduces the fit
    settled = np.mean([m for m, _ in moments[SETTLED_FROM:]], axis=0)
    sd = np.sqrt(np.diag(np.linalg.inv(np.mean([p for _, p in moments[SETTLED_FROM:]], axis=0))))
    return {"dataset": index, "warned": warned, "clip": round(float(planned.privacy.clip), 4),
            "family": config["family"], "rounds": config["planned_rounds"], "damping": config["damping"],
            "sd_from_settled": round(float(np.max(np.abs(stopped - settled) / sd)), 3)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--datasets", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder of the JSON (default: see benchmarks/_common.py)")
    args = parser.parse_args(argv)
    rows = []
    for index in range(args.datasets):
        rows.append(settle_row(index, args.rows, args.epsilon))
        print(rows[-1], flush=True)
    distances = [r["sd_from_settled"] for r in rows]
    result = {"setting": f"coverage study's logistic regression, {args.rows} rows, epsilon {args.epsilon}, delta "
                         f"{DELTA}, 10 clients: the default virtual-clients fit, and the same noise continued to "
                         f"{CONTINUED} rounds (settled: the mean of rounds {SETTLED_FROM + 1}-{CONTINUED})",
              "rows": rows, "median_sd_from_settled": float(np.median(distances)),
              "max_sd_from_settled": float(np.max(distances))}
    write("vc_settle", result, args.out)
    return result


if __name__ == "__main__":
    main()
