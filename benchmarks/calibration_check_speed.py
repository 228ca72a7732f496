"""What a calibration check costs (issue 59): ``num_datasets`` simulated fits against one first fit of a fresh process.

In each of ``--processes`` new processes: one private DP optimisation fit of the zoo's 20-group hierarchical logistic
regression (5 clients of 400 rows, epsilon 2, batches of 100: the issue's model) with empty caches, timed from the
call (its programs compiled, its noise calibrated), then ``dppvi.calibration_check(model, covariates, result,
num_datasets=20)`` on the same settings, timed whole (parameter draws, simulation, the 20 fits, scoring). The
simulated fits share the first fit's compiled programs and accountant (a second fit compiles nothing), so the
check costs about 20 second fits. Target: the check at most 3x the first fit. Reported: each process's pair and
their ratio, and the ratio of the medians.

Run from a checkout: ``python benchmarks/calibration_check_speed.py`` (``--processes 3``); writes
``benchmarks/results/calibration_check_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time, warnings
sys.path.insert(0, {root!r})
import jax
import numpyro_dppvi as dppvi
from tests import calibration_zoo_models as Z
warnings.simplefilter("ignore")
covariates = Z.client_covariates("hier_logistic_centred", 2000)
model = Z.ZOO["hier_logistic_centred"].model
from numpyro_dppvi.simulation_calibration import prior_draw, simulate_client
truth = {{k: v for k, v in prior_draw(model, covariates[0], jax.random.key(99)).items() if k != "y"}}
clients = [simulate_client(model, c, truth, jax.random.key(m)) for m, c in enumerate(covariates)]  # the "user's" data
privacy = dppvi.Privacy(epsilon=2.0, delta=1e-5, public_sizes=[400] * 5)
start = time.perf_counter()
result = dppvi.fit_dppvi(model, clients, method="dp_optimisation", batch_size=100, privacy=privacy,
                         rng_key=jax.random.key(0))
first = time.perf_counter() - start
start = time.perf_counter()
check = dppvi.calibration_check(model, covariates, result, num_datasets={datasets}, rng_key=jax.random.key(1))
seconds = time.perf_counter() - start
print(json.dumps({{"first_fit_s": first, "check_s": seconds, "cover90": check.coverage(0.9)[0]}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--datasets", type=int, default=20)
    args = parser.parse_args()
    from _common import write

    runs = []
    for _ in range(args.processes):
        out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), datasets=args.datasets)],
                             check=True, capture_output=True, text=True)
        run = json.loads(out.stdout.strip().splitlines()[-1])
        run["ratio"] = run["check_s"] / run["first_fit_s"]
        runs.append(run)
        print(f"first fit {run['first_fit_s']:.2f} s, check of {args.datasets} fits {run['check_s']:.2f} s: "
              f"{run['ratio']:.2f}x", flush=True)
    first = statistics.median(r["first_fit_s"] for r in runs)
    check = statistics.median(r["check_s"] for r in runs)
    write("calibration_check_speed", {
        "datasets": args.datasets, "runs": runs, "first_fit_median_s": first, "check_median_s": check,
        "ratio_of_medians": check / first, "target": "check <= 3x one first fit of a fresh process"})


if __name__ == "__main__":
    main()
