"""End to end on a real Flower deployment: a SuperLink and two SuperNodes on 127.0.0.1 (free ports,
processes stopped by id), the package's ServerApp run by ``flwr run``, the ClientApp from the installed
package in a fresh process per message.

One federation, two fits: in the first, node B is stopped (SIGTERM) after round 1 and the fit finishes
with node A, reporting B unavailable; node A's budget is spent by then. B's SuperNode is restarted
(same node config, same disk, a new Flower node id) and a second fit runs: A refuses for its budget
and the fit goes on with B, whose ledger still holds what it spent in the first fit."""

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install numpyro_dppvi[flower]")

import numpyro_dppvi as dppvi
from numpyro_dppvi.flower import client_store
from numpyro_dppvi.flower.federation import LocalFederation, alive
from numpyro_dppvi.flower.models import logistic_regression
from numpyro_dppvi.flower.settings import NodeSettings

from .conftest import node_config, run_config, synthetic_clients


def finished_rounds(results_dir) -> int:
    path = results_dir / "progress.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def by_client(result) -> dict:
    return {c["client_id"]: j for j, c in enumerate(result.config["clients"])}


def dropped(entry) -> dict:
    return {d["client"]: d["reason"] for d in entry.get("dropped", [])}


@pytest.mark.slow
def test_two_supernodes_a_lost_node_a_spent_budget_and_a_restart(tmp_path):
    a, b = synthetic_clients(sizes=(48, 64))
    cache = {"compilation-cache": str(tmp_path / "jax-cache")}  # each message is a fresh process
    nodes = {"node-a": node_config(tmp_path, 0, a, epsilon=1.0, **cache),
             "node-b": node_config(tmp_path, 1, b, epsilon=4.0, **cache)}
    settings = {"min-clients": 2, "round-timeout": 60.0, "poll-interval": 0.2}
    federation = LocalFederation(tmp_path / "federation", extra_env={"JAX_PLATFORMS": "cpu"})
    try:
        federation.start_superlink()
        for name, config in nodes.items():
            federation.start_node(name, config)
        federation.wait_registered(nodes)

        first_dir = tmp_path / "fit-1"
        app = federation.start_app(run_config(rounds=3, **settings, **{"results-dir": str(first_dir)}))
        stopped = []

        def stop_b_after_round_1():
            if not stopped and finished_rounds(first_dir) >= 1:
                federation.stop_node("node-b")
                stopped.append(True)

        assert federation.wait_app(app, 150, on_tick=stop_b_after_round_1) == 0, app.log.read_text()[-3000:]
        first = dppvi.load(first_dir / "result.npz", logistic_regression)
        j = by_client(first)
        ia, ib = j["client-0"], j["client-1"]
        assert first.rounds == 3 and first.history[0]["participated"] == [True, True]
        for entry in first.history[1:]:
            assert entry["participated"][ia] and not entry["participated"][ib]
            assert dropped(entry)[ib].startswith("unavailable")
        assert first.privacy.num_releases(ia) == 15 and first.privacy.num_releases(ib) == 5

        federation.start_node("node-b", nodes["node-b"])  # restarted: same config and disk, new node id
        federation.wait_registered(["node-b"])
        second_dir = tmp_path / "fit-2"
        app = federation.start_app(run_config(rounds=1, **settings, **{"results-dir": str(second_dir)}))
        assert federation.wait_app(app, 120) == 0, app.log.read_text()[-3000:]
        second = dppvi.load(second_dir / "result.npz", logistic_regression)
        j = by_client(second)
        ia, ib = j["client-0"], j["client-1"]
        # node-a's budget is spent: no calibration of the new fit; refused for it, its ledger untouched
        assert second.history[0]["stopped"] == [ia] and second.config["clients"][ia]["stopped"] == "calibration"
        assert second.history[0]["participated"][ib] and not second.history[0]["participated"][ia]
    finally:
        left = federation.close()
    assert left == [] and not any(alive(s.process.pid) for s in federation.started)

    own = {name: client_store.load(NodeSettings.from_node_config(c)).ledger for name, c in nodes.items()}
    assert own["node-a"].num_releases(0) == 15 and not own["node-a"].stopped  # a refusal is no stop (issue 24)
    assert own["node-a"].epsilon <= 1.0 + 1e-9
    assert own["node-b"].num_releases(0) == 10 and own["node-b"].epsilon <= 4.0 + 1e-9  # both fits, one ledger
    assert second.privacy.num_releases(ib) == 10  # the server's mirror agrees with the client's own ledger
