"""PrivacyLedger: per-client record of Gaussian releases and the epsilon they cost.

Every protected individual's row sits on exactly one client, and a client's releases depend on
its own rows only (everything else it sees is post-processing of other clients' DP releases).
So the guarantee for a row on client ``m`` is the composition of client ``m``'s events, and the
guarantee of the whole fit is ``(max_m epsilon_m, max_m delta_m)`` by parallel composition
(DP-PVI paper, proof of Theorem A.1).

With a trusted aggregator each client adds only a share of the noise; the events recorded for
client ``m`` are then those of the *aggregated* release (full noise), and the reported epsilon is
the joint guarantee against the server and any outside observer, valid only if the aggregator
reveals nothing but the noisy sum (DP-PVI Theorems A.10 and A.13).

Recording is plain Python bookkeeping (call it outside ``jit``). Identical events are merged into
counts, so recording 10^4 steps costs 10^4 dictionary updates and one accountant call.
"""

from __future__ import annotations

import math
from numbers import Integral

import numpy as np

from . import backends
from .events import GaussianEvent, check_neighbouring, merge_events
from .noise import TAIL_MASS

_FORMAT = "numpyro_dppvi.PrivacyLedger/2"
_OLD_FORMATS = ("numpyro_dppvi.PrivacyLedger/1",)
#: Where the noise seed of a fit came from (recorded in the ledger and its report).
SEED_KINDS = ("os_entropy", "user_key", "unspecified")
_SEED_TEXT = {
    "os_entropy": "noise seed drawn from the operating system's entropy (secrets); it is never saved",
    "user_key": "noise seed from the user's rng_key: the guarantee holds only while that key stays "
                "secret (anyone who knows it can recompute the noise)",
    "unspecified": "noise seed not recorded",
}
#: What the client sizes the settings were derived from were (:mod:`numpyro_dppvi.privacy.sizes`; reported).
SIZE_KINDS = ("declared", "observed", "unused", "unspecified")
_SIZE_TEXT = {
    "declared": "declared public bounds; nothing published depends on a private size",
    ("observed", "add_remove"): "observed: the published rates and charges disclose each client's size (the "
                                "guarantee covers the records given the sizes); declare Privacy(public_sizes=...)",
    ("observed", "substitute"): "observed; public by definition under substitute (neighbours have equal sizes)",
    "unused": "not used by the mechanism",
    "unspecified": "not recorded",
}


def extra_mass(events) -> float:
    """``sum_t p_t + k TAIL_MASS`` of one client's ``events``: the probabilities the coupling arguments
    charge to delta (Poisson-pad overflow or fold deviation ``p_t`` per release, the noise sampler's tail
    for each of the ``k`` noise coordinates drawn); ``(1 + e^epsilon)`` times this is added to delta."""
    return math.fsum(e.count * (e.overflow_probability + e.dimension * TAIL_MASS) for e in events)


class PrivacyLedger:
    """Records events per client and reports ``(epsilon, delta)``.

    Args:
      num_clients: number of clients (rows of the ledger).
      delta: the target delta at which every client's epsilon is computed.
      neighbouring: ``"add_remove"`` or ``"substitute"``; events' noise multipliers are relative
        to the sensitivity under this relation.
      accountant: ``"pld"`` (dp_accounting PLD, default), ``"rdp"`` (dp_accounting RDP) or
        ``"autodp"`` (autodp RDP).
      trusted_aggregator: the events are those of aggregated releases (see module docstring).
      seed: where the noise seed came from, one of :data:`SEED_KINDS` (reported): ``"os_entropy"``,
        ``"user_key"`` or ``"unspecified"`` (the default).
      sizes: what the client sizes behind the settings were, one of :data:`SIZE_KINDS` (reported):
        ``"declared"`` public bounds, the ``"observed"`` sizes (disclosed under add/remove), ``"unused"``
        by the mechanism, or ``"unspecified"`` (the default).

    Delta accounting: client ``m`` is ``(epsilon_m, delta + extra_m)``-DP where
    ``extra_m = (1 + e^{epsilon_m}) * (sum_t p_t + k_m * TAIL_MASS)`` charges the padded Poisson
    sampler's overflow probabilities ``p_t`` (see :mod:`numpyro_dppvi.privacy.sampling`) and the
    noise sampler's tail mass for each of the ``k_m`` noise coordinates the client's releases drew
    (:mod:`numpyro_dppvi.privacy.noise`; ``k_m = sum_events count * dimension``). Both come from the
    same coupling argument; they are reported by :attr:`delta_per_client` and :meth:`report`.
    """

    def __init__(
        self,
        num_clients: int,
        delta: float,
        neighbouring: str = "add_remove",
        accountant: str = "pld",
        trusted_aggregator: bool = False,
        seed: str = "unspecified",
        sizes: str = "unspecified",
    ):
        if isinstance(num_clients, bool) or not isinstance(num_clients, Integral):
            raise TypeError(f"num_clients must be an int, got {type(num_clients).__name__}.")
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
        if not isinstance(trusted_aggregator, bool):
            raise TypeError("trusted_aggregator must be a bool.")
        self._num_clients = int(num_clients)
        self._delta = backends.check_delta(delta)
        self._neighbouring = check_neighbouring(neighbouring)
        self._accountant = backends.check_backend(accountant)
        self._trusted_aggregator = trusted_aggregator
        if seed not in SEED_KINDS:
            raise ValueError(f"seed={seed!r} is not known; use one of {SEED_KINDS}.")
        self._seed = seed
        if sizes not in SIZE_KINDS:
            raise ValueError(f"sizes={sizes!r} is not known; use one of {SIZE_KINDS}.")
        self._sizes = sizes
        self._events: list[dict[tuple, GaussianEvent]] = [{} for _ in range(self._num_clients)]
        self._stopped: dict[int, dict] = {}
        self._epsilon_cache: dict[tuple, float] = {}

    # ------------------------------------------------------------------ configuration
    @property
    def num_clients(self) -> int:
        return self._num_clients

    @property
    def delta(self) -> float:
        """Target delta at which epsilon is computed (see :attr:`delta_total` for the total)."""
        return self._delta

    @property
    def neighbouring(self) -> str:
        return self._neighbouring

    @property
    def accountant(self) -> str:
        return self._accountant

    @property
    def trusted_aggregator(self) -> bool:
        return self._trusted_aggregator

    @property
    def seed(self) -> str:
        """Where the noise seed came from: ``"os_entropy"``, ``"user_key"`` or ``"unspecified"``."""
        return self._seed

    @property
    def sizes(self) -> str:
        """What the client sizes behind the settings were: ``"declared"`` public bounds, the ``"observed"``
        sizes (disclosed under add/remove), ``"unused"`` or ``"unspecified"`` (not part of equality: the
        accounting does not depend on it)."""
        return self._sizes

    # ------------------------------------------------------------------ recording
    def _check_client(self, client) -> int:
        if isinstance(client, bool) or not isinstance(client, Integral):
            raise TypeError(f"client must be an int index, got {type(client).__name__}.")
        if not 0 <= client < self._num_clients:
            raise ValueError(f"client {client} is out of range [0, {self._num_clients}).")
        return int(client)

    def record(self, client: int, event: GaussianEvent) -> None:
        """Charge ``event`` to ``client``. Raises if the client was stopped or the backend cannot
        account the event (before anything is recorded)."""
        client = self._check_client(client)
        if not isinstance(event, GaussianEvent):
            raise TypeError(f"event must be a GaussianEvent, got {type(event).__name__}.")
        if client in self._stopped:
            raise ValueError(
                f"client {client} was stopped ({self._stopped[client]['reason']}); it must not "
                "release anything more."
            )
        backends.check_supported(
            tuple(self._events[client].values()) + (event,), self._neighbouring, self._accountant
        )
        merged = self._events[client].get(event.mechanism)
        count = event.count + (merged.count if merged is not None else 0)
        self._events[client][event.mechanism] = event.with_count(count)

    def record_all(self, event: GaussianEvent, clients=None) -> None:
        """Charge ``event`` to each of ``clients`` (default: every client not stopped)."""
        if clients is None:
            clients = [m for m in range(self._num_clients) if m not in self._stopped]
        clients = [self._check_client(m) for m in clients]
        for m in clients:  # validate everything first so a failure records nothing
            if m in self._stopped:
                raise ValueError(f"client {m} was stopped; it must not release anything more.")
        for m in clients:
            self.record(m, event)

    def events(self, client: int) -> tuple[GaussianEvent, ...]:
        """The client's merged events (one per distinct mechanism, counts summed)."""
        return tuple(self._events[self._check_client(client)].values())

    def num_releases(self, client: int) -> int:
        return sum(e.count for e in self.events(client))

    # ------------------------------------------------------------------ stop rule bookkeeping
    def stop(self, client: int, reason: str = "epsilon_max", round: int | None = None) -> None:
        """Mark ``client`` as stopped: it releases nothing more (recording for it then raises)."""
        client = self._check_client(client)
        self._stopped[client] = {
            "reason": str(reason), "round": None if round is None else int(round)
        }

    @property
    def stopped(self) -> dict[int, dict]:
        """``{client: {"reason": ..., "round": ...}}`` for stopped clients."""
        return {m: dict(v) for m, v in sorted(self._stopped.items())}

    # ------------------------------------------------------------------ epsilon
    def _epsilon_of(self, events) -> float:
        events = merge_events(events)
        key = tuple(sorted(e.mechanism + (e.count,) for e in events))
        if key not in self._epsilon_cache:
            self._epsilon_cache[key] = backends.epsilon(
                events, self._delta, self._neighbouring, self._accountant
            )
        return self._epsilon_cache[key]

    @property
    def epsilon_per_client(self) -> np.ndarray:
        """Epsilon of each client at :attr:`delta`, in client order (0 for no releases)."""
        return np.array([self._epsilon_of(self.events(m)) for m in range(self._num_clients)])

    @property
    def epsilon(self) -> float:
        """The overall guarantee: ``max_m epsilon_m`` (parallel composition over clients; the
        joint guarantee of the aggregated releases with a trusted aggregator)."""
        return float(np.max(self.epsilon_per_client))

    def epsilon_if(self, client: int, event: GaussianEvent) -> float:
        """Client's epsilon if ``event`` were recorded next (nothing is recorded)."""
        client = self._check_client(client)
        events = self.events(client) + (event,)
        backends.check_supported(events, self._neighbouring, self._accountant)
        return self._epsilon_of(events)

    def _extra_mass(self, client: int) -> float:
        """``sum_t p_t + k_m TAIL_MASS``: Poisson-pad overflow and noise-sampler tail probabilities."""
        return extra_mass(self.events(client))

    @property
    def delta_per_client(self) -> np.ndarray:
        """Total delta of each client: ``delta + (1 + e^{epsilon_m}) (sum_t p_t + k_m TAIL_MASS)``."""
        eps = self.epsilon_per_client
        out = np.full(self._num_clients, self._delta)
        for m in range(self._num_clients):
            mass = self._extra_mass(m)
            if mass > 0.0:
                out[m] += (1.0 + math.exp(min(eps[m], 700.0))) * mass
        return out

    @property
    def delta_total(self) -> float:
        """Overall delta: ``max_m`` of :attr:`delta_per_client`."""
        return float(np.max(self.delta_per_client))

    # ------------------------------------------------------------------ reporting
    def report(self) -> str:
        eps = self.epsilon_per_client
        deltas = self.delta_per_client
        guarantee = (
            "joint guarantee of the aggregated releases (trusted aggregator reveals only sums)"
            if self._trusted_aggregator
            else "each client alone; overall = max over clients (parallel composition)"
        )
        lines = [
            f"Privacy ledger: neighbouring={self._neighbouring}, accountant={self._accountant}, "
            f"target delta={self._delta:.3g}",
            f"Guarantee: {guarantee}",
            f"Noise: {_SEED_TEXT[self._seed]}",
            f"Client sizes: {_SIZE_TEXT.get((self._sizes, self._neighbouring), _SIZE_TEXT.get(self._sizes))}",
            f"{'client':>6} {'releases':>9} {'epsilon':>10} {'delta':>11}  events / status",
        ]
        for m in range(self._num_clients):
            desc = "; ".join(
                f"{e.count}x sigma/Delta={e.noise_multiplier:.4g} {e.sampling}"
                + (f" q={e.rate:.4g}" if e.sampling != "none" else "")
                for e in self.events(m)
            ) or "none"
            if m in self._stopped:
                info = self._stopped[m]
                desc += f"  [stopped: {info['reason']}" + (
                    f", round {info['round']}]" if info["round"] is not None else "]"
                )
            lines.append(
                f"{m:>6} {self.num_releases(m):>9} {eps[m]:>10.4f} {deltas[m]:>11.4g}  {desc}"
            )
        lines.append(
            f"Overall: epsilon={float(np.max(eps)):.4f}, delta={float(np.max(deltas)):.4g}"
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(num_clients={self._num_clients}, delta={self._delta}, "
            f"neighbouring={self._neighbouring!r}, accountant={self._accountant!r}, "
            f"trusted_aggregator={self._trusted_aggregator}, seed={self._seed!r})"
        )

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        """JSON-serialisable state; :meth:`from_dict` restores an equal ledger exactly."""
        return {
            "format": _FORMAT,
            "num_clients": self._num_clients,
            "delta": self._delta,
            "neighbouring": self._neighbouring,
            "accountant": self._accountant,
            "trusted_aggregator": self._trusted_aggregator,
            "seed": self._seed,
            "sizes": self._sizes,
            "events": [[e.to_dict() for e in self.events(m)] for m in range(self._num_clients)],
            "stopped": [{"client": m, **info} for m, info in sorted(self._stopped.items())],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "PrivacyLedger":
        if not isinstance(data, dict) or data.get("format") not in (_FORMAT,) + _OLD_FORMATS:
            raise ValueError(f"not a serialised PrivacyLedger (expected format {_FORMAT!r}).")
        ledger = cls(
            data["num_clients"], data["delta"], data["neighbouring"], data["accountant"],
            data["trusted_aggregator"], seed=data.get("seed", "unspecified"), sizes=data.get("sizes", "unspecified"),
        )
        if len(data["events"]) != ledger.num_clients:
            raise ValueError("serialised ledger has a wrong number of event lists.")
        for m, client_events in enumerate(data["events"]):
            for e in client_events:
                ledger.record(m, GaussianEvent.from_dict(e))
        for info in data["stopped"]:
            ledger.stop(info["client"], info["reason"], info["round"])
        return ledger

    def __eq__(self, other) -> bool:
        if not isinstance(other, PrivacyLedger):
            return NotImplemented
        return self._state_key() == other._state_key()

    def _state_key(self):
        return (
            self._num_clients, self._delta, self._neighbouring, self._accountant,
            self._trusted_aggregator, self._seed,
            tuple(frozenset(e.mechanism + (e.count,) for e in self.events(m))
                  for m in range(self._num_clients)),
            tuple(sorted((m, info["reason"], info["round"]) for m, info in self._stopped.items())),
        )

    __hash__ = None


class NotPrivate:
    """The ``privacy`` of a fit that is not differentially private: says so instead of being ``None``.

    Its ``epsilon`` is infinite, its ``delta`` 1, it is false in a boolean context, and ``report()`` says
    that the fit is not private and why.

    Args:
      reason: why the fit is not private, completing the report's sentence. Default: no privacy was
        requested (``privacy=None``).
    """

    epsilon = math.inf
    delta = 1.0

    def __init__(self, reason: str = "no privacy was requested (privacy=None)"):
        self.reason = str(reason)

    def report(self) -> str:
        return ("This fit is NOT differentially private: " + self.reason + ". Its posterior, history and "
                "saved files may reveal any record of the data; pass privacy=Privacy(...) for a guarantee.")

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"NotPrivate({self.reason!r})"
