"""Shared helpers of the speed harnesses: timing of the second call, JSON output.

Where the JSON goes: the ``directory`` given to :func:`write`, else the folder named by the environment
variable ``NUMPYRO_DPPVI_BENCH_OUT`` (``dppvi bench`` sets it: ``runs/bench/``, ``--out DIR``, or
``benchmarks/results/`` with ``--update-results``), else ``benchmarks/results/`` (a script run directly,
``python benchmarks/dp_step.py``, updates the tracked reference numbers, as before).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
OUT_ENV = "NUMPYRO_DPPVI_BENCH_OUT"  # the same name as numpyro_dppvi.cli.BENCH_OUT_ENV


def time_call(fn, repeats: int = 5) -> dict:
    """Run ``fn`` once to compile, then ``repeats`` times; seconds of each timed call (blocking on results)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "all_s": times}


def time_interleaved(fns: dict, repeats: int = 30) -> dict:
    """Like :func:`time_call` for several functions whose calls alternate, so that drift in the
    machine's speed hits all of them alike; ``{name: {"median_s", "min_s", "all_s"}}``."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "all_s": t} for name, t in times.items()}


def results_dir(directory: str | Path | None = None) -> Path:
    """The folder the JSON results go to: ``directory``, else ``$NUMPYRO_DPPVI_BENCH_OUT``, else
    ``benchmarks/results/``. Read at every call (``dppvi bench`` sets the variable per run)."""
    if directory is not None:
        return Path(directory)
    return Path(os.environ[OUT_ENV]) if os.environ.get(OUT_ENV) else RESULTS


def write(name: str, payload: dict, directory: str | Path | None = None) -> Path:
    """Write ``payload`` with a description of the machine to ``<results_dir(directory)>/<name>.json``;
    its path. ``dppvi bench`` prints the numbers as a table; this prints only where they went."""
    folder = results_dir(directory)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": {"python": platform.python_version(), "jax": jax.__version__,
                                              "devices": [str(d) for d in jax.devices()],
                                              "processor": platform.processor() or platform.machine()},
               **payload}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def late_clipped_share(history: list):
    """The adaptive clip's clipped share over the last half of rounds (the rounds whose estimates a noise-aware
    answer averages; pooled over clients: released counts summed over their releases), its final clips, and the
    releases it pools: ``None`` without an adaptive clip."""
    entries = [h["adaptive_clip"] for h in history if "adaptive_clip" in h]
    if len(entries) < 2:
        return None
    start = entries[(len(entries) - 1) // 2]
    end = entries[-1]
    below = np.subtract(end["below_sum"], start["below_sum"])
    releases = np.subtract(end["releases"], start["releases"])
    share = 1.0 - below.sum() / max(releases.sum(), 1)
    return {"share": round(float(share), 4), "releases": int(releases.sum()),
            "per_client": np.round(1.0 - below / np.maximum(releases, 1), 4).tolist(),
            "clip": end["clip"]}
