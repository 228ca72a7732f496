"""The server's state of one fit: ``q``, every client's factor as the server has seen it, the clients
and the history; what a reply does to it; its checkpoint; the published result.

The algebra is ``pvi.server``'s: ``eta_q = eta_prior + sum_m eta_t_m``; a client's change
``delta_m`` is added to its factor and to ``q`` (sequential and asynchronous: on arrival;
synchronous: the changes of a round summed once). A change that does not arrive (a late, failed,
unavailable or refusing client) changes nothing: that client's factor stays as it was, as in the
simulated fit, and the history says why.

Low rank (``family="low_rank"``): ``q`` and every factor share one public basis ``B``; the changes arrive
in wider bases ``[B, E_m]``, so ``B`` is widened by them, everything is rebased, the changes are added and
``q`` is truncated back to rank ``r`` with every factor (:func:`numpyro_dppvi.pvi.low_rank.truncate_tree`,
which keeps ``q``'s mean and ``q = prior * prod t_m``), as ``pvi.server`` does; the share of ``q``'s core
dropped goes to the history (``low_rank_truncation``).

Privacy: the server only mirrors the ledgers its clients send (informational; a client's own
ledger on its own disk is the authority). The published result holds ``q``, the mirrored ledgers
(their events are data-independent), the settings and the history; the checkpoint (private, 0600)
also holds the factors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .. import checkpoint, factors
from ..factors import Gaussian, LowRank
from ..pvi import low_rank, noise_aware
from ..model_adapter import ModelAdapter
from ..privacy import PrivacyLedger
from ..results import DPPVIResult
from .local_update import load_model
from .schema import Identity, Instruction, Reply
from .settings import LocalSettings

CHECKPOINT_FORMAT = "numpyro_dppvi.flower.ServerCheckpoint/1"


class ClientRejected(ValueError):
    """A node introduced a client the fit cannot use (another model, another data signature)."""


@dataclass
class ClientRecord:
    """What the server knows of one client (keyed by its own id, not by Flower's node id, which
    changes when a SuperNode restarts)."""

    client_id: str
    index: int
    node_id: int | None
    num_rows: int
    factor: Gaussian  # float32 [D]: the sum of the changes the server received from it
    ledger: dict | None = None  # the client's ledger as it last reported it (a mirror)
    participations: int = 0
    stopped: str = ""  # why it takes no further part in this fit ("" while active)
    curvature: np.ndarray | None = None  # noise-aware DP optimisation: its factor's curvature, as it last reported
    curvature_bias: np.ndarray | None = None  # and the part of it the estimate's own noise adds
    gain_noise: np.ndarray | None = None  # and the variance that noise adds to its pull on the mean


@dataclass
class RoundLog:
    """What happened to each client in one round (or one batch of arrivals)."""

    participated: set = field(default_factory=set)
    failed: set = field(default_factory=set)
    stopped: set = field(default_factory=set)
    dropped: dict = field(default_factory=dict)  # client index -> reason
    arrivals: list = field(default_factory=list)


class Coordinator:
    """The state of one fit on the server (see the module docstring)."""

    def __init__(self, model_ref: str, method: str, schedule: str, settings: LocalSettings, fit_id: str,
                 run_config: dict | None = None):
        self.model_ref = model_ref
        self.model = load_model(model_ref)
        self.method = method
        self.schedule = schedule
        self.settings = settings
        self.fit_id = fit_id
        self.run_config = dict(run_config or {})
        self.adapter: ModelAdapter | None = None
        self.signature: tuple | None = None  # (row shapes, row dtypes)
        self.q: Gaussian | None = None
        self.clients: list[ClientRecord] = []
        self.round = 0
        self.communications = 0
        self.history: list[dict] = []
        self.truncation = 0.0  # low rank: the largest share of q's core dropped in the round under way

    # -- clients -------------------------------------------------------------------------------
    def client(self, client_id: str) -> ClientRecord | None:
        return next((c for c in self.clients if c.client_id == client_id), None)

    def client_at(self, node_id: int) -> ClientRecord | None:
        return next((c for c in self.clients if c.node_id == node_id), None)

    def register(self, identity: Identity, node_id: int) -> ClientRecord:
        """Map ``node_id`` to the client it introduced (a known client that moved to a new node keeps its
        factor and ledger); the first client fixes the model's data signature and ``q_0`` = prior."""
        i = identity
        if i.model != self.model_ref:
            raise ClientRejected(f"client {i.client_id!r} does not fit model {self.model_ref!r} (its node config names "
                                 "another model)")
        if self.method not in i.methods:
            raise ClientRejected(f"client {i.client_id!r} does not run method {self.method!r} (it runs {list(i.methods)})")
        signature = (tuple(tuple(s) for s in i.row_shapes), tuple(i.row_dtypes))
        if self.signature is None:
            self.start(signature)
        elif signature != self.signature:
            raise ClientRejected(f"client {i.client_id!r} has rows of shapes {signature[0]} / dtypes {signature[1]}, "
                                 f"the fit's are {self.signature[0]} / {self.signature[1]}")
        for other in self.clients:
            if other.node_id == node_id and other.client_id != i.client_id:
                other.node_id = None
        record = self.client(i.client_id)
        if record is None:
            dim = self.adapter.dim
            basis = self.q.eta2.basis if factors.is_low_rank(self.q) else None
            zero = as_numpy(factors.zeros(dim, np.float32, self.settings.family, basis=basis))
            record = ClientRecord(i.client_id, len(self.clients), node_id, i.num_rows, zero)
            self.clients.append(record)
        record.node_id = node_id
        if i.ledger is not None:
            record.ledger = i.ledger
        return record

    def start(self, signature: tuple) -> None:
        """Trace the model on zeros of the clients' row signature; ``q_0`` is the prior."""
        self.signature = signature
        self.adapter = ModelAdapter.for_shapes(self.model, [list(s) for s in signature[0]], list(signature[1]))
        if self.adapter.has_server_factor:
            raise ValueError(f"model {self.model_ref} has priors that are not Normal on a real site; "
                             "numpyro_dppvi.flower needs Normal priors (reparametrise the others)")
        if self.q is None:
            dim = self.adapter.dim
            basis = (factors.initial_basis(dim, self.settings.resolved_rank(dim))
                     if self.settings.family == "low_rank" else None)
            self.q = as_numpy(factors.as_family(self.adapter.prior, self.settings.family, basis=basis))

    def active(self) -> list[ClientRecord]:
        return [c for c in self.clients if not c.stopped]

    # -- messages ------------------------------------------------------------------------------
    def instruction(self, client: ClientRecord) -> Instruction:
        return Instruction(self.fit_id, self.round + 1, client.client_id, self.method, self.model_ref, self.settings,
                           self.q, client.factor)

    def receive(self, client: ClientRecord, reply: Reply, log: RoundLog) -> Gaussian | None:
        """Book one reply: mirror the client's ledger; return its change when it is to be applied."""
        if reply.client_id != client.client_id:
            log.dropped[client.index] = f"reply from client {reply.client_id!r}"
            return None
        if reply.ledger is not None:
            client.ledger = reply.ledger
        client.participations = reply.participations
        if reply.status == "refused":
            if reply.reason in ("budget", "calibration", "method", "model", "settings"):
                client.stopped = reply.reason
                log.stopped.add(client.index)
            else:
                log.dropped[client.index] = f"refused ({reply.reason}): {reply.detail}"
            return None
        self.communications += 1
        log.participated.add(client.index)
        if not reply.diagnostics.get("update_finite", 1.0):
            log.failed.add(client.index)
            return None
        if factors.family_of(reply.delta) != self.settings.family or np.shape(reply.delta.eta1) != np.shape(self.q.eta1):
            log.dropped[client.index] = f"a {factors.family_of(reply.delta)} change of another shape than q's"
            return None
        if reply.curvature is not None:
            dim = np.shape(self.q.eta1)[0]
            bias = np.zeros_like(reply.curvature) if reply.curvature_bias is None else reply.curvature_bias
            gain = np.zeros_like(reply.curvature) if reply.gain_noise is None else reply.gain_noise
            if any(np.shape(a) != (dim, dim) or not np.all(np.isfinite(a)) for a in (reply.curvature, bias, gain)):
                log.dropped[client.index] = "a curvature (or its bias or gain noise) that is not a finite [D, D] matrix"
                return None
            client.curvature = np.asarray(reply.curvature, np.float32)
            client.curvature_bias = np.asarray(bias, np.float32)
            client.gain_noise = np.asarray(gain, np.float32)
        return as_numpy(reply.delta)

    def apply(self, changes: list[tuple[ClientRecord, Gaussian]]) -> None:
        """``t_m += delta_m`` for each, and ``q += sum_m delta_m`` (one sum over the stacked changes); low rank:
        first widen, rebase, then truncate (module docstring)."""
        if not changes:
            return
        if factors.is_low_rank(self.q):
            self._apply_low_rank(changes)
            return
        for client, delta in changes:
            client.factor = factors.multiply(client.factor, delta)
        stacked = Gaussian(*(np.stack([np.asarray(getattr(d, name), np.float32) for _, d in changes])
                             for name in ("eta1", "eta2")))
        q = factors.multiply(self.q, factors.product(stacked))
        self.q = Gaussian(*(np.asarray(x, np.float32) for x in q))

    def _apply_low_rank(self, changes: list[tuple[ClientRecord, Gaussian]]) -> None:
        """``pvi.server.synchronous``'s low-rank step for the changes that arrived: ``B`` widened by their bases,
        ``q``, every factor and the changes rebased to it, the changes added, then ``q`` and every factor
        truncated to rank ``r`` (``truncate_tree``)."""
        rank = factors.rank_of(self.q)
        basis = np.asarray(self.q.eta2.basis, np.float32)
        # an answer computed against this q starts with its basis B; a stale one (asynchronous: q was rebased since
        # it was sent) brings the basis it was computed in, which B is widened by as well
        extra = [d.eta2.basis[:, rank:] if np.array_equal(d.eta2.basis[:, :rank], basis) else d.eta2.basis
                 for _, d in changes]
        wide = low_rank.orthonormal_union(jnp.asarray(basis), jnp.concatenate(extra, axis=1))
        deltas = stack([d for _, d in changes])
        deltas, q, held = low_rank.rebase_tree((deltas, self.q, stack([c.factor for c in self.clients])), wide)
        q = factors.multiply(q, factors.product(deltas))
        rows = np.asarray([client.index for client, _ in changes])
        held = Gaussian(held.eta1.at[rows].add(deltas.eta1),
                        held.eta2._replace(diag=held.eta2.diag.at[rows].add(deltas.eta2.diag),
                                           core=held.eta2.core.at[rows].add(deltas.eta2.core)))
        (q, held), dropped = low_rank.truncate_tree((q, held), q, rank)
        self.q = as_numpy(q)
        for j, client in enumerate(self.clients):
            client.factor = as_numpy(jax.tree.map(lambda x: x[j], held))
        self.truncation = max(self.truncation, float(dropped))

    def end_round(self, log: RoundLog, seconds: float) -> dict:
        """Close a round: check ``q`` and append the public history entry."""
        self.round += 1
        m = len(self.clients)
        entry = {"round": self.round, "communications": self.communications,
                 "participated": [j in log.participated for j in range(m)]}
        if self.method == "pvi":  # a private round's time follows the nodes' secret batch sizes (issue 24)
            entry["seconds"] = seconds
        for name in ("stopped", "failed"):
            if getattr(log, name):
                entry[name] = sorted(getattr(log, name))
        if log.dropped:
            entry["dropped"] = [{"client": j, "reason": r} for j, r in sorted(log.dropped.items())]
        if log.arrivals:
            entry["arrivals"] = list(log.arrivals)
        if factors.is_low_rank(self.q):  # computed from q: public
            entry["low_rank_truncation"] = self.truncation
            self.truncation = 0.0
        self.history.append(entry)
        return entry

    def valid(self) -> bool:
        return bool(factors.is_proper(self.q))

    # -- results -------------------------------------------------------------------------------
    def config(self) -> dict:
        """The data-independent settings of the fit (published as ``result.config``)."""
        return {"method": self.method, "schedule": self.schedule, "model": self.model_ref, "fit_id": self.fit_id,
                **asdict(self.settings), "deployment": "flower",
                "clients": [{"client_id": c.client_id, "num_rows": c.num_rows, "stopped": c.stopped or None}
                            for c in self.clients],
                "client_ledgers": {c.client_id: c.ledger for c in self.clients}}

    def privacy(self):
        """The clients' ledgers as one :class:`PrivacyLedger` (client ``m`` in row ``m``), or None when
        the fit is not private. A mirror: each client's own ledger is the authority."""
        if self.method == "pvi":
            return None
        return combined_ledger([c.ledger for c in self.clients])

    def result(self) -> DPPVIResult:
        """The fit's result, with what it knows of its intervals as ``fit_dppvi`` says it (``calibration``): a
        noise-aware fit's precision rule (:func:`numpyro_dppvi.pvi.noise_aware.calibration`), and ``calibrated``
        False for a private fit whose posterior does not account for the noise
        (:func:`numpyro_dppvi.pvi.noise_aware.not_noise_aware`; on Flower, every private method but noise-aware DP
        optimisation). The virtual clients' saturation verdict (:mod:`numpyro_dppvi.pvi.release_saturation`) is not
        computed here: those fits are not noise-aware on Flower, so they are flagged as such."""
        if self.adapter is None:
            raise RuntimeError("no client joined the fit, so there is no model signature and no result")
        q, fitted, calibration = self.q, None, None
        if self.settings.noise_aware:  # the fixed point of noise-aware factors; mean-field: its marginal variances
            dim = np.shape(self.q.eta1)[0]
            zero = np.zeros((dim, dim), np.float32)
            curvature = np.stack([c.curvature if c.curvature is not None else zero for c in self.clients])
            bias = np.stack([c.curvature_bias if c.curvature_bias is not None else zero for c in self.clients])
            gain = np.stack([c.gain_noise if c.gain_noise is not None else zero for c in self.clients])
            aware, rule = noise_aware.posterior_and_rule(self.q, {"factor_curvature": curvature,
                                                                  "curvature_bias": bias, "gain_noise": gain})
            q, fitted, calibration = as_numpy(aware), self.q, noise_aware.calibration(rule)
        elif self.method != "pvi":
            calibration = noise_aware.not_noise_aware()
        return DPPVIResult(self.adapter, q, list(self.history), method=self.method, schedule=self.schedule,
                           privacy=self.privacy(), config=self.config(), rounds=self.round, q_fitted=fitted,
                           calibration=calibration)

    # -- checkpoint ----------------------------------------------------------------------------
    def save(self, path, hmac_key: bytes | None = None) -> None:
        """Write the server's **private** checkpoint (``q``, the factors, the clients, the history)."""
        tree = {"q": self.q, "factors": [c.factor for c in self.clients]}
        reported = [j for j, c in enumerate(self.clients) if c.curvature is not None]
        if reported:
            tree["curvatures"] = {str(j): self.clients[j].curvature for j in reported}
            tree["curvature_biases"] = {str(j): self.clients[j].curvature_bias for j in reported}
            tree["gain_noises"] = {str(j): self.clients[j].gain_noise for j in reported}
        meta = {"kind": "FlowerServerCheckpoint", "format": CHECKPOINT_FORMAT, "fit_id": self.fit_id,
                "model": self.model_ref, "method": self.method, "schedule": self.schedule,
                "settings": self.settings.to_json(), "signature": [list(map(list, self.signature[0])),
                                                                   list(self.signature[1])],
                "round": self.round, "communications": self.communications, "history": self.history,
                "clients": [{"client_id": c.client_id, "num_rows": c.num_rows, "ledger": c.ledger,
                             "participations": c.participations, "stopped": c.stopped} for c in self.clients]}
        checkpoint.save(path, tree, meta, hmac_key=hmac_key, private=True)

    @classmethod
    def load(cls, path, run_config: dict | None = None, hmac_key: bytes | None = None) -> "Coordinator":
        """Resume from :meth:`save` (nodes are introduced again: their Flower ids change)."""
        arrays, meta = checkpoint.load(path, hmac_key=hmac_key)
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not a numpyro_dppvi.flower server checkpoint ({CHECKPOINT_FORMAT})")
        coord = cls(meta["model"], meta["method"], meta["schedule"], LocalSettings.from_json(meta["settings"]),
                    meta["fit_id"], run_config)
        coord.q = saved_gaussian(arrays, "['q']")
        coord.start((tuple(tuple(s) for s in meta["signature"][0]), tuple(meta["signature"][1])))
        for j, info in enumerate(meta["clients"]):
            factor = saved_gaussian(arrays, f"['factors'][{j}]")
            curvature = arrays.get(f"['curvatures']['{j}']")
            bias = arrays.get(f"['curvature_biases']['{j}']")
            gain = arrays.get(f"['gain_noises']['{j}']")
            coord.clients.append(ClientRecord(info["client_id"], j, None, info["num_rows"], factor, info["ledger"],
                                              info["participations"], info["stopped"], curvature, bias, gain))
        coord.round, coord.communications, coord.history = meta["round"], meta["communications"], meta["history"]
        return coord


def as_numpy(g: Gaussian) -> Gaussian:
    """``g`` with float32 numpy leaves (any family)."""
    return jax.tree.map(lambda x: np.asarray(x, np.float32), g)


def stack(gaussians: list[Gaussian]) -> Gaussian:
    """Gaussians of one family stacked on a new leading axis (as jax arrays)."""
    return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x, jnp.float32) for x in xs]), *gaussians)


def saved_gaussian(arrays: dict, prefix: str) -> Gaussian:
    """The Gaussian saved under ``prefix`` by :func:`~numpyro_dppvi.checkpoint.flatten` (a low-rank one as its three
    ``eta2`` parts)."""
    if f"{prefix}.eta2.diag" in arrays:
        return Gaussian(arrays[f"{prefix}.eta1"], LowRank(*(arrays[f"{prefix}.eta2.{part}"]
                                                            for part in ("diag", "core", "basis"))))
    return Gaussian(arrays[f"{prefix}.eta1"], arrays[f"{prefix}.eta2"])


class ClientLedgers:
    """The mirrored ledgers of clients that account in different units (delta, relation, accountant or
    seed kind differ), reported side by side: no single ledger can hold them."""

    def __init__(self, ledgers: list[PrivacyLedger]):
        self.ledgers = ledgers

    @property
    def epsilon(self) -> float:
        return max((ledger.epsilon for ledger in self.ledgers), default=0.0)

    @property
    def delta(self) -> float:
        return max((ledger.delta_total for ledger in self.ledgers), default=0.0)

    def report(self) -> str:
        return "\n\n".join(f"client {m}:\n{ledger.report()}" for m, ledger in enumerate(self.ledgers))


def combined_ledger(ledgers: list[dict | None]):
    """One :class:`PrivacyLedger` with client ``m``'s events (and stop) in row ``m``, from the clients'
    serialised one-row ledgers; :class:`ClientLedgers` if their units differ; None if none is private."""
    rows = [PrivacyLedger.from_dict(d) if d is not None else None for d in ledgers]
    known = [r for r in rows if r is not None]
    if not known:
        return None
    first = known[0]
    units = lambda r: (r.delta, r.neighbouring, r.accountant, r.seed)
    if any(units(r) != units(first) for r in known):
        return ClientLedgers(known)
    kinds = {r.sizes for r in known}  # one node without a declared bound makes the whole a disclosure
    sizes = kinds.pop() if len(kinds) == 1 else ("observed" if "observed" in kinds else "unspecified")
    out = PrivacyLedger(len(rows), first.delta, first.neighbouring, first.accountant, seed=first.seed, sizes=sizes)
    for m, row in enumerate(rows):
        if row is None:
            continue
        for event in row.events(0):
            out.record(m, event)
        for info in row.stopped.values():
            out.stop(m, info["reason"], info["round"])
    return out

