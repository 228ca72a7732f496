"""Which damping and rounds let virtual clients cover, cell by cell of the coverage study (issue 23).

Virtual clients' intervals miss in all four cells of ``benchmarks/coverage.py`` at the defaults (synchronous, damping
0.1, 10 rounds). Two causes pull against each other. A virtual factor keeps ``(1 - rho)^(R - r)`` of what it
answered in round ``r``, so the mean of ``q`` is a weighted average of answers linearised at earlier, worse
locations (the default's weights are nearly uniform over the 10 rounds); and a mean-field synchronous round is a
Jacobi step, slow where the posterior's coordinates are coupled. At a negligible noise damping 1 for 4 rounds is as
far off as the default (``benchmarks/vc_convergence.py``): the fit needs many rounds at a large damping. But the
noise the releases leave in ``q`` is ``W = M R rho^2 sigma_R^2 C^2`` per coordinate (``sigma_R`` growing as
``sqrt(R)``), so a large damping drowns the fit where the data per unit of noise is small.

This measures, per cell ``(rows, epsilon)`` and per ``(rounds, damping)``, on the coverage study's logistic
regression (``coverage.logistic_data``, 10 clients, the default noise-aware posterior): the 50% / 90% coverage,
the RMSE of the mean and the mean sd, and ``sqrt(W) / Lambda``, the sd of the noise the releases leave in a
precision over the posterior's precision (``Lambda = 1 / sd^2`` of non-private PVI on the same data, averaged over
coordinates and data sets). A rule for the damping from public values would choose the damping by that ratio.

Measured (``benchmarks/results/vc_damping.json``, 8 data sets a setting: a screen; the best setting of each cell
re-measured on 50 data sets in ``vc_damping_50.json``): 20 synchronous rounds at the largest damping whose ratio
stays near 0.05 cut the RMSE in three cells (epsilon 8 / 2,000 rows, damping 0.25: .105 against the default's .142;
epsilon 1 / 10,000, 0.25: .095 against .127; epsilon 8 / 10,000, 0.5: .048 against .126) and their 90% intervals
cover 0.82-0.83 on 50 data sets (0.92-0.98 on the screen's 8: its coverage varies by data set more than the
screen's size can show); at epsilon 1 / 2,000 rows no setting does better than the default. One setting for every
cell does not exist (``vc_damping_one_setting.json``, 50 data sets: ``--only 2000,1,20,0.25 10000,8,20,0.25
2000,1,20,0.1``): 20 rounds at 0.25 cover .84 / .45 at epsilon 1 / 2,000 rows with RMSE .398 (twice the default's)
and .72 / .37 at epsilon 8 / 10,000 rows; 20 rounds at 0.1 at epsilon 1 / 2,000 rows .81 / .42, RMSE .201. No
mean-field setting reaches 0.85 at 90% in any cell (best .837).

With ``--family full_rank`` the fits' factors are full-rank and their posterior eq. (3) of ``pvi/release_noise.py``
(the precision's off-diagonal in ``q``), 50 data sets a cell (``results/vc_damping_full_rank.json``): 20 rounds at
damping 0.25, epsilon 8 / 2,000 rows, cover .92 / .52 with RMSE .116; 20 rounds at 0.5, epsilon 8 / 10,000 rows,
.92 / .55 with RMSE .050 (both in the bar); at epsilon 1 the noise of 27 coordinates throws fits about: 20 rounds at
0.25 cover .91 / .53 with RMSE 2.04 (10,000 rows) and .90 / .60 with RMSE 189 (2,000 rows), every fit warning.

The releases' clip (``--only ROWS,EPSILON,ROUNDS,DAMPING,CLIP``; default 1) decides full-rank at epsilon 1
(``results/vc_damping_clip.json``, 8 data sets a setting, 20 rounds at damping 0.25): at 10,000 rows clip 0.5 covers
.94 / .46 with RMSE .063; at 2,000 rows clip 0.25 .88 / .56 with RMSE .307 (clip 1: 4.6; mean-field's default .189).
On 50 data sets a cell (``results/vc_damping_clip_50.json``, ``--datasets 50 --only 10000,1,20,0.25,0.5
2000,8,20,0.25,0.5 10000,8,20,0.5,0.5 2000,1,20,0.25,0.25``), every cell covers in the bar: epsilon 1 / 2,000 rows
(clip 0.25) .86 / .46, RMSE .228 (the default's .189); epsilon 8 / 2,000 (clip 0.5) .90 / .52, .084 (.142); epsilon
1 / 10,000 (clip 0.5) .91 / .58, .067 (.127); epsilon 8 / 10,000 (clip 0.5, damping 0.5) .92 / .55, .037 (.126);
and at damping 0.25 (``--only 10000,8,20,0.25,0.5``, a second run, its row appended) .87 / .52, .039.

Why no one clip serves (``results/vc_damping_travel.json``). A virtual factor moves at most ``rho C`` a round (its
change is clipped, then damped), ``rho C R`` in ``R`` rounds: clipping does not move the fixed point (there every
change is 0) but it caps how far a factor travels, and a factor that has not arrived is the "bias" of a small clip.
The noise the releases leave in ``q`` grows as ``rho C sqrt(R) sigma_R`` with ``sigma_R ~ sqrt(R)``, i.e. also with
``rho C R``: measured, clip 0.25 for 40 rounds leaves the same noise in a precision as clip 0.5 for 20 (0.0235
against 0.0234 of the precision, epsilon 1 / 10,000 rows, 8 data sets) and covers about alike (.88 / .46, RMSE .094;
.94 / .46, .063). So the travel ``rho C R`` is the one setting, and the best travel falls as the noise per record
(``sigma_R / n_m``) grows: at clip 0.35 (travel 1.75), epsilon 1 / 2,000 rows covers .86 / .46 with RMSE .263 on 50
data sets (clip 0.5: .81 / .45, .339; clip 0.25: .86 / .46, .228), but epsilon 1 / 10,000 rows covers .81 / .52
and epsilon 8 / 10,000 rows .50 / .17 (RMSE .087; clip 0.5: .87 / .52, .039) on 8: where the noise is small the
factors need the travel. The travel a model needs is the size of its one-record factors (a property of the data),
so a default needs that size estimated privately, and the noise per record to choose against.

Run from a checkout: ``python benchmarks/vc_damping.py`` (``--datasets 8``, about 15 minutes on 2 cores);
``--only 2000,8,20,0.25 ... --datasets 50 --name vc_damping_50`` re-measures chosen settings on more data sets.
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

import numpyro_dppvi as dppvi  # noqa: E402
from _common import write  # noqa: E402
from coverage import CLIENTS, DELTA, Z50, Z90, loc_and_scale, logistic_data, reference_fit  # noqa: E402
from numpyro_dppvi.example_models import logistic_regression  # noqa: E402

#: ``(rows, epsilon)`` -> ``(rounds, damping)`` settings; the first of each is the method's default.
SETTINGS = {
    (2000, 1.0): ((10, 0.1), (20, 0.05), (20, 0.1), (20, 0.2)),
    (2000, 8.0): ((10, 0.1), (20, 0.25), (20, 0.5)),
    (10000, 1.0): ((10, 0.1), (20, 0.15), (20, 0.25), (20, 0.5)),
    (10000, 8.0): ((10, 0.1), (20, 0.25), (20, 0.5)),
}


def noise_std(clients, epsilon: float, rounds: int, clip: float = 1.0) -> float:
    """``sigma_R C`` the plan gives each client's release (public: the ledger's events)."""
    driver = dppvi.DPPVI(logistic_regression, method="virtual_clients", rounds=rounds,
                         privacy=dppvi.Privacy(epsilon=epsilon, delta=DELTA, clip=clip))
    state = driver.init(jax.random.key(0), clients)
    return float(np.max(np.asarray(state.client_state["noise_std"])))


def setting_row(n: int, epsilon: float, rounds: int, damping: float, count: int, family: str = "mean_field",
                clip: float = 1.0) -> dict:
    z, errors, scales, precisions, failed = [], [], [], [], 0
    start = time.perf_counter()
    std = None
    for index in range(count):
        x, y, truth = logistic_data(index, n)
        clients = dppvi.partition((x, y), num_clients=CLIENTS, seed=index)
        if std is None:
            std = noise_std(clients, epsilon, rounds, clip)
        try:
            result = dppvi.fit_dppvi(logistic_regression, clients, method="virtual_clients", rounds=rounds,
                                     damping=damping, privacy=dppvi.Privacy(epsilon=epsilon, delta=DELTA, clip=clip),
                                     rng_key=jax.random.key(index), family=family)
        except dppvi.FitDiverged:
            failed += 1
            continue
        loc, scale = loc_and_scale(result)
        z.append(np.abs(loc - truth) / scale)
        errors.append(loc - truth)
        scales.append(scale)
        precisions.append(1.0 / np.square(reference_fit(x, y, index, n)[1]))
    z = np.stack(z)
    noise = np.sqrt(CLIENTS * rounds) * damping * std  # sqrt(W): M R rho^2 sigma_R^2 C^2
    return {"n": n, "epsilon": epsilon, "family": family, "clip": clip, "rounds": rounds, "damping": damping,
            "datasets": count,
            "diverged": failed,
            "cover50": round(float(np.mean(z < Z50)), 3), "cover90": round(float(np.mean(z < Z90)), 3),
            "rmse": round(float(np.sqrt(np.mean(np.square(errors)))), 4),
            "mean_sd": round(float(np.mean(scales)), 4), "noise_std_per_release": round(std, 3),
            "precision_noise_over_precision": round(float(noise / np.mean(precisions)), 4),
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=8)
    parser.add_argument("--only", nargs="*", default=None, metavar="ROWS,EPSILON,ROUNDS,DAMPING[,CLIP]",
                        help="these settings instead of the screen's, e.g. 2000,8,20,0.25 or 2000,1,20,0.25,0.5")
    parser.add_argument("--name", default="vc_damping", help="name of the JSON")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="the releases' clip C (Privacy(clip=...)) where a setting does not give one")
    parser.add_argument("--family", default="mean_field", choices=("mean_field", "full_rank"),
                        help="the factors' family (full-rank: eq. 3 of pvi/release_noise.py)")
    parser.add_argument("--out", default=None, help="folder of the JSON (default: see benchmarks/_common.py)")
    args = parser.parse_args(argv)
    if args.only is None:
        chosen = [(n, epsilon, rounds, damping, args.clip) for (n, epsilon), settings in SETTINGS.items()
                  for rounds, damping in settings]
    else:
        chosen = [(int(n), float(e), int(r), float(d), float(c[0]) if c else args.clip)
                  for n, e, r, d, *c in (s.split(",") for s in args.only)]
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fits' warnings are not the measure
        for n, epsilon, rounds, damping, clip in chosen:
            rows.append(setting_row(n, epsilon, rounds, damping, args.datasets, args.family, clip))
            print(rows[-1], flush=True)
    result = {"setting": "coverage study's logistic regression (d = 5 and an intercept, 10 clients), virtual "
                         "clients, synchronous, noise-aware (the default), delta 1e-5",
              "rows": rows}
    write(args.name, result, args.out)
    return result


if __name__ == "__main__":
    main()
