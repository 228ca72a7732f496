"""The accountant's answers kept across processes (``privacy/accounting_memo.py``, issue 13).

A kept epsilon must be the accountant's own float, bit for bit (the ledger is right to the last
digit whether it computed or read), and an entry that was edited, moved to another question,
signed with another secret or written by other library versions must never be used.
"""

import json
import stat

import pytest

from numpyro_dppvi.privacy import accounting_memo, backends, calibration
from numpyro_dppvi.privacy.events import GaussianEvent

#: A Poisson-subsampled Gaussian of the Adult plan's kind (rate 0.025, 100 steps): a PLD that takes
#: a noticeable time, so reading it back is the point.
EVENTS = [GaussianEvent(1.1, "poisson", 0.025, 100)]
DELTA = 1e-5


@pytest.fixture
def memo(tmp_path, monkeypatch):
    """The memo in a fresh folder, in-process memos cleared before and after; yields a list that
    records every PLD the accountant computes (as opposed to reads)."""
    calibration.clear_memo()
    accounting_memo.use(tmp_path / "cache")
    computed = []
    original = backends._pld_epsilon
    monkeypatch.setattr(backends, "_pld_epsilon", lambda *args: computed.append(args) or original(*args))
    yield computed
    accounting_memo.use(None)
    calibration.clear_memo()


def epsilon():
    return backends.epsilon(EVENTS, DELTA, "add_remove")


def entries(folder):
    return json.loads((folder / accounting_memo.MEMO_FILE).read_text())


def test_a_kept_epsilon_is_the_accountants_float_bit_for_bit(memo, tmp_path):
    accounting_memo.use(None)
    reference = epsilon()  # computed with no memo on disk
    calibration.clear_memo()
    accounting_memo.use(tmp_path / "cache")
    first = epsilon()  # computed again, and kept
    calibration.clear_memo()  # as a new process: nothing in memory
    second = epsilon()
    assert len(memo) == 2  # the reference and the first; the second was read
    assert first.hex() == reference.hex() and second.hex() == reference.hex()


def test_the_secret_is_private_and_the_folder_is_the_users(memo, tmp_path):
    epsilon()
    folder = tmp_path / "cache"
    assert stat.S_IMODE((folder / accounting_memo.KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert len((folder / accounting_memo.KEY_FILE).read_bytes()) == 32


@pytest.mark.parametrize("attack", ["smaller value", "moved entry", "other secret", "other versions"])
def test_an_entry_that_does_not_verify_is_recomputed(memo, tmp_path, monkeypatch, attack):
    folder = tmp_path / "cache"
    true_value = epsilon()
    other = [GaussianEvent(2.0, "poisson", 0.025, 100)]
    backends.epsilon(other, DELTA, "add_remove")
    kept = entries(folder)
    (mine,) = [q for q in kept if "1.1" in q]
    (theirs,) = [q for q in kept if "2.0" in q]
    if attack == "smaller value":  # report less privacy loss than was spent
        kept[mine]["value"] = true_value / 2
    elif attack == "moved entry":  # a genuine entry, for another question (a larger noise)
        kept[mine] = kept[theirs]
    elif attack == "other secret":
        (folder / accounting_memo.KEY_FILE).write_bytes(b"\x01" * 32)
    else:
        monkeypatch.setattr(accounting_memo, "_versions", lambda: "dp-accounting 0.0.1; autodp 0.0")
    (folder / accounting_memo.MEMO_FILE).write_text(json.dumps(kept))
    calibration.clear_memo()
    computed_before = len(memo)
    assert epsilon().hex() == true_value.hex()
    assert len(memo) == computed_before + 1  # not read: computed


def test_the_memo_is_what_the_accountant_would_say_for_another_question(memo):
    a = epsilon()
    b = backends.epsilon(EVENTS, 1e-6, "add_remove")  # another delta: another question
    assert b > a and len(memo) == 2


def test_a_folder_that_cannot_be_written_keeps_the_memo_in_the_process(memo, tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    accounting_memo.use(blocker / "cache")  # its parent is a file: nothing can be created there
    assert epsilon() > 0
    assert not (blocker / "cache").exists()


def test_a_kept_calibration_is_used_only_if_it_meets_the_budget(memo, monkeypatch):
    plan = [GaussianEvent(1.0, "poisson", 0.025, 100)]
    sigma = calibration.calibrate_noise(1.0, DELTA, plan)
    calibration.clear_memo()
    monkeypatch.setattr(calibration, "_calibrate", lambda *a: pytest.fail("searched again"))
    assert calibration.calibrate_noise(1.0, DELTA, plan) == sigma  # read, checked, used
    # a genuinely signed entry that does not meet the budget (e.g. written under another meaning of
    # the question) is refused by the budget check and searched for again
    key = next(q for q in entries(accounting_memo._folder) if q.startswith("('calibration'"))
    accounting_memo.store(key, sigma / 2)
    calibration.clear_memo()
    searched = []
    monkeypatch.setattr(calibration, "_calibrate", lambda *a: searched.append(a) or sigma)
    assert calibration.calibrate_noise(1.0, DELTA, plan) == sigma
    assert len(searched) == 1


@pytest.mark.parametrize("opened", ["folder writable by others", "secret readable by others"])
def test_a_folder_or_secret_others_can_touch_turns_the_memo_off(memo, tmp_path, opened):
    """Another user who may write the folder could replace the secret with theirs and sign any
    answer; one who may read the secret could forge entries: either way nothing kept is used."""
    folder = tmp_path / "cache"
    epsilon()
    if opened == "folder writable by others":
        folder.chmod(0o777)
    else:
        (folder / accounting_memo.KEY_FILE).chmod(0o644)
    calibration.clear_memo()
    epsilon()
    assert len(memo) == 2  # computed again: the kept answer was not trusted


def test_the_file_keeps_the_newest_answers_only(memo, tmp_path, monkeypatch):
    monkeypatch.setattr(accounting_memo, "MAX_ENTRIES", 3)
    for i in range(5):
        accounting_memo.store(f"question {i}", float(i))
    assert list(entries(tmp_path / "cache")) == ["question 2", "question 3", "question 4"]
    assert accounting_memo.load("question 4") == 4.0 and accounting_memo.load("question 0") is None
