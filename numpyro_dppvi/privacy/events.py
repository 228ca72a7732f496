"""Privacy events: what one Gaussian release costs, in a backend-neutral unit.

An event says that a vector ``f(D) + N(0, s^2 I)`` was released ``count`` times, where ``f`` is a
sum over records (possibly of a subsampled batch) and

    noise_multiplier = s / Delta,

with ``Delta`` the L2 sensitivity of ``f`` **under the ledger's neighbouring relation**
(see :func:`sensitivity`). Each accountant backend translates this to its own library's unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from numbers import Integral, Real

NEIGHBOURING_RELATIONS = ("add_remove", "substitute")
SAMPLING_SCHEMES = ("none", "poisson", "without_replacement")
SENSITIVITY_KINDS = ("sum_of_records", "shard_update")


def check_neighbouring(neighbouring: str) -> str:
    """Return ``neighbouring`` if it names a known relation, else raise a ValueError naming them."""
    if neighbouring not in NEIGHBOURING_RELATIONS:
        raise ValueError(
            f"neighbouring={neighbouring!r} is not a known relation; use one of "
            f"{NEIGHBOURING_RELATIONS} ('add_remove': one record added or removed; "
            "'substitute': one record replaced, dataset size public)."
        )
    return neighbouring


def _positive_finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}.")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}.")
    return value


def sensitivity(clip: float, neighbouring: str, kind: str = "sum_of_records") -> float:
    """L2 sensitivity of a released sum whose terms are clipped to norm ``clip``.

    * ``kind="sum_of_records"`` (DP-SGD: ``sum_i clip(g_i)`` over the records of a batch):
      add/remove changes the sum by one term, ``||clip(g)|| <= C``, so ``Delta = C``;
      substitution replaces one term, ``||clip(g) - clip(g')|| <= 2C``, so ``Delta = 2C``.
    * ``kind="shard_update"`` (a clipped update computed from a whole fixed shard, e.g. parameter
      perturbation / local averaging / virtual clients, DP-PVI paper eqs. A.18-A.19): changing one
      record of the shard may change the whole update, both old and new updates have norm
      ``<= C``, so ``Delta = 2C`` under either relation.

    Args:
      clip: the clip norm ``C > 0`` of each term.
      neighbouring: ``"add_remove"`` or ``"substitute"``.
      kind: ``"sum_of_records"`` (default) or ``"shard_update"``.
    """
    clip = _positive_finite("clip", clip)
    check_neighbouring(neighbouring)
    if kind == "sum_of_records":
        return clip if neighbouring == "add_remove" else 2.0 * clip
    if kind == "shard_update":
        return 2.0 * clip
    raise ValueError(f"kind={kind!r} is not known; use one of {SENSITIVITY_KINDS}.")


@dataclass(frozen=True)
class GaussianEvent:
    """``count`` Gaussian releases of a (subsampled) sum.

    Attributes:
      noise_multiplier: noise std divided by the L2 sensitivity of the released sum under the
        ledger's neighbouring relation (:func:`sensitivity`).
      sampling: ``"none"`` (the whole data, ``rate`` must be 1), ``"poisson"`` (each record
        independently with probability ``rate``) or ``"without_replacement"`` (a fixed-size batch,
        ``rate = batch / n``, drawn afresh each step; substitute relation only).
      rate: sampling rate in (0, 1].
      count: number of identical releases (steps), an int >= 1.
      overflow_probability: per-release probability that a padded Poisson batch overflowed its
        pad (see :mod:`numpyro_dppvi.privacy.sampling`); charged to delta by the ledger.
      dimension: number of noise coordinates drawn per release; the ledger charges the noise
        sampler's tail mass (:data:`numpyro_dppvi.privacy.noise.TAIL_MASS`) for each.
    """

    noise_multiplier: float
    sampling: str = "none"
    rate: float = 1.0
    count: int = 1
    overflow_probability: float = 0.0
    dimension: int = 1

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "noise_multiplier", _positive_finite("noise_multiplier", self.noise_multiplier))
        if self.sampling not in SAMPLING_SCHEMES:
            raise ValueError(
                f"sampling={self.sampling!r} is not known; use one of {SAMPLING_SCHEMES}."
            )
        rate = _positive_finite("rate", self.rate)
        if rate > 1.0:
            raise ValueError(f"rate must lie in (0, 1], got {rate}.")
        if self.sampling == "none" and rate != 1.0:
            raise ValueError(
                f"sampling='none' releases the whole data, so rate must be 1 (got {rate}); "
                "use sampling='poisson' or 'without_replacement' for a subsampled release."
            )
        set_(self, "rate", rate)
        if isinstance(self.count, bool) or not isinstance(self.count, Integral):
            raise TypeError(f"count must be an int, got {type(self.count).__name__}.")
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}.")
        set_(self, "count", int(self.count))
        p = self.overflow_probability
        if isinstance(p, bool) or not isinstance(p, Real) or not (0.0 <= float(p) < 1.0):
            raise ValueError(f"overflow_probability must lie in [0, 1), got {p!r}.")
        if float(p) > 0.0 and self.sampling != "poisson":
            raise ValueError("overflow_probability applies to sampling='poisson' only.")
        set_(self, "overflow_probability", float(p))
        if isinstance(self.dimension, bool) or not isinstance(self.dimension, Integral) or self.dimension < 1:
            raise ValueError(f"dimension must be an int >= 1 (noise coordinates per release), got {self.dimension!r}.")
        set_(self, "dimension", int(self.dimension))

    @property
    def mechanism(self) -> tuple:
        """Everything but ``count``: events with equal ``mechanism`` merge by adding counts."""
        return (self.noise_multiplier, self.sampling, self.rate, self.overflow_probability, self.dimension)

    def with_count(self, count: int) -> "GaussianEvent":
        return replace(self, count=count)

    def with_noise_multiplier(self, noise_multiplier: float) -> "GaussianEvent":
        return replace(self, noise_multiplier=noise_multiplier)

    def to_dict(self) -> dict:
        return {
            "noise_multiplier": self.noise_multiplier,
            "sampling": self.sampling,
            "rate": self.rate,
            "count": self.count,
            "overflow_probability": self.overflow_probability,
            "dimension": self.dimension,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "GaussianEvent":
        unknown = set(data) - {
            "noise_multiplier", "sampling", "rate", "count", "overflow_probability", "dimension"
        }
        if unknown:
            raise ValueError(f"unknown GaussianEvent fields {sorted(unknown)}.")
        return cls(**data)


def merge_events(events) -> tuple[GaussianEvent, ...]:
    """Merge events with the same mechanism by adding their counts (order of first appearance).

    Args:
      events: an iterable of :class:`GaussianEvent` s.

    Returns:
      a tuple of :class:`GaussianEvent` s, one per distinct mechanism.
    """
    counts: dict[tuple, int] = {}
    first: dict[tuple, GaussianEvent] = {}
    for event in events:
        if not isinstance(event, GaussianEvent):
            raise TypeError(f"expected a GaussianEvent, got {type(event).__name__}.")
        key = event.mechanism
        counts[key] = counts.get(key, 0) + event.count
        first.setdefault(key, event)
    return tuple(first[k].with_count(counts[k]) for k in first)
