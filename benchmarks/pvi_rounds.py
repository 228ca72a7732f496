"""Time and peak memory of one synchronous PVI round at 10, 100 and 1000 clients (issue 13).

Each client holds 100 rows drawn (with replacement) from UCI Adult (108 features + bias; logistic
regression), 10 local steps, 10 Monte Carlo draws. For each number of clients M, in a process of
its own (so that its peak resident memory is its own): the non-private round (uniform batches of 10)
and the DP-optimisation round (Poisson batches of expected size 10, clip 2, noise multiplier 1),
second call, median of ``repeats``; the process's peak RSS before the fits are built (imports, JAX, the data:
the same at every M) and after the rounds, their difference (the fits' memory) and its growth per client.
Reported: seconds per round, seconds per client, the DP / non-private ratio at each M, and the memory. Targets: time and memory
linear in M; the DP round <= 3x the non-private one at M = 1000.
"""

import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import time_interleaved, write  # noqa: E402

import numpyro_dppvi as dppvi  # noqa: E402
from numpyro_dppvi.cli import logistic_model  # noqa: E402
from numpyro_dppvi.privacy import Privacy  # noqa: E402

ROWS, STEPS, BATCH, DRAWS = 100, 10, 10, 10


def clients(num_clients: int):
    x, y, _, _ = dppvi.datasets.load_adult(split="train_test")
    rows = np.random.default_rng(0).integers(0, len(y), size=(num_clients, ROWS))
    return [(x[r], y[r]) for r in rows]


def peak_rss_mb() -> float:
    """The process's peak resident memory so far (``VmHWM``; ``ru_maxrss`` where ``/proc`` is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(num_clients: int, repeats: int) -> dict:
    """One process's measurement (run by ``main`` in a subprocess per M): the peak before the fits are built
    (imports, JAX, the Adult data) and after the rounds ran, and their difference per client."""
    data = clients(num_clients)
    model = logistic_model()
    jax.block_until_ready(jax.numpy.zeros(1) + 1)  # JAX's runtime is up before the baseline is read
    baseline = peak_rss_mb()
    common = dict(schedule="synchronous", local_steps=STEPS, batch_size=BATCH, num_samples=DRAWS, damping=0.5,
                  optimizer=optax.adam(1e-2), rounds=1)
    rounds = {}
    for name, extra in (("non_private", {}), ("dp", dict(method="dp_optimisation",
                                                         privacy=Privacy(noise_multiplier=1.0, clip=2.0)))):
        driver = dppvi.DPPVI(model, **common, **extra)
        state = driver.init(None, data)
        limits = driver.limits(state, 1)
        rounds[name] = (lambda d=driver, s=state, l=limits: d._round(s, d.data, d.mask, d.sizes, l)[0].q.eta1)
    timed = time_interleaved(rounds, repeats)
    out = {name: {"median_s": t["median_s"], "per_client_s": t["median_s"] / num_clients} for name, t in timed.items()}
    out["dp_over_non_private"] = out["dp"]["median_s"] / out["non_private"]["median_s"]
    out["baseline_rss_mb"] = baseline
    out["peak_rss_mb"] = peak_rss_mb()
    out["fit_memory_mb"] = out["peak_rss_mb"] - baseline
    out["fit_memory_per_client_mb"] = out["fit_memory_mb"] / num_clients
    return out


def main(repeats: int = 5, sizes=(10, 100, 1000)):
    results = {}
    for m in sizes:
        run = subprocess.run([sys.executable, __file__, "--one", str(m), str(repeats)], check=True,
                             capture_output=True, text=True)
        results[str(m)] = json.loads(run.stdout.strip().splitlines()[-1])
    small, large = results[str(sizes[0])], results[str(sizes[-1])]
    scale = sizes[-1] / sizes[0]
    summary = {
        "time_growth_non_private": large["non_private"]["median_s"] / small["non_private"]["median_s"] / scale,
        "time_growth_dp": large["dp"]["median_s"] / small["dp"]["median_s"] / scale,
        "dp_over_non_private_at_largest": large["dp_over_non_private"],
        "meets_dp_target": bool(large["dp_over_non_private"] <= 3.0),
        # the fits' memory beyond the process's baseline, per added client between the smallest and largest M
        "memory_growth_per_client_mb": (large["fit_memory_mb"] - small["fit_memory_mb"]) / (sizes[-1] - sizes[0]),
    }
    write("pvi_rounds", {"setting": f"synchronous round; {ROWS} Adult rows per client (resampled), logistic "
                                    f"regression, {STEPS} local steps, batch {BATCH}, {DRAWS} MC draws; DP: "
                                    "Poisson batches, clip 2, noise multiplier 1",
                         "repeats": repeats, "clients": results,
                         "growth_note": "time_growth_* = (time at the largest M / time at the smallest M) / "
                                        "(largest M / smallest M): 1 is linear, below 1 sublinear",
                         **summary})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        main()
