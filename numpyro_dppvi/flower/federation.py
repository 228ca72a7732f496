"""A Flower federation on this machine: one SuperLink and SuperNodes on 127.0.0.1, as processes.

Used by ``dppvi deploy demo`` and the end-to-end test; it runs Flower's own programs
(``flower-superlink``, ``flower-supernode``, ``flwr run``) from this Python environment, each
with its own ``FLWR_HOME`` under a work folder, telemetry, update checks and run-time dependency
installation off. Ports are free loopback ports found at run time (one HTTP port for the
SuperLink, one runtime port per SuperNode).

Every process is stopped by its own id: :meth:`LocalFederation.close` sends SIGTERM to the
processes it started and to every descendant it has seen (Flower's ``flower-superexec``,
``flwr-serverapp`` and ``flwr-clientapp`` children; read from ``/proc`` on Linux), waits a bounded
time, then SIGKILLs what is left. Nothing is signalled by name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .server_app import RUN_CONFIG_DEFAULTS

#: Where a SuperNode says it registered with the SuperLink (its log line).
REGISTERED = b"SuperNode ID"


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def toml_value(value) -> str:
    """A flat TOML value: bool, int, float or a basic string (JSON escapes are TOML escapes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def toml_table(values: dict) -> str:
    """The lines ``key = value`` of a flat TOML table (:func:`toml_value`), one per item of ``values``."""
    return "".join(f"{key} = {toml_value(value)}\n" for key, value in values.items())


def app_pyproject() -> str:
    """The Flower app bundle (FAB) ``flwr run`` ships: metadata and the run config's keys only. The
    components are modules of the installed ``numpyro_dppvi``: no code travels with it."""
    return (
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "numpyro-dppvi-flower"\nversion = "1.0.0"\n'
        'description = "DP-PVI with numpyro_dppvi (components from the installed package)"\n'
        'license = "Apache-2.0"\ndependencies = []\n\n'
        '[tool.flwr.app]\npublisher = "numpyro-dppvi"\n\n'
        '[tool.flwr.app.components]\nserverapp = "numpyro_dppvi.flower.server_app:app"\n'
        'clientapp = "numpyro_dppvi.flower.client_app:app"\n\n'
        "[tool.flwr.app.config]\n" + toml_table(RUN_CONFIG_DEFAULTS))


def children() -> dict[int, list[int]]:
    """``{parent pid: [child pids]}`` of every process (``/proc``; empty where there is none)."""
    out: dict[int, list[int]] = {}
    if not os.path.isdir("/proc"):
        return out
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(parent, []).append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """The pids of every process below ``pid`` (children, their children, ...), from :func:`children`."""
    tree, out, stack = children(), [], [pid]
    while stack:
        for child in tree.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return not os.path.isdir("/proc")


@dataclass
class Started:
    """A process :class:`LocalFederation` started: its ``name`` (``"superlink"``, a SuperNode's name or
    ``"flwr-run"``), its ``process`` and the ``log`` file its output goes to."""

    name: str
    process: subprocess.Popen
    log: Path


class LocalFederation:
    """A SuperLink and SuperNodes under ``workdir`` (see the module docstring); a context manager."""

    def __init__(self, workdir, extra_env: dict | None = None, grace: float = 5.0):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bin = Path(sys.executable).parent
        for program in ("flower-superlink", "flower-supernode", "flwr"):
            if not (self.bin / program).exists():
                raise FileNotFoundError(f"{program} is not installed next to {sys.executable}; install the extra in "
                                        "this environment: pip install numpyro_dppvi[flower]")
        base = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
        base.update({"PATH": f"{self.bin}{os.pathsep}{base.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
                     "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                     "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2"})
        base.update(extra_env or {})
        self.env = base
        self.grace = float(grace)
        self.started: list[Started] = []
        self.seen: dict[int, str] = {}  # every descendant pid ever seen -> whose
        self.link_port: int | None = None

    # -- processes -----------------------------------------------------------------------------
    def _env(self, name: str) -> dict:
        home = self.workdir / "flwr-home" / name
        home.mkdir(parents=True, exist_ok=True)
        return dict(self.env, FLWR_HOME=str(home))

    def _start(self, name: str, command: list[str], env: dict | None = None) -> Started:
        log = self.workdir / "logs" / f"{name}-{len(self.started)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            process = subprocess.Popen(command, env=env or self._env(name), stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=str(self.workdir))
        started = Started(name, process, log)
        self.started.append(started)
        return started

    def note_descendants(self) -> None:
        for started in self.started:
            for pid in descendants(started.process.pid):
                self.seen.setdefault(pid, started.name)

    def process(self, name: str) -> Started:
        return [s for s in self.started if s.name == name][-1]

    def start_superlink(self, timeout: float = 60.0) -> None:
        (self.link_port,) = free_ports(1)
        self._start("superlink", [str(self.bin / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                  "--port", str(self.link_port)])
        self._wait(lambda: _healthy(self.link_port), timeout, "the SuperLink to answer /health")
        (self.workdir / "flwr-home" / "cli").mkdir(parents=True, exist_ok=True)
        (self.workdir / "flwr-home" / "cli" / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.link_port}"\ninsecure = true\n', encoding="utf-8")

    def start_node(self, name: str, node_config: dict) -> Started:
        """Start a SuperNode whose node config is written to ``<workdir>/<name>.toml`` (the file a data
        holder would keep); returns once it is starting (see :meth:`wait_registered`)."""
        config_file = self.workdir / f"{name}.toml"
        config_file.write_text(toml_table(node_config), encoding="utf-8")
        (port,) = free_ports(1)
        return self._start(name, [str(self.bin / "flower-supernode"), "--insecure", "--superlink",
                                  f"127.0.0.1:{self.link_port}", "--host", "127.0.0.1", "--port", str(port),
                                  "--node-config", str(config_file)])

    def wait_registered(self, names, timeout: float = 60.0) -> None:
        for name in names:
            log = self.process(name).log
            self._wait(lambda: log.exists() and REGISTERED in log.read_bytes(), timeout,
                       f"SuperNode {name} to register (log {log})")

    def stop_node(self, name: str, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop SuperNode ``name`` and its children (SIGTERM: it tells the SuperLink it leaves)."""
        started = self.process(name)
        self._signal([started], sig, timeout)

    def start_app(self, run_config: dict) -> Started:
        """``flwr run`` of the package's app with ``run_config`` (a TOML file), streaming its logs."""
        app_dir = self.workdir / "app"
        app_dir.mkdir(exist_ok=True)
        (app_dir / "pyproject.toml").write_text(app_pyproject(), encoding="utf-8")
        config_file = self.workdir / f"run-config-{len(self.started)}.toml"
        config_file.write_text(toml_table(run_config), encoding="utf-8")
        return self._start("flwr-run", [str(self.bin / "flwr"), "run", str(app_dir), "local", "--stream",
                                        "--run-config", str(config_file)], env=self._env("cli"))

    def wait_app(self, started: Started, timeout: float, on_tick=None) -> int:
        """The exit status of ``flwr run``; stopped (with its children) after ``timeout`` seconds.
        ``on_tick()`` runs every 0.2 s while it runs (e.g. to show progress or to stop a node)."""
        end = time.monotonic() + timeout
        while started.process.poll() is None and time.monotonic() < end:
            self.note_descendants()
            if on_tick is not None:
                on_tick()
            time.sleep(0.2)
        if started.process.poll() is None:
            self._signal([started], signal.SIGTERM, self.grace)
            raise TimeoutError(f"flwr run did not finish within {timeout:g} s (log {started.log})")
        return started.process.returncode

    # -- teardown ------------------------------------------------------------------------------
    def _signal(self, targets: list[Started], sig: int, timeout: float) -> None:
        self.note_descendants()
        pids = [s.process.pid for s in targets if s.process.poll() is None]
        for s in targets:
            pids += descendants(s.process.pid)
        for pid in pids:
            _kill(pid, sig)
        end = time.monotonic() + timeout
        while time.monotonic() < end and (any(s.process.poll() is None for s in targets) or any(map(alive, pids))):
            time.sleep(0.1)
        for pid in pids:
            if alive(pid):
                _kill(pid, signal.SIGKILL)
        for s in targets:
            try:
                s.process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent
                pass

    def close(self) -> list[int]:
        """Stop everything started here and every descendant seen (SIGTERM, ``grace`` s, SIGKILL);
        returns the pids still alive afterwards (none, normally)."""
        self.note_descendants()
        targets = [s for s in self.started if s.process.poll() is None]
        for pid in self.seen:
            if alive(pid):
                _kill(pid, signal.SIGTERM)
        self._signal(targets, signal.SIGTERM, self.grace)
        for pid in self.seen:
            if alive(pid):
                _kill(pid, signal.SIGKILL)
        return [pid for pid in list(self.seen) + [s.process.pid for s in self.started] if alive(pid)]

    def __enter__(self) -> "LocalFederation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _wait(condition, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if time.monotonic() >= end:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(0.2)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False
