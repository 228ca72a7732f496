"""The ClientApp's guarantees: its noise comes from its own secret seed; it refuses, before reading its
data, a step its budget cannot pay and anything it did not agree to; it writes the charge durably,
privately and before it replies; its state cannot be rewritten without its key."""

import os
import stat

import numpy as np
import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install numpyro_dppvi[flower]")

from flwr.app import Message

from numpyro_dppvi import checkpoint
from numpyro_dppvi.factors import Gaussian
from numpyro_dppvi.flower import client_app, client_store, schema
from numpyro_dppvi.flower.client_app import app
from numpyro_dppvi.flower.inprocess import FIRST_NODE_ID, InProcessGrid
from numpyro_dppvi.flower.settings import TEST_KEYS_ENV, LocalSettings, NodeSettings, SettingsError

from .conftest import MODEL, node_config

DIM = 4  # three weights and a bias
SETTINGS = LocalSettings(local_steps=5, batch_size=16, learning_rate=0.01, damping=0.5, clip=1.0, planned_rounds=2)


def prior():
    return Gaussian(np.zeros(DIM, np.float32), np.full(DIM, -0.5, np.float32))


def instruction(client_id="client-0", fit_id="fit-a", round=1, method="dp_optimisation", model=MODEL,
                settings=SETTINGS):
    zero = Gaussian(np.zeros(DIM, np.float32), np.zeros(DIM, np.float32))
    return schema.Instruction(fit_id, round, client_id, method, model, settings, prior(), zero)


def send(grid, node, message):
    """One train message to ``node`` through the grid: the decoded reply, or the Flower error reply."""
    out = Message(schema.encode_instruction(message), dst_node_id=node, message_type=schema.TRAIN, ttl=60)
    (reply,) = grid.pull_messages(grid.push_messages([out]))
    return reply if reply.has_error() else schema.decode_reply(reply.content)


def test_the_charge_is_on_disk_privately_before_the_reply_leaves(clients, tmp_path, monkeypatch):
    config = node_config(tmp_path, 0, clients[0])
    grid = InProcessGrid(app, [config])
    monkeypatch.setattr(client_app, "encode_reply", lambda reply: (_ for _ in ()).throw(OSError("network down")))
    failed = send(grid, FIRST_NODE_ID, instruction())
    assert failed.has_error() and "network down" in failed.error.reason  # no reply left the client ...
    node = NodeSettings.from_node_config(config)
    state = client_store.load(node)  # ... but its step is charged, on its own disk
    assert state.ledger.num_releases(0) == SETTINGS.local_steps and state.exchanges == 1
    assert state.fit["participations"] == 1 and state.seed_kind == "os_entropy"
    assert stat.S_IMODE(os.stat(client_store.state_path(node)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(node.state_dir).st_mode) == 0o700


def test_noise_comes_from_each_clients_own_secret_seed(clients, tmp_path):
    """The same instruction to two clients holding the same data gives different changes, and so does the
    same instruction twice to one client: the server cannot choose or replay a client's noise."""
    configs = [node_config(tmp_path, m, clients[0]) for m in range(2)]
    grid = InProcessGrid(app, configs)
    first = send(grid, FIRST_NODE_ID, instruction("client-0"))
    other = send(grid, FIRST_NODE_ID + 1, instruction("client-1"))
    again = send(grid, FIRST_NODE_ID, instruction("client-0", round=2))
    assert first.status == other.status == again.status == "ok"
    assert not np.allclose(first.delta.eta1, other.delta.eta1)
    assert not np.allclose(first.delta.eta1, again.delta.eta1)
    seeds = [client_store.load(NodeSettings.from_node_config(c)).seed for c in configs]
    assert not np.array_equal(*seeds)


def test_an_over_budget_step_is_refused_before_the_data_are_read(clients, tmp_path):
    config = node_config(tmp_path, 0, clients[0], epsilon=1.0)
    grid = InProcessGrid(app, [config])
    one_round = LocalSettings(**{**SETTINGS.__dict__, "planned_rounds": 1})
    assert send(grid, FIRST_NODE_ID, instruction(settings=one_round)).status == "ok"
    os.remove(config["data-file"])  # any read of the data would now raise
    beyond = send(grid, FIRST_NODE_ID, instruction(settings=one_round, round=2))  # past the fit's plan
    assert (beyond.status, beyond.reason) == ("refused", "budget")
    later = send(grid, FIRST_NODE_ID, instruction(fit_id="fit-b"))  # a new fit: nothing left to calibrate to
    assert (later.status, later.reason) == ("refused", "budget")
    ledger = client_store.load(NodeSettings.from_node_config(config)).ledger
    assert ledger.num_releases(0) == one_round.local_steps and ledger.epsilon <= 1.0 + 1e-9
    assert ledger.stopped[0]["reason"] == "epsilon_max"


@pytest.mark.parametrize("change, reason", [
    (dict(method="pvi"), "method"),
    (dict(model="numpyro_dppvi.flower.models:other"), "model"),
    (dict(client_id="client-9"), "client"),
    (dict(settings=LocalSettings(**{**SETTINGS.__dict__, "clip": 5.0})), "settings"),
])
def test_what_the_node_did_not_agree_to_is_refused_without_reading_data(clients, tmp_path, change, reason):
    config = node_config(tmp_path, 0, clients[0])
    grid = InProcessGrid(app, [config])
    assert send(grid, FIRST_NODE_ID, instruction()).status == "ok"
    os.remove(config["data-file"])
    reply = send(grid, FIRST_NODE_ID, instruction(round=2, **change))
    assert (reply.status, reply.reason) == ("refused", reason)
    assert client_store.load(NodeSettings.from_node_config(config)).ledger.num_releases(0) == SETTINGS.local_steps


def test_a_q_of_another_family_than_the_settings_is_refused_without_reading_data(clients, tmp_path):
    """Schema 3: the settings name the family; a mean-field ``q`` under ``family="full_rank"`` (or the reverse) is
    refused before the data are read, as are settings whose optimiser does not fit the method."""
    config = node_config(tmp_path, 0, clients[0])
    grid = InProcessGrid(app, [config])
    os.remove(config["data-file"])
    full = LocalSettings(**{**SETTINGS.__dict__, "family": "full_rank"})
    reply = send(grid, FIRST_NODE_ID, instruction(settings=full))
    assert (reply.status, reply.reason) == ("refused", "settings") and "eta2" in reply.detail
    newton = LocalSettings(**{**SETTINGS.__dict__, "family": "full_rank", "optimizer": "newton", "learning_rate": 0.5})
    reply = send(grid, FIRST_NODE_ID, instruction(settings=newton))
    assert (reply.status, reply.reason) == ("refused", "settings") and "Hessians" in reply.detail


def test_an_improper_cavity_is_refused(clients, tmp_path):
    grid = InProcessGrid(app, [node_config(tmp_path, 0, clients[0])])
    bad = instruction()
    bad = schema.Instruction(**{**bad.__dict__, "t_m": Gaussian(np.zeros(DIM, np.float32), np.full(DIM, -1.0,
                                                                                                  np.float32))})
    assert send(grid, FIRST_NODE_ID, bad).reason == "cavity"


def test_the_test_key_option_needs_its_environment_variable(clients, tmp_path, monkeypatch):
    config = node_config(tmp_path, 0, clients[0], **{"unsafe-test-fit-key": "00" * 8, "unsafe-test-client-index": 0})
    monkeypatch.delenv(TEST_KEYS_ENV, raising=False)
    with pytest.raises(SettingsError, match="tests only"):
        NodeSettings.from_node_config(config)
    monkeypatch.setenv(TEST_KEYS_ENV, "1")
    assert NodeSettings.from_node_config(config).test_fit_key == "00" * 8


def test_node_config_errors_name_the_key(tmp_path):
    with pytest.raises(SettingsError, match="client-id"):
        NodeSettings.from_node_config({"state-dir": str(tmp_path), "data-file": "d.npz", "model": MODEL})
    with pytest.raises(SettingsError, match="unknown key"):
        NodeSettings.from_node_config({"client-id": "a", "state-dir": "s", "data-file": "d", "model": MODEL,
                                       "epsilon_max": 1.0})


def test_a_state_rewritten_without_the_key_is_refused(clients, tmp_path):
    key_file = tmp_path / "state.key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    config = node_config(tmp_path, 0, clients[0], **{"state-key-file": str(key_file)})
    grid = InProcessGrid(app, [config])
    assert send(grid, FIRST_NODE_ID, instruction()).status == "ok"
    node = NodeSettings.from_node_config(config)
    path = client_store.state_path(node)
    arrays, meta = checkpoint.load(path, hmac_key=node.hmac_key())
    meta["ledger"] = None  # an emptied ledger, written by someone without the key
    tree = {k.strip("[]'"): v for k, v in arrays.items() if k == "['seed']"}
    checkpoint.save(path, tree, meta, private=True)
    with pytest.raises(ValueError, match="HMAC"):
        client_store.load(node)
    reply = send(grid, FIRST_NODE_ID, instruction(round=2))
    assert reply.has_error() and "HMAC" in reply.error.reason


def test_an_instruction_the_node_cannot_calibrate_does_not_stop_its_budget(clients, tmp_path):
    """Issue 24, finding 4. The attacker is the server: one instruction the node cannot calibrate
    (``batch_size`` at least the node's rows) used to be refused *and* stop the node's budget for good,
    with nothing spent, so every later fit on its data was refused. Now the refusal leaves the ledger
    alone and a valid instruction is served."""
    config = node_config(tmp_path, 0, clients[0], epsilon=1.0)
    grid = InProcessGrid(app, [config])
    rows = len(clients[0][0])
    impossible = LocalSettings(**{**SETTINGS.__dict__, "batch_size": rows})
    refused = send(grid, FIRST_NODE_ID, instruction(settings=impossible))
    assert (refused.status, refused.reason) == ("refused", "calibration")
    ledger = client_store.load(NodeSettings.from_node_config(config)).ledger  # None: nothing written
    assert ledger is None or (not ledger.stopped and ledger.num_releases(0) == 0)
    assert send(grid, FIRST_NODE_ID, instruction(fit_id="fit-b")).status == "ok"
    assert not client_store.load(NodeSettings.from_node_config(config)).ledger.stopped


@pytest.mark.parametrize("row", [0, 7])
def test_a_non_finite_record_on_a_node_is_never_an_error_the_server_sees(clients, tmp_path, row):
    """Issue 24, finding 6. The attacker is the server: a node holding a NaN record answered every message
    with a ClientDataError before any noise, an unnoised "this data set holds a non-finite record". Now
    the record's gradient is zeroed by the clipping like any non-finite term, the node answers as usual,
    and its update is finite (row 0 is also among the rows the model is traced on)."""
    x, y = (np.array(a) for a in clients[0])
    x[row, 1] = np.nan
    config = node_config(tmp_path, 0, (x, y))
    grid = InProcessGrid(app, [config])
    reply = send(grid, FIRST_NODE_ID, instruction())
    assert not isinstance(reply, Message), reply.error.reason
    assert reply.status == "ok" and reply.diagnostics["update_finite"] == 1.0
    assert np.all(np.isfinite(reply.delta.eta1)) and np.all(np.isfinite(reply.delta.eta2))


def test_a_node_tells_the_server_its_declared_size_not_its_rows(clients, tmp_path):
    """Issue 24, finding 1 on Flower. Attacker: the server, which reads each node's identity (``num_rows``) and
    its ledger events. With ``public-size`` in the node config the node sends the bound and derives its rate from
    it, so a node holding one record more sends the same; without it the node sends its number of rows (the
    ledger says the sizes were observed). A node holding more rows than its bound refuses, naming the key."""
    n = len(clients[0][0])
    grid = InProcessGrid(app, [node_config(tmp_path / "a", 0, clients[0], **{"public-size": n + 40}),
                               node_config(tmp_path / "b", 0, clients[0])])
    sizes = []
    for node in (FIRST_NODE_ID, FIRST_NODE_ID + 1):
        hello = Message(schema.encode_hello(schema.Hello("fit-a", MODEL)), dst_node_id=node,
                        message_type=schema.HELLO, ttl=60)
        (reply,) = grid.pull_messages(grid.push_messages([hello]))
        sizes.append(schema.decode_identity(reply.content).num_rows)
    assert sizes == [n + 40, n]
    declared, observed = (send(grid, node, instruction()) for node in (FIRST_NODE_ID, FIRST_NODE_ID + 1))
    rate = lambda r: r.ledger["events"][0][0]["rate"]
    assert rate(declared) < rate(observed)  # b / (n + 40) against b / n, rounded up to 9 bits
    assert declared.ledger["sizes"] == "declared" and observed.ledger["sizes"] == "observed"
    node = NodeSettings.from_node_config(node_config(tmp_path / "c", 0, clients[0], **{"public-size": n - 1}))
    with pytest.raises(SettingsError, match="public-size"):
        node.size_of(n)


def test_a_client_state_saved_without_the_gain_noise_reads_back_with_it_at_zero(caplog):
    """A node's state file written by an older version lacks ``gain_noise`` (``DPOptimisation.ADDED_STATE``; the
    other leaves keep their tree order): it reads back with that entry at zero, logged; a state missing anything
    else is refused."""
    from numpyro_dppvi.flower import local_update

    square = lambda v: np.full((DIM, DIM), v, np.float32)
    template = {"curvature_bias": square(0.0), "factor_noise": square(0.0), "gain_noise": square(0.0),
                "information_sum": np.zeros(DIM, np.float32), "noise_std": np.float32(0.0)}
    saved = {"curvature_bias": square(1.0), "factor_noise": square(2.0), "information_sum": np.full(DIM, 3.0, np.float32),
             "noise_std": np.float32(4.0)}
    with caplog.at_level("WARNING", logger="numpyro_dppvi.flower.client"):
        state = local_update.rule_state_from(template, [saved[k] for k in sorted(saved)])
    assert "gain_noise" in caplog.text and "start at zero" in caplog.text
    np.testing.assert_array_equal(state["gain_noise"], square(0.0))
    for name, value in saved.items():
        np.testing.assert_array_equal(state[name], value)
    current = dict(saved, gain_noise=square(5.0))
    np.testing.assert_array_equal(local_update.rule_state_from(template, [current[k] for k in sorted(current)])
                                  ["gain_noise"], square(5.0))
    with pytest.raises(ValueError, match="has 3 arrays, the fit's rule expects 5"):
        local_update.rule_state_from(template, [saved[k] for k in sorted(saved)][1:])
