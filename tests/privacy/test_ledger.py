import json
import math
import time

import numpy as np
import pytest

from numpyro_dppvi.privacy import GaussianEvent, PrivacyLedger, epsilon_of_events

STEP = GaussianEvent(2.0, "poisson", 0.01, 1)


def test_repeated_events_merge_into_counts_and_are_cheap():
    ledger = PrivacyLedger(2, 1e-5)
    start = time.perf_counter()
    for _ in range(10_000):
        ledger.record(0, STEP)
    assert time.perf_counter() - start < 2.0  # bookkeeping only (~10 us per record)
    assert ledger.events(0) == (STEP.with_count(10_000),)
    assert ledger.num_releases(0) == 10_000
    expected = epsilon_of_events([STEP.with_count(10_000)], 1e-5, "add_remove", "pld")
    assert ledger.epsilon_per_client[0] == pytest.approx(expected, rel=1e-12)


def test_epsilon_per_client_in_client_order_and_overall_max():
    ledger = PrivacyLedger(3, 1e-5)
    ledger.record(0, STEP.with_count(100))
    ledger.record(2, STEP.with_count(400))
    eps = ledger.epsilon_per_client
    assert eps.shape == (3,)
    assert eps[1] == 0.0 and 0 < eps[0] < eps[2]
    assert ledger.epsilon == eps[2]


def test_cache_is_invalidated_by_record_and_epsilon_if_does_not_record():
    ledger = PrivacyLedger(1, 1e-5)
    ledger.record(0, STEP.with_count(50))
    before = ledger.epsilon
    predicted = ledger.epsilon_if(0, STEP)
    assert ledger.epsilon == before and ledger.num_releases(0) == 50
    ledger.record(0, STEP)
    assert ledger.epsilon == pytest.approx(predicted, rel=1e-12) and ledger.epsilon > before


def test_record_all_and_stopped_clients():
    ledger = PrivacyLedger(3, 1e-5)
    ledger.record_all(STEP)
    ledger.stop(1, "epsilon_max", round=4)
    ledger.record_all(STEP)  # default: clients that are not stopped
    assert [ledger.num_releases(m) for m in range(3)] == [2, 1, 2]
    assert ledger.stopped == {1: {"reason": "epsilon_max", "round": 4}}
    with pytest.raises(ValueError, match="stopped"):
        ledger.record(1, STEP)
    with pytest.raises(ValueError, match="stopped"):
        ledger.record_all(STEP, clients=[0, 1])
    assert ledger.num_releases(0) == 2  # the failed record_all recorded nothing
    assert "stopped: epsilon_max, round 4" in ledger.report()


def test_json_round_trip_is_exact_and_resume_continues_the_ledger():
    ledger = PrivacyLedger(3, 1e-5, "substitute", "pld", trusted_aggregator=False)
    ledger.record(0, GaussianEvent(4 / 3, "poisson", 0.1 / 3, 17, 3e-14))
    ledger.record(1, GaussianEvent(2.7, "none", 1.0, 2))
    ledger.stop(2, "client failure")
    restored = PrivacyLedger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert restored == ledger
    np.testing.assert_array_equal(restored.epsilon_per_client, ledger.epsilon_per_client)
    # resuming: the same further events give the same ledger as an uninterrupted run
    for target in (ledger, restored):
        target.record(0, GaussianEvent(4 / 3, "poisson", 0.1 / 3, 3, 3e-14))
    assert restored == ledger
    assert restored.num_releases(0) == 20
    restored.record(1, GaussianEvent(2.7))
    assert restored != ledger


def test_equality_compares_everything():
    a, b = PrivacyLedger(2, 1e-5), PrivacyLedger(2, 1e-5)
    assert a == b
    assert a != PrivacyLedger(2, 1e-6)
    assert a != PrivacyLedger(2, 1e-5, accountant="rdp")
    assert a != PrivacyLedger(2, 1e-5, trusted_aggregator=True)
    a.record(0, STEP.with_count(2))
    b.record(0, STEP)
    assert a != b
    b.record(0, STEP)
    assert a == b  # merged counts: the order of recording does not matter


def test_from_dict_rejects_foreign_data():
    with pytest.raises(ValueError, match="PrivacyLedger"):
        PrivacyLedger.from_dict({"num_clients": 2})
    data = PrivacyLedger(2, 1e-5).to_dict()
    data["events"] = [[]]
    with pytest.raises(ValueError, match="event lists"):
        PrivacyLedger.from_dict(data)


def test_overflow_probability_is_charged_to_delta():
    ledger = PrivacyLedger(2, 1e-5)
    event = GaussianEvent(1.0, "poisson", 0.01, 1000, overflow_probability=1e-13)
    ledger.record(0, event)
    eps = ledger.epsilon_per_client[0]
    expected = 1e-5 + (1 + math.exp(eps)) * 1000 * 1e-13
    assert ledger.delta_per_client[0] == pytest.approx(expected, rel=1e-12)
    assert ledger.delta_per_client[1] == 1e-5
    assert ledger.delta_total == ledger.delta_per_client[0]
    assert ledger.delta == 1e-5


def test_report_states_relation_backend_and_guarantee():
    ledger = PrivacyLedger(2, 1e-5, "substitute", "rdp", trusted_aggregator=True)
    ledger.record(0, GaussianEvent(1.0, "without_replacement", 0.1, 10))
    text = ledger.report()
    assert "neighbouring=substitute" in text and "accountant=rdp" in text
    assert "trusted aggregator" in text
    assert "10x sigma/Delta=1 without_replacement q=0.1" in text
    assert f"{ledger.epsilon:.4f}" in text
    assert "each client alone" in PrivacyLedger(1, 1e-5).report()


@pytest.mark.parametrize("args,error,match", [
    ((0, 1e-5), ValueError, "num_clients"),
    ((2.0, 1e-5), TypeError, "num_clients"),
    ((2, 0.0), ValueError, "delta"),
    ((2, 1e-5, "replace"), ValueError, "neighbouring"),
    ((2, 1e-5, "add_remove", "moments"), ValueError, "accountant"),
])
def test_constructor_errors(args, error, match):
    with pytest.raises(error, match=match):
        PrivacyLedger(*args)


def test_record_errors_leave_the_ledger_unchanged():
    ledger = PrivacyLedger(2, 1e-5, "add_remove", "pld")
    with pytest.raises(ValueError, match="out of range"):
        ledger.record(2, STEP)
    with pytest.raises(TypeError, match="GaussianEvent"):
        ledger.record(0, {"noise_multiplier": 1.0})
    with pytest.raises(ValueError, match="substitute"):
        ledger.record(0, GaussianEvent(1.0, "without_replacement", 0.1))
    sub = PrivacyLedger(1, 1e-5, "substitute", "pld")
    with pytest.raises(ValueError, match="rdp"):
        sub.record(0, GaussianEvent(1.0, "without_replacement", 0.1))
    assert ledger.num_releases(0) == 0 and sub.num_releases(0) == 0
