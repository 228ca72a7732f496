"""A client's private state, on its own disk: one file it alone can read, always written whole.

``<state-dir>/client_state.npz`` (:mod:`numpyro_dppvi.checkpoint`: ``.npz`` + JSON, never pickle,
a SHA-256 digest or, with ``state-key-file``, an HMAC, permissions 0600, marked private) holds:

* the noise seed: 64 bits of the operating system's entropy drawn when the file is created (or,
  in tests only, the key of a simulated fit); it never leaves the node;
* the number of noise keys used so far (``exchanges``): key ``k`` is ``fold_in(seed, k)``, and
  ``k`` advances with every step written, so no key drives two releases;
* the client's :class:`~numpyro_dppvi.privacy.PrivacyLedger`, over every fit on its data: the
  authority on what the client has spent;
* the fit it takes part in: its id, method, model, settings (fixed at its first step), the noise
  multiplier calibrated then, the participations charged, the client's own factor ``t_m`` and the
  local rule's client state (for DP optimisation the noise std and sampling rate);
* the public facts of its data: number of rows, shapes and dtypes of one row.

:func:`save` writes a temporary file, ``fsync``\\ s it, renames it over the old one and ``fsync``\\ s
the folder, so a crash leaves the old state or the new one, never a mix, and a charge that was
written survives a power cut. :func:`locked` serialises processes that share a state folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import checkpoint, keys
from ..factors import Gaussian
from ..privacy import PrivacyLedger
from ..privacy.config import budget_delta
from .settings import NodeSettings, SettingsError

STATE_FILE = "client_state.npz"
STATE_FORMAT = "numpyro_dppvi.flower.ClientState/1"
_CLIENT_STATE = "['client_state']"


@dataclass
class ClientState:
    """Everything a client keeps between messages (see the module docstring); private."""

    client_id: str
    seed: np.ndarray  # uint32 [2]: secret
    seed_kind: str  # "os_entropy" | "user_key" (a test key)
    exchanges: int = 0
    ledger: PrivacyLedger | None = None
    num_rows: int | None = None
    row_shapes: list | None = None
    row_dtypes: list | None = None
    fit: dict | None = None  # fit_id, method, model, settings, noise_multiplier, participations
    factor: Gaussian | None = None
    rule_leaves: list = field(default_factory=list)  # leaves of the local rule's client state (tree order)

    def ledger_for(self, node: NodeSettings) -> PrivacyLedger:
        """The client's ledger, created empty on its first private step with the node's delta, relation and
        accountant; a ledger kept under other settings is refused (its events would be misread)."""
        delta = node.delta if node.epsilon is None else budget_delta(node.delta)  # Privacy.accounting_delta
        if self.ledger is None:
            self.ledger = PrivacyLedger(1, delta, node.neighbouring, node.accountant, seed=self.seed_kind,
                                        sizes="declared" if node.public_size is not None else "observed")
        for name, now in (("delta", delta), ("neighbouring", node.neighbouring), ("accountant", node.accountant)):
            kept = getattr(self.ledger, name)
            if name == "delta" and kept == node.delta:
                continue  # a ledger kept before the reserve (issue 24, finding 10): its report adds the charges
            if kept != now:
                raise SettingsError(f"the ledger in {node.state_dir} was kept with {name}={kept!r} but the node config "
                                    f"now says {now!r}; set {name} back to {kept!r} (a ledger cannot change units)")
        return self.ledger


def state_path(node: NodeSettings) -> Path:
    """The node's state file, ``<state-dir>/client_state.npz`` (:data:`STATE_FILE`)."""
    return node.state_dir / STATE_FILE


@contextlib.contextmanager
def locked(node: NodeSettings):
    """Hold an exclusive lock on the node's state folder (made private, 0700) for one message."""
    private_folder(node.state_dir)
    fd = os.open(node.state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def private_folder(folder: Path) -> None:
    """Create ``folder`` (or take an existing one) readable by its owner only (0700)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if os.stat(folder).st_mode & 0o077:
        os.chmod(folder, 0o700)


def new_state(node: NodeSettings) -> ClientState:
    """A fresh state: a seed from the operating system (or the test key, recorded as a user key)."""
    if node.test_fit_key is not None:
        seed = np.frombuffer(bytes.fromhex(node.test_fit_key), np.uint32).copy()
        if seed.shape != (2,):
            raise SettingsError("unsafe-test-fit-key must be the 16 hex digits of a threefry key's data")
        return ClientState(node.client_id, seed, "user_key")
    return ClientState(node.client_id, np.asarray(keys.secret_key_data(), np.uint32), "os_entropy")


def load(node: NodeSettings) -> ClientState:
    """The node's state, or a fresh one when it has none; refuses a file of another client."""
    path = state_path(node)
    if not path.exists():
        return new_state(node)
    arrays, meta = checkpoint.load(path, hmac_key=node.hmac_key())
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{path} is not a numpyro_dppvi client state ({STATE_FORMAT})")
    if meta["client_id"] != node.client_id:
        raise SettingsError(f"{path} belongs to client {meta['client_id']!r}, not client-id={node.client_id!r}; give "
                            "each client its own state-dir")
    factor = None
    if "['factor'].eta1" in arrays:
        factor = Gaussian(arrays["['factor'].eta1"], arrays["['factor'].eta2"])
    leaf_names = sorted(k for k in arrays if k.startswith(_CLIENT_STATE))
    return ClientState(
        client_id=meta["client_id"], seed=arrays["['seed']"], seed_kind=meta["seed_kind"], exchanges=meta["exchanges"],
        ledger=None if meta["ledger"] is None else PrivacyLedger.from_dict(meta["ledger"]),
        num_rows=meta["num_rows"], row_shapes=meta["row_shapes"], row_dtypes=meta["row_dtypes"], fit=meta["fit"],
        factor=factor, rule_leaves=[arrays[k] for k in leaf_names])


def save(state: ClientState, node: NodeSettings) -> None:
    """Write ``state`` durably (temporary file, fsync, rename, fsync of the folder), private (0600)."""
    tree = {"seed": np.asarray(state.seed, np.uint32)}
    if state.factor is not None:
        tree["factor"] = Gaussian(*(np.asarray(x) for x in state.factor))
    meta = {"format": STATE_FORMAT, "kind": "FlowerClientState", "client_id": state.client_id,
                   "seed_kind": state.seed_kind, "exchanges": int(state.exchanges),
                   "ledger": None if state.ledger is None else state.ledger.to_dict(), "num_rows": state.num_rows,
                   "row_shapes": state.row_shapes, "row_dtypes": state.row_dtypes, "fit": state.fit}
    path = state_path(node)
    private_folder(node.state_dir)
    if state.rule_leaves:  # numbered in tree order: the fit's local rule gives the structure back
        tree["client_state"] = {f"{i:04d}": np.asarray(leaf) for i, leaf in enumerate(state.rule_leaves)}
    checkpoint.save(path, tree, meta, hmac_key=node.hmac_key(), private=True)
    directory = os.open(node.state_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
