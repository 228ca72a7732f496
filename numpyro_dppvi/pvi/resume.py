"""The private checkpoint of a (DP-)PVI fit, and resuming it with its ledger intact.

``save_checkpoint`` writes the whole state (secret key included), the ledger, the public and private
histories and a keyed fingerprint of the clients' data (:mod:`numpyro_dppvi.checkpoint`: ``.npz`` plus
JSON, HMAC with a key). ``resume`` refuses a checkpoint whose settings (:data:`RESUME_SETTINGS`), key,
ledger units or data differ from the driver's, then continues with the checkpoint's own key: the same
result as an uninterrupted fit, no budget re-spent or forgotten.
"""

from __future__ import annotations

import json
import warnings

import numpy as np

from .. import checkpoint as checkpoints
from .. import keys
from ..privacy import PrivacyLedger
from ..program_cache import to_device
from ..results import DPPVIResult
from . import release_noise, report
from .local import DPOptimisation
from .server import PVIState

CHECKPOINT_FORMAT = "numpyro_dppvi.DPPVICheckpoint/1"
#: Settings a resumed fit must share with its checkpoint (the privacy ones are checked against the
#: stored ledger too): any change would make the stored ledger count the wrong releases.
RESUME_SETTINGS = ("method", "schedule", "local_steps", "batch_size", "num_samples", "damping", "server_steps",
                   "shards", "invalid", "precision_floor", "trusted_aggregator", "privacy_unit", "client_rate",
                   "planned_rounds", "tail_average", "family", "rank", "privacy")
#: What a checkpoint written before a setting existed meant by it.
SAVED_BEFORE = {"family": "mean_field", "rank": None}



def _json(value):
    """Normalise a settings value for comparison (tuples vs lists, ints vs floats)."""
    return json.dumps(value, sort_keys=True, default=str)




def save_checkpoint(driver, path, state: PVIState, history: list, private_history: list,
                    hmac_key: bytes | None = None) -> None:
    """Write the **private** checkpoint: the whole state (secret key included), the ledger, the
    public and private histories and a keyed fingerprint of the clients' data. Never publish it."""
    meta = {"kind": "DPPVICheckpoint", "format": CHECKPOINT_FORMAT, "seed": driver.seed,
            "result": report.public_result(driver, state, history).public_meta(), "private_history": private_history,
            "settings": driver.settings(), "fingerprint": keys.keyed_fingerprint(state.key, driver.clients)}
    checkpoints.save(path, state, meta, hmac_key=hmac_key, private=True)


def resume(driver, path, clients, rounds: int, hmac_key: bytes | None = None, rng_key=None,
           **run_options) -> DPPVIResult:
    """Continue the fit saved in the private checkpoint ``path`` until ``rounds`` rounds in total.

    Refuses a checkpoint whose settings (method, schedule, shards, clip, relation, sampling,
    accountant, delta, noise multiplier, ...) differ from this driver's, or whose data
    fingerprint does not match ``clients``. The fit continues with the checkpoint's own key;
    ``rng_key``, if given, must be that key. State a later version added is filled with zeros: the gain's noise
    of DP optimisation (``DPOptimisation.ADDED_STATE``, with a warning: it under-states that noise for a while) and
    the releases' centres of virtual clients (``release_noise.ADDED_STATE``, exact: those releases were uncentred).
    """
    arrays, meta = checkpoints.load(path, hmac_key=hmac_key)
    if meta.get("kind") != "DPPVICheckpoint" or meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a DPPVI private checkpoint (format {CHECKPOINT_FORMAT}); a published "
                         "result cannot be resumed (it holds no state)")
    saved = meta["settings"]
    if saved.get("planned_rounds") is not None and driver.planned_rounds != saved["planned_rounds"]:
        driver.planned_rounds = saved["planned_rounds"]  # the noise was calibrated for the original plan
    key_data = to_device(arrays[".key"], np.uint32)
    if rng_key is not None and not np.array_equal(np.asarray(keys.key_data(rng_key)), np.asarray(key_data)):
        raise ValueError(f"rng_key differs from the key of the fit saved in {path}; a resumed fit continues "
                         "with its own key: drop rng_key")
    if driver.auto_family and saved.get("family", SAVED_BEFORE["family"]) == "mean_field":
        driver.auto_family = False  # a family left out is the one the saved fit resolved (before issue 59: mean-field)
    template = driver._init(key_data, meta.get("seed", "unspecified"), clients)
    mine = driver.settings()
    changed = [name for name in RESUME_SETTINGS
               if _json(mine.get(name)) != _json(saved.get(name, SAVED_BEFORE.get(name)))]
    if changed:
        detail = "; ".join(f"{n}: saved {saved.get(n)!r}, now {mine.get(n)!r}" for n in changed)
        raise ValueError(f"{path} was fitted with other settings, so its ledger would count the wrong releases; "
                         f"resume with exactly the saved settings ({detail})")
    ledger = None
    saved_result = meta["result"]
    if driver.privacy is not None:
        if saved_result.get("privacy") is None:
            raise ValueError(f"{path} holds a non-private fit; it cannot be resumed with privacy")
        ledger = PrivacyLedger.from_dict(saved_result["privacy"])
        expected = driver.privacy.ledger(driver.num_clients, driver.trusted_aggregator, seed=ledger.seed,
                                       charges=driver.plan.charges(driver.planned_rounds))
        for name in ("delta", "neighbouring", "accountant", "trusted_aggregator", "num_clients"):
            if getattr(ledger, name) != getattr(expected, name):
                raise ValueError(f"{path}: the stored ledger has {name}={getattr(ledger, name)!r} but this fit "
                                 f"uses {getattr(expected, name)!r}; resume with the saved privacy settings")
    if keys.keyed_fingerprint(key_data, driver.clients) != meta["fingerprint"]:
        raise ValueError(f"{path} was fitted on other client data; resume it with the same clients in the same order")
    arrays, filled = checkpoints.with_added_leaves(template, arrays,
                                                   DPOptimisation.ADDED_STATE + release_noise.ADDED_STATE)
    understated = [name for name in filled if any(name.endswith(f"['{key}']") for key in DPOptimisation.ADDED_STATE)]
    if understated:
        warnings.warn(f"{path} was saved by an older version, without {', '.join(understated)}: they start at zero "
                      "and enter from each client's next update, so the noise-aware posterior under-states the gain's "
                      "noise until the clients have updated a few times", UserWarning, stacklevel=3)
    state = checkpoints.unflatten_like(template, arrays)
    done = int(state.round)
    rounds = driver.planned_rounds if rounds is None else rounds  # fit_dppvi's rounds=None: the planned ones
    if done > rounds:
        raise ValueError(f"{path} already ran {done} rounds, more than rounds={rounds}")
    return driver.run(None, clients, rounds - done, state=state, history=saved_result["history"], ledger=ledger,
                    private_history=meta["private_history"], hmac_key=hmac_key, **run_options)


def take_ledger(driver, ledger) -> None:
    """A run that continues a given state: the driver must have been set up (``init`` or :func:`resume`), and a
    private fit needs its ledger, so that the budget already spent is kept."""
    if driver.adapter is None:
        raise RuntimeError("resume through fit_dppvi(..., resume=path), or call init first")
    if driver.privacy is not None:
        if ledger is None:
            raise ValueError("resuming a private fit needs its ledger so spent budget is kept")
        driver.ledger = ledger


def check_budget_left(driver, state, limits, rounds: int) -> None:
    """Refuse ``rounds`` more rounds of a private fit in which no client may take part any more (every budget is
    spent): they would release nothing and change nothing."""
    if driver.plan is None or int(rounds) == 0 or int(state.round) == 0:
        return
    able = np.asarray(state.active) & (np.asarray(limits) > np.asarray(state.participations))
    if not able.any():
        raise ValueError(
            f"{driver.caller}: every client's budget is spent after round {int(state.round)} (the noise was "
            f"calibrated to {driver.planned_rounds} planned rounds), so {int(rounds)} more round(s) would release "
            "nothing and change nothing: the checkpoint's result is final. More rounds need a new fit planned "
            "for them (rounds=..., its noise calibrated to them), whose budget adds to this one's on the same data")
