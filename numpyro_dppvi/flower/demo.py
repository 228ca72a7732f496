"""``dppvi deploy demo``: DP-PVI across two Flower SuperNodes on this machine.

The bundled UCI Adult training data are split between two "hospitals"; each gets its own folder
with its data file (0600) and a node config naming its budget ``(epsilon, delta)``. A real
SuperLink and two SuperNodes start on free loopback ports, ``flwr run`` runs the package's
ServerApp for a few synchronous rounds of DP optimisation, and the demo prints the rounds, the
posterior summary, the held-out accuracy, the server's mirror of the ledgers and each client's own
ledger read from its own folder. Everything is stopped by process id before it returns.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

MODEL = "numpyro_dppvi.flower.models:logistic_regression"


def demo_run_config(rounds: int, results_dir: Path) -> dict:
    """DP optimisation on Adult with two clients: 50 DP-SGD steps of expected batch 100 per round,
    Adam at 0.05, clip 2, damping 0.5 (about 0.85 held-out accuracy after 3 rounds at epsilon 1)."""
    return {"model": MODEL, "method": "dp_optimisation", "schedule": "synchronous", "rounds": int(rounds),
            "local-steps": 50, "batch-size": 100, "num-samples": 10, "learning-rate": 0.05, "damping": 0.5,
            "clip": 2.0, "round-timeout": 120.0, "poll-interval": 0.2, "min-clients": 2, "wait-for-clients": 60.0,
            "results-dir": str(results_dir)}


def hospital(folder: Path, name: str, data, epsilon: float, cache: Path) -> dict:
    """Write one hospital's data (0600) and return its node config."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    data_file = folder / "data.npz"
    np.savez(data_file, x=data[0], y=data[1])
    os.chmod(data_file, 0o600)
    return {"client-id": name, "state-dir": str(folder / "state"), "data-file": str(data_file), "model": MODEL,
            "epsilon": float(epsilon), "delta": 1e-5, "compilation-cache": str(cache)}


def run_demo(rounds: int = 3, epsilon: float = 1.0, timeout: float = 600.0, keep: bool = False, out=print) -> int:
    """Run the demo of the module docstring; return the exit status (0 when the fit finished, else 1).

    ``rounds`` synchronous rounds of DP optimisation (:func:`demo_run_config`), each hospital with budget
    ``(epsilon, 1e-5)``; ``timeout``: seconds ``flwr run`` may take; ``out(text)`` receives every line
    shown. The work folder (data, states, logs, results) is removed afterwards unless ``keep`` is true or
    the fit failed."""
    from .. import datasets, load
    from ..persistent_cache import default_cache_dir
    from ..data import partition
    from . import client_store
    from .federation import LocalFederation
    from .models import logistic_regression
    from .settings import NodeSettings

    start = time.monotonic()
    x, y, x_test, y_test = datasets.load_adult(split="train_test")
    work = Path(tempfile.mkdtemp(prefix="dppvi-deploy-demo-"))
    clients = partition((x, y), num_clients=2, seed=0)
    nodes = {f"hospital-{i}": hospital(work / f"hospital-{i}", f"hospital-{i}", c, epsilon, default_cache_dir())
             for i, c in enumerate(clients)}
    results = work / "results"
    out(f"UCI Adult: {len(x)} training rows split between 2 hospitals ({', '.join(str(len(c[0])) for c in clients)} "
        f"rows), each with budget epsilon={epsilon}, delta=1e-5; {rounds} synchronous rounds of DP-PVI "
        f"(DP optimisation). Work folder: {work}")
    status = 1
    federation = LocalFederation(work / "federation")
    try:
        federation.start_superlink()
        for name, config in nodes.items():
            federation.start_node(name, config)
        federation.wait_registered(nodes)
        out(f"SuperLink on 127.0.0.1:{federation.link_port}, 2 SuperNodes registered "
            f"({time.monotonic() - start:.1f} s)")
        app = federation.start_app(demo_run_config(rounds, results))
        shown = 0

        def progress():
            nonlocal shown
            path = results / "progress.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            for line in lines[shown:]:
                entry = json.loads(line)
                took = f" {entry['seconds']:.1f} s," if "seconds" in entry else ""
                out(f"  round {entry['round']}:{took} participated {entry['participated']}"
                    + (f", dropped {entry['dropped']}" if entry.get("dropped") else ""))
            shown = len(lines)

        code = federation.wait_app(app, timeout, on_tick=progress)
        progress()
        if code != 0 or not (results / "done.json").exists():
            out(f"the fit did not finish (flwr run exit {code}); logs in {work / 'federation' / 'logs'}")
            keep = True
            return 1
        status = 0
    finally:
        left = federation.close()
        out(f"stopped the SuperLink, the SuperNodes and their children by process id"
            + (f"; still alive: {left}" if left else ""))

    result = load(results / "result.npz", logistic_regression)
    summary = result.summary(num_samples=1000)
    shown_rows = [r for r in summary.index if r == "b" or r in {f"w[{j}]" for j in range(6)}]
    out(f"\nPosterior ({result.rounds} rounds; 'b' and the first 6 of {x.shape[1]} weights):\n"
        f"{summary.loc[shown_rows].to_string()}")
    metrics = result.evaluate(x_test, y_test)
    out(f"Held-out: accuracy {metrics['accuracy']:.4f}, mean log-likelihood {metrics['log_lik']:.4f}")
    out(f"\nThe server's mirror of the ledgers (informational):\n{result.privacy.report()}")
    for name, config in nodes.items():
        ledger = client_store.load(NodeSettings.from_node_config(config)).ledger
        out(f"\n{name}'s own ledger (on its own disk; the authority):\n{ledger.report()}")
    out(f"\nTotal {time.monotonic() - start:.1f} s")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return status
