"""The message schema: round trips through records and Flower's wire encoding, bit for bit, without
pickle; other versions and malformed messages refused with the fix named."""

import pickle

import numpy as np
import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install numpyro_dppvi[flower]")

from flwr.app import ConfigRecord, Message, RecordDict

from numpyro_dppvi.factors import Gaussian
from numpyro_dppvi.flower import _compat, schema
from numpyro_dppvi.flower.settings import LocalSettings, SettingsError


def awkward(dim=5, seed=0):
    """Natural parameters with a -0.0, a subnormal and a huge value: any lossy encoding changes them."""
    rng = np.random.default_rng(seed)
    eta1 = rng.normal(size=dim).astype(np.float32)
    eta1[0], eta1[1], eta1[2] = -0.0, np.float32(1e-45), np.float32(3e38)
    return Gaussian(eta1, -np.abs(rng.normal(size=dim)).astype(np.float32))


def same_bits(a: Gaussian, b: Gaussian):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.fixture
def no_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")
    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, refuse)


def wire(records: RecordDict, message_type=schema.TRAIN) -> RecordDict:
    """``records`` sent in a Message to node 7 and back through Flower's wire encoding."""
    _compat.set_server_identity(1)
    message = Message(records, dst_node_id=7, message_type=message_type, ttl=60)
    _compat.stamp_message_id(message)
    return _compat.wire_copy(message).content


def test_instruction_round_trips_bit_for_bit_without_pickle(no_pickle):
    settings = LocalSettings(local_steps=3, batch_size=None, clip=2.0, planned_rounds=4)
    sent = schema.Instruction("fit", 2, "h1", "dp_optimisation", "m:f", settings, awkward(), awkward(seed=1))
    got = schema.decode_instruction(wire(schema.encode_instruction(sent)))
    same_bits(got.q, sent.q)
    same_bits(got.t_m, sent.t_m)
    assert (got.fit_id, got.round, got.client_id, got.method, got.model, got.settings) == \
        ("fit", 2, "h1", "dp_optimisation", "m:f", settings)


def test_reply_and_identity_round_trip(no_pickle):
    ledger = {"format": "x", "events": [[{"count": 3}]]}
    sent = schema.Reply("h1", "refused", awkward(), "budget", "spent", 4, ledger, {"update_finite": 1.0})
    got = schema.decode_reply(wire(schema.encode_reply(sent)))
    same_bits(got.delta, sent.delta)
    assert (got.client_id, got.status, got.reason, got.detail, got.participations, got.ledger, got.diagnostics) == \
        ("h1", "refused", "budget", "spent", 4, ledger, {"update_finite": 1.0})
    identity = schema.Identity("h1", "m:f", ((3,), ()), ("float32", "float32"), 48, ("dp_optimisation",), None)
    assert schema.decode_identity(wire(schema.encode_identity(identity), schema.HELLO)) == identity
    assert schema.decode_hello(wire(schema.encode_hello(schema.Hello("fit", "m:f")), schema.HELLO)) == \
        schema.Hello("fit", "m:f")


def test_other_schema_versions_and_missing_records_are_refused():
    records = schema.encode_hello(schema.Hello("fit", "m:f"))
    records["config"]["schema"] = "numpyro_dppvi.flower/0"
    with pytest.raises(schema.SchemaError, match="same version"):
        schema.decode_hello(records)
    with pytest.raises(schema.SchemaError, match="lacks the ConfigRecord 'config'"):
        schema.decode_instruction(RecordDict({"other": ConfigRecord({"schema": schema.SCHEMA_VERSION})}))
    settings = LocalSettings()
    records = schema.encode_instruction(schema.Instruction("f", 1, "c", "pvi", "m:f", settings, awkward(), awkward()))
    del records["t_m"]
    with pytest.raises(schema.SchemaError, match="'t_m'"):
        schema.decode_instruction(records)


def test_local_settings_reject_unknown_and_invalid_values():
    with pytest.raises(SettingsError, match="unknown local settings"):
        LocalSettings.from_json('{"local_steps": 3, "seed": 1}')
    with pytest.raises(SettingsError, match="damping"):
        LocalSettings(damping=1.5)
    with pytest.raises(SettingsError, match="optimizer"):
        LocalSettings(optimizer="lbfgs")
    with pytest.raises(SettingsError, match="family"):
        LocalSettings(family="diagonal")
    with pytest.raises(SettingsError, match="non-negative integer"):
        LocalSettings(family="low_rank", rank=-1)
    with pytest.raises(SettingsError, match="precision step"):
        LocalSettings(family="full_rank", optimizer="newton", learning_rate=1.0)
    with pytest.raises(SettingsError, match="optimizer='newton'"):
        LocalSettings(family="full_rank").check_method("pvi")
    with pytest.raises(SettingsError, match="family='full_rank'"):
        LocalSettings(optimizer="newton", learning_rate=0.5).check_method("pvi")


def test_a_low_rank_instruction_round_trips_bit_for_bit(no_pickle):
    """Schema 4: a low-rank ``q`` travels as ``eta1`` and ``eta2``'s diagonal, core and public basis."""
    from numpyro_dppvi.factors import LowRank

    rng = np.random.default_rng(3)
    g = lambda: Gaussian(awkward().eta1, LowRank(awkward(seed=2).eta2, rng.normal(size=(2, 2)).astype(np.float32),
                                                 np.linalg.qr(rng.normal(size=(5, 2)))[0].astype(np.float32)))
    settings = LocalSettings(optimizer="newton", learning_rate=0.5, family="low_rank", rank=2)
    sent = schema.Instruction("fit", 1, "h1", "pvi", "m:f", settings, g(), g())
    got = schema.decode_instruction(wire(schema.encode_instruction(sent)))
    for mine, theirs in ((got.q, sent.q), (got.t_m, sent.t_m)):
        assert isinstance(mine.eta2, LowRank)
        same_bits(Gaussian(mine.eta1, mine.eta2.diag), Gaussian(theirs.eta1, theirs.eta2.diag))
        same_bits(Gaussian(mine.eta2.core, mine.eta2.basis), Gaussian(theirs.eta2.core, theirs.eta2.basis))
    assert got.settings == settings
    with pytest.raises(SettingsError, match="rank sets the rank"):
        LocalSettings(rank=2)
    with pytest.raises(SettingsError, match="optimizer='newton'"):
        LocalSettings(family="low_rank").check_method("pvi")
