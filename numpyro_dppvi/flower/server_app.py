"""The ServerApp: ``numpyro_dppvi.flower.server_app:app`` (and :func:`serve`, its body, for any Grid).

Run configuration (flat keys, Flower's kebab case; defaults in :data:`RUN_CONFIG_DEFAULTS`):
``model`` (``"package.module:function"``, the same on every node), ``method`` (``"dp_optimisation"``
or ``"pvi"``), ``schedule``, ``rounds``, ``local-steps``, ``batch-size`` (0: the whole data),
``num-samples``, ``optimizer`` (``adam``, ``sgd`` or ``cvi``), ``learning-rate``, ``damping``, ``clip``,
``tail-average`` (share of the local iterates averaged, ``fit_dppvi``'s ``tail_average``); ``family`` (``mean_field``, ``full_rank`` or
``low_rank``) and ``rank`` (low rank's ``r``, 0 for ``round(sqrt(D))``); ``noise-aware`` (``"auto"``: on for DP
optimisation with a mean-field or full-rank ``q``, as ``fit_dppvi``'s default; ``"true"`` or ``"false"``); ``round-timeout`` (seconds a round, or a sequential client, may take; also the messages' TTL), ``poll-interval``,
``min-clients`` and ``wait-for-clients`` (seconds to wait for them); ``results-dir`` (where the
published result ``result.npz`` and ``progress.jsonl`` go), ``checkpoint`` (the server's private
checkpoint, written after every round and resumed from when it exists; ``checkpoint-key-file``
authenticates it) and ``fit-id`` (default: a fresh random id).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..results import DPPVIResult
from .coordinator import Coordinator, RoundLog
from .exchange import Exchange
from .schedules import asynchronous_rounds, introduce_new_nodes, sequential_round, synchronous_round
from .settings import METHODS, LocalSettings, SettingsError

SCHEDULES = ("sequential", "synchronous", "asynchronous")
RUN_CONFIG_DEFAULTS = {
    "model": "numpyro_dppvi.flower.models:logistic_regression", "method": "dp_optimisation",
    "schedule": "synchronous", "rounds": 3, "local-steps": 10, "batch-size": 100, "num-samples": 10,
    "optimizer": "adam", "learning-rate": 0.01, "damping": 0.5, "clip": 1.0, "round-timeout": 120.0,
    "poll-interval": 0.2, "min-clients": 1, "wait-for-clients": 60.0, "results-dir": "", "checkpoint": "",
    "checkpoint-key-file": "", "fit-id": "", "tail-average": 0.0, "family": "mean_field",
    "rank": 0, "noise-aware": "auto",
}


@dataclass(frozen=True)
class ServerSettings:
    """The run configuration, checked and typed (:meth:`from_run_config`; keys in the module docstring).

    Attributes:
        model: the model reference ``"package.module:function"``, the same on every node.
        method: ``"dp_optimisation"`` or ``"pvi"``.
        schedule: ``"sequential"``, ``"synchronous"`` or ``"asynchronous"`` (:data:`SCHEDULES`).
        rounds: the number of rounds (also the participations each client's noise is calibrated for).
        local: the :class:`~numpyro_dppvi.flower.settings.LocalSettings` proposed to every client.
        round_timeout: seconds a round (or a sequential client) may take; also the messages' TTL.
        poll_interval: seconds between polls for replies.
        min_clients: the nodes to wait for before the fit starts.
        wait_for_clients: seconds to wait for them.
        results_dir: where ``result.npz`` and ``progress.jsonl`` go, or None.
        checkpoint: the server's private checkpoint, or None.
        checkpoint_key_file: the file of the checkpoint's HMAC key, or None.
        fit_id: the fit's id (a fresh random one by default).
    """

    model: str
    method: str
    schedule: str
    rounds: int
    local: LocalSettings
    round_timeout: float
    poll_interval: float
    min_clients: int
    wait_for_clients: float
    results_dir: Path | None
    checkpoint: Path | None
    checkpoint_key_file: Path | None
    fit_id: str

    @classmethod
    def from_run_config(cls, run_config) -> "ServerSettings":
        """The settings of ``run_config`` over :data:`RUN_CONFIG_DEFAULTS`; raises :class:`SettingsError`
        naming an unknown key or a wrong value."""
        config = dict(RUN_CONFIG_DEFAULTS, **dict(run_config))
        unknown = sorted(set(config) - set(RUN_CONFIG_DEFAULTS))
        if unknown:
            raise SettingsError(f"run config has unknown key(s) {unknown}; known: {sorted(RUN_CONFIG_DEFAULTS)}")
        if config["method"] not in METHODS:
            raise SettingsError(f"method={config['method']!r}; the Flower deployment runs {METHODS}")
        if config["schedule"] not in SCHEDULES:
            raise SettingsError(f"schedule={config['schedule']!r}; choose one of {SCHEDULES}")
        batch = int(config["batch-size"])
        if config["method"] == "dp_optimisation" and batch <= 0:
            raise SettingsError("method='dp_optimisation' needs batch-size > 0 (the expected DP-SGD batch)")
        noise_aware = str(config["noise-aware"]).strip().lower()
        if noise_aware not in ("auto", "true", "false"):
            raise SettingsError(f"noise-aware must be 'auto', 'true' or 'false', got {config['noise-aware']!r}")
        if noise_aware == "auto":
            noise_aware = config["method"] == "dp_optimisation" and str(config["family"]) in ("mean_field", "full_rank") \
                and str(config["optimizer"]) == "private_newton"
        local = LocalSettings(local_steps=int(config["local-steps"]), batch_size=batch if batch > 0 else None,
                              num_samples=int(config["num-samples"]), optimizer=str(config["optimizer"]),
                              learning_rate=float(config["learning-rate"]), damping=float(config["damping"]),
                              clip=float(config["clip"]), planned_rounds=int(config["rounds"]),
                              tail_average=float(config["tail-average"]), family=str(config["family"]),
                              rank=int(config["rank"]), noise_aware=noise_aware in (True, "true"))
        local.check_method(str(config["method"]), str(config["schedule"]))
        path = lambda key: Path(str(config[key])) if str(config[key]).strip() else None
        return cls(str(config["model"]), str(config["method"]), str(config["schedule"]), int(config["rounds"]), local,
                   float(config["round-timeout"]), float(config["poll-interval"]), int(config["min-clients"]),
                   float(config["wait-for-clients"]), path("results-dir"), path("checkpoint"),
                   path("checkpoint-key-file"), str(config["fit-id"]) or uuid.uuid4().hex)

    def checkpoint_key(self) -> bytes | None:
        """The checkpoint's HMAC key (the key file's bytes, stripped), or None."""
        return None if self.checkpoint_key_file is None else self.checkpoint_key_file.read_bytes().strip()


def wait_for_clients(exchange: Exchange, count: int, timeout: float, clock=time.monotonic, sleep=time.sleep) -> None:
    """Return once the grid lists at least ``count`` nodes (polled every 0.2 s); raise ``TimeoutError``
    after ``timeout`` seconds."""
    deadline = clock() + timeout
    while len(exchange.node_ids()) < count:
        if clock() >= deadline:
            raise TimeoutError(f"only {len(exchange.node_ids())} of min-clients={count} nodes connected within "
                               f"{timeout:g} s; start more SuperNodes or lower min-clients")
        sleep(0.2)


def serve(grid: Grid, run_config, report=print) -> DPPVIResult:
    """Run a fit over ``grid`` as run config ``run_config`` says; return the (public) result.

    ``report(text)`` receives one line per round (the history entry) and notes on rejected nodes.
    """
    s = ServerSettings.from_run_config(run_config)
    key = s.checkpoint_key()
    if s.checkpoint is not None and s.checkpoint.exists():
        coord = Coordinator.load(s.checkpoint, dict(run_config), key)
        report(f"resuming fit {coord.fit_id} from {s.checkpoint} after round {coord.round}")
    else:
        coord = Coordinator(s.model, s.method, s.schedule, s.local, s.fit_id, dict(run_config))
    exchange = Exchange(grid, s.poll_interval)
    wait_for_clients(exchange, s.min_clients, s.wait_for_clients)
    rejected: dict[int, str] = {}
    introduce_new_nodes(coord, exchange, s.round_timeout, rejected)
    for node, why in rejected.items():
        report(f"node {node} cannot join: {why}")
    if not coord.clients:
        raise RuntimeError("no client joined the fit: " + ("; ".join(rejected.values()) or "no node answered"))
    progress = None if s.results_dir is None else s.results_dir / "progress.jsonl"
    if s.results_dir is not None:
        s.results_dir.mkdir(parents=True, exist_ok=True)

    def end_round(log: RoundLog, seconds: float) -> None:
        entry = coord.end_round(log, seconds)
        if s.checkpoint is not None:
            coord.save(s.checkpoint, key)
        if progress is not None:
            with open(progress, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        report(json.dumps(entry))

    if s.schedule == "asynchronous":
        asynchronous_rounds(coord, exchange, s.round_timeout, s.rounds - coord.round, end_round)
    while s.schedule != "asynchronous" and coord.round < s.rounds:
        start = time.monotonic()
        introduce_new_nodes(coord, exchange, s.round_timeout, rejected)
        step = sequential_round if s.schedule == "sequential" else synchronous_round
        end_round(step(coord, exchange, s.round_timeout), time.monotonic() - start)
    return coord.result()


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp's entry point: :func:`serve` with the run config, then (with ``results-dir``) the
    published result ``result.npz`` and ``done.json`` (the fit id and rounds run) written there."""
    result = serve(grid, context.run_config, report=lambda text: print(f"[numpyro_dppvi] {text}", flush=True))
    settings = ServerSettings.from_run_config(context.run_config)
    if settings.results_dir is not None:
        result.save(settings.results_dir / "result.npz")
        (settings.results_dir / "done.json").write_text(json.dumps({"fit_id": result.config["fit_id"],
                                                                    "rounds": result.rounds}))
