"""What each client of a private fit releases, how it is accounted, and the noise it adds.

A plan turns ``Privacy`` (a budget or a noise multiplier) and the fit's shape (client sizes, rounds,
local steps, the number of noise coordinates) into: one :class:`~numpyro_dppvi.privacy.GaussianEvent`
per participation of a client, the calibrated noise multiplier of every client (user units: noise
std / clip), and the largest number of participations each client's budget allows (the stop rule,
checked inside the compiled round). The engine records exactly these events for exactly the
releases it makes.

* DP optimisation (DESIGN §5.1): ``local_steps`` subsampled releases per participation at rate
  ``q_m = batch / n_m`` (Poisson: rounded up to 9 significant bits, :func:`~numpyro_dppvi.privacy.sampling.accounted_rate`,
  so that clients of nearly equal size share one mechanism), sensitivity of a sum of clipped
  per-example gradients; each client's noise is calibrated to its own rate.
* Update perturbation (DESIGN §5.2): one release per participation, rate 1, a single noise multiplier
  for all clients; sensitivity ``2C`` with hashed shards, ``C`` (add/remove) with one record per shard
  (:mod:`.shards`).
* Client-level DP (DESIGN §5.3): the unit is a client; one release per round, clients Poisson-subsampled
  at ``client_rate``, sensitivity of a sum of clipped client updates; every client is charged every
  round (it may be sampled).

``sizes`` are the clients' public sizes (:mod:`numpyro_dppvi.privacy.sizes`: declared bounds, or the observed
sizes, which add/remove treats as private and the fit warns about): the rates, charges and shard counts
derived from them are settings of the mechanism, fixed when the plan is made. The overflow charge is
computed at the size given (plus one row): a declared bound covers every data set within it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..privacy import GaussianEvent, Privacy, sensitivity
from ..privacy import backends
from ..privacy.ledger import extra_mass
from ..privacy.config import DELTA_RESERVE
from ..privacy.sampling import accounted_rate, fold_chunk, poisson_fold_deviation

#: ``limits`` value of a client without a budget cap.
UNLIMITED = 2**30


@dataclass
class PrivacyPlan:
    """What each client of a private fit releases and is charged (module docstring), made by
    :func:`dp_sgd_plan`, :func:`shard_update_plan` or :func:`client_level_plan`.

    Attributes:
        privacy: the fit's :class:`~numpyro_dppvi.privacy.Privacy` (budget or noise multiplier, clip,
            sampling, neighbouring relation, accountant).
        kind: ``"dp_sgd"`` (DP optimisation), ``"shard_update"`` (update perturbation) or ``"client"``
            (client-level DP).
        steps_per_participation: releases per participation (``local_steps`` for DP-SGD, else 1).
        rates: ``[M]`` sampling rate of each client's releases (DP-SGD: ``q_m = batch / n_m``, Poisson
            rates rounded up by :func:`~numpyro_dppvi.privacy.sampling.accounted_rate`; update
            perturbation: 1; client-level: ``client_rate``).
        overflow: ``[M]`` probability per release charged to delta for the Poisson sampler's deviation
            (zeros for the other samplers and kinds).
        dimension: noise coordinates drawn per release (the events' ``dimension``; DP-SGD with adaptive
            clipping counts the noisy count too).
        noise_multipliers: ``[M]`` noise multiplier of each client in user units (noise std / clip), set by
            :meth:`calibrate`; None before.
        max_batch: the fixed batch of sampling without replacement (DP-SGD's ``batch_size``; 0 otherwise).
        chunk: rows per chunk of a Poisson batch (:func:`~numpyro_dppvi.privacy.sampling.poisson_fold`).
        row_sampler: Poisson batches drawn row by row
            (:func:`~numpyro_dppvi.privacy.sampling.row_fold`), which charges nothing to delta.
        sensitivity_kind: of an update-perturbation release: ``"shard_update"`` (hashed shards, ``2C``) or
            ``"sum_of_records"`` (one record per shard; :func:`~numpyro_dppvi.privacy.sensitivity`).
        calibrated_participations: the participations the noise was calibrated for, so that they meet
            the budget (0 when the noise multiplier was given).
    """

    privacy: Privacy
    kind: str  # "dp_sgd" | "shard_update" | "client"
    steps_per_participation: int
    rates: np.ndarray
    overflow: np.ndarray
    dimension: int  # noise coordinates drawn per release
    noise_multipliers: np.ndarray = None
    max_batch: int = 0  # the fixed batch of sampling without replacement
    chunk: int = 0  # rows per chunk of a Poisson batch (poisson_fold)
    row_sampler: bool = False  # Poisson batches drawn row by row (sampling.row_fold), nothing charged to delta
    sensitivity_kind: str = "sum_of_records"  # of a shard release: "shard_update" (hashed shards) or per record
    calibrated_participations: int = 0  # noise calibrated so that this many participations meet the budget

    def event(self, m: int, participations: int, noise_multiplier: float | None = None) -> GaussianEvent:
        """The event of ``participations`` participations of client ``m``."""
        z = float(self.noise_multipliers[m] if noise_multiplier is None else noise_multiplier)
        count = int(self.steps_per_participation * participations)
        p = self.privacy
        if self.kind == "shard_update":
            event_nm = z * p.clip / sensitivity(p.clip, p.neighbouring, self.sensitivity_kind)
            return GaussianEvent(event_nm, "none", 1.0, count, dimension=self.dimension)
        return p.step_event(z, float(self.rates[m]), count, float(self.overflow[m]), self.dimension)

    def calibrate(self, rounds: int | None) -> None:
        """Noise multiplier per client for the planned ``rounds`` (clients with equal plans share one)."""
        p = self.privacy
        if p.epsilon is not None and p.noise_multiplier is None and rounds is None:
            raise ValueError("calibrating the noise to a budget needs the planned number of rounds: "
                             "pass rounds=... to DPPVI (fit_dppvi does this for you)")
        rounds = rounds or 1
        charges = self.charges(rounds)
        solved: dict[float, float] = {}
        out = []
        for m in range(len(self.rates)):
            key = float(self.rates[m])  # epsilon does not depend on the overflow charge (it is delta's)
            if key not in solved:
                solved[key] = p.resolve(lambda z, m=m: [self.event(m, rounds, z)], charges)
            out.append(solved[key])
        self.noise_multipliers = np.asarray(out)
        if p.noise_multiplier is None:
            self.calibrated_participations = rounds

    def calibrated_at_once(self, rounds: int | None) -> bool:
        """Whether :meth:`calibrate` answers without running the accountant (a noise multiplier alone, or
        every client's calibration memoised)."""
        p = self.privacy
        if p.epsilon is not None and p.noise_multiplier is None and rounds is None:
            return True  # calibrate raises at once
        charges = self.charges(rounds)
        return all(p.resolves_at_once(lambda z, m=m: [self.event(m, rounds or 1, z)], charges)
                   for m in np.unique(self.rates, return_index=True)[1])

    def charges(self, rounds: int | None) -> float:
        """The largest over clients of the probabilities ``rounds`` participations charge to delta
        (:func:`~numpyro_dppvi.privacy.ledger.extra_mass`): the ledger's delta is the requested one less
        ``(1 + e^epsilon)`` times this (:meth:`~numpyro_dppvi.privacy.Privacy.accounting_delta`)."""
        return max(extra_mass([self.event(m, rounds or 1, 1.0)]) for m in range(len(self.rates)))

    def noise_std(self, m: int) -> float:
        """Std of the Gaussian noise client ``m`` (or, client-level, the server) adds to its released sum."""
        z = float(self.noise_multipliers[m])
        if self.kind == "dp_sgd":
            return float(self.privacy.gradient_noise_std(z))
        return z * self.privacy.clip

    def epsilon_max(self, num_clients: int) -> np.ndarray:
        """Stop thresholds: ``Privacy.epsilon_max``, else the budget itself when one was given."""
        p = self.privacy
        if p.epsilon_max is None and p.epsilon is not None:
            return np.full(num_clients, p.epsilon)
        return p.epsilon_max_per_client(num_clients)

    def limits(self, ledger, participations, horizon: int) -> np.ndarray:
        """``[M]`` int: the largest total participation count each client's budget allows, searched up
        to ``horizon`` more participations than ``participations`` (the counts already charged, whose
        events are in ``ledger``); :data:`UNLIMITED` without a cap or when the horizon fits.

        A client may take part once more while ``epsilon(ledger events + next participation)`` stays
        within ``epsilon_max * (1 + 1e-9)``. Epsilon is monotone in the count, so a bisection needs
        ``log2(horizon)`` accountant calls per distinct (plan, ledger) pair; usually one call (the
        whole horizon fits, which calibration to the same budget guarantees).
        """
        caps = self.epsilon_max(len(self.rates))
        out = np.full(len(self.rates), UNLIMITED, dtype=np.int64)
        p = self.privacy
        if p.epsilon_max is None and p.epsilon is not None and \
                int(np.max(participations, initial=0)) + horizon <= self.calibrated_participations:
            return out  # the noise was calibrated so that the whole horizon meets the budget
        solved: dict[tuple, int] = {}
        for m, cap in enumerate(caps):
            if not math.isfinite(cap):
                continue
            base = ledger.events(m)
            key = (tuple(sorted(e.mechanism + (e.count,) for e in base)), self.event(m, 1).mechanism, float(cap))
            if key not in solved:
                solved[key] = _largest_count(lambda k: self._epsilon(ledger, base, m, k), cap * (1 + 1e-9), horizon)
            k = solved[key]
            out[m] = UNLIMITED if k >= horizon else int(participations[m]) + k
        return out

    def _epsilon(self, ledger, base, m, k):
        events = tuple(base) + ((self.event(m, k),) if k > 0 else ())
        if not events:
            return 0.0
        return backends.epsilon(events, ledger.delta, ledger.neighbouring, ledger.accountant)


def _largest_count(epsilon_of, cap: float, horizon: int) -> int:
    """Largest ``k`` in ``[0, horizon]`` with ``epsilon_of(k) <= cap`` (``epsilon_of`` increasing)."""
    if epsilon_of(horizon) <= cap:
        return horizon
    if epsilon_of(0) > cap:
        return 0
    lo, hi = 0, horizon  # epsilon_of(lo) <= cap < epsilon_of(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if epsilon_of(mid) <= cap:
            lo = mid
        else:
            hi = mid
    return lo


def check_subsampled(batch_size: int, sizes, caller: str = "fit_dppvi") -> None:
    """DP-SGD needs a sampling rate below 1 on every client (a batch smaller than the client): a clear
    error naming the clients and a batch size that works, in the options of ``caller``."""
    sizes = np.asarray(sizes, int)
    small = np.flatnonzero(batch_size >= sizes)
    if small.size:
        fix = "or merge the small clients" if caller != "fit_global_vi" else "(the pooled data is one client)"
        raise ValueError(f"{caller}: batch_size={batch_size} is not smaller than client(s) {small.tolist()[:10]} "
                         f"(sizes {sizes[small].tolist()[:10]}), so their batches would not be subsampled; use "
                         f"batch_size <= {max(int(sizes.min()) // 2, 1)} {fix}")


def walk_costs_delta(epsilon: float | None, delta: float, walk_charge: float) -> bool:
    """Whether the geometric-skip walk (:func:`~numpyro_dppvi.privacy.sampling.poisson_fold`) would charge a
    budget's delta more than its reserve (:data:`~numpyro_dppvi.privacy.config.DELTA_RESERVE`): ``(1 +
    e^epsilon) walk_charge > DELTA_RESERVE delta``, ``walk_charge`` the planned participations' summed deviation
    (``~ n 2^-48`` per step: large data, many steps, a large epsilon). The plan then draws each row on its own
    bits (:func:`~numpyro_dppvi.privacy.sampling.row_fold`), which charges nothing: slower (``n`` random words a
    step) but the whole delta goes to the accountant, where the walk would take it (or, past delta, make the
    budget unmeetable). Without a budget (a noise multiplier alone) the walk's charge is reported, not spent."""
    if epsilon is None:
        return False
    return (1.0 + math.exp(min(float(epsilon), 700.0))) * walk_charge > DELTA_RESERVE * delta


def dp_sgd_plan(privacy: Privacy, sizes, batch_size: int, local_steps: int, rounds: int | None,
                dimension: int, calibrate: bool = True, budget_epsilon: float | None = None) -> PrivacyPlan:
    """The DP-SGD plan of clients of ``sizes``: the rates, the sampler and its charges, the noise calibrated to
    ``rounds`` participations of ``local_steps`` steps. The sampler: Poisson by the geometric-skip walk, or row
    by row where the walk would cost the budget delta (:func:`walk_costs_delta`; the budget's epsilon is
    ``privacy.epsilon``, or ``budget_epsilon`` when the privacy is pinned to a noise multiplier, as on a Flower
    node, so that both derive the same sampler)."""
    sizes = np.asarray(sizes, int)
    check_subsampled(batch_size, sizes)
    if privacy.sampling == "poisson":  # rates rounded up so that clients of nearly equal size share one
        rates = np.array([accounted_rate(batch_size, int(n)) for n in sizes])
    else:  # a fixed batch without replacement: the rate is exactly batch / n
        rates = batch_size / sizes
    chunk = fold_chunk(batch_size)
    row_sampler = False
    if privacy.sampling == "poisson":  # never padded, never cut: only the skips' deviation is charged
        overflow = np.array([poisson_fold_deviation(int(n), float(q), chunk) for n, q in zip(sizes, rates)])
        walk_charge = float(np.max(overflow, initial=0.0)) * local_steps * (rounds or 1)
        row_sampler = walk_costs_delta(privacy.epsilon if budget_epsilon is None else budget_epsilon,
                                       privacy.delta, walk_charge)
        if row_sampler:
            overflow = np.zeros(len(sizes))
    else:
        overflow = np.zeros(len(sizes))
    if privacy.adaptive_clip is not None:
        dimension += 1  # the noisy count of the private quantile estimate
    plan = PrivacyPlan(privacy, "dp_sgd", local_steps, rates, overflow, dimension, max_batch=int(batch_size),
                       chunk=chunk, row_sampler=row_sampler)
    if calibrate:
        plan.calibrate(rounds)
    return plan


def shard_update_plan(privacy: Privacy, num_clients: int, rounds: int | None, dimension: int,
                      one_record_per_shard: bool, calibrate: bool = True) -> PrivacyPlan:
    """The update-perturbation plan of ``num_clients`` clients: one release per participation, of the
    clipped change computed from the client's whole data (rate 1, no sampling), with ``dimension`` noise
    coordinates; one noise multiplier for all clients, calibrated to ``rounds`` participations
    (``calibrate=False``: left to the caller). Sensitivity ``2C`` with hashed shards, or that of a sum
    of records (``C`` under add/remove) when ``one_record_per_shard``."""
    kind = "sum_of_records" if one_record_per_shard else "shard_update"
    plan = PrivacyPlan(privacy, "shard_update", 1, np.ones(num_clients), np.zeros(num_clients), dimension,
                       sensitivity_kind=kind)
    if calibrate:
        plan.calibrate(rounds)
    return plan


def client_level_plan(privacy: Privacy, num_clients: int, rounds: int | None, client_rate: float,
                      dimension: int, calibrate: bool = True) -> PrivacyPlan:
    """The client-level DP plan: the unit is a client; one release per round (the noisy sum of the clipped
    client changes, noise std ``noise_multiplier * clip``), clients Poisson-subsampled at ``client_rate``
    (1: all of them) and every client charged every round; the noise calibrated to ``rounds`` rounds
    (``calibrate=False``: left to the caller). Raises ``ValueError`` for ``client_rate`` outside ``(0, 1]``,
    or below 1 without ``Privacy(sampling="poisson")``."""
    if not (0.0 < client_rate <= 1.0):
        raise ValueError(f"client_rate must be in (0, 1], got {client_rate}")
    if client_rate < 1.0 and privacy.sampling != "poisson":
        raise ValueError("client subsampling is Poisson sampling over clients; use Privacy(sampling='poisson')")
    plan = PrivacyPlan(privacy, "client", 1, np.full(num_clients, client_rate), np.zeros(num_clients), dimension)
    if calibrate:
        plan.calibrate(rounds)
    return plan
