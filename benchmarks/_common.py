"""Shared helpers of the speed harnesses: timing of the second call, JSON output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import jax

RESULTS = Path(__file__).resolve().parent / "results"


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


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": {"python": platform.python_version(), "jax": jax.__version__,
                                              "devices": [str(d) for d in jax.devices()],
                                              "processor": platform.processor() or platform.machine()},
               **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))
    return path
