"""What each client of a private fit releases, how it is accounted, and the noise it adds.

A plan turns ``Privacy`` (a budget or a noise multiplier) and the fit's shape (client sizes, rounds,
local steps) into: one :class:`~numpyro_dppvi.privacy.GaussianEvent` per participation of a client,
the calibrated noise multiplier of every client (user units: noise std / clip), and the per-client
stop thresholds. The engine records exactly these events for exactly the releases it makes.

* DP optimisation (DESIGN §5.1): ``local_steps`` subsampled releases per participation at rate
  ``q_m = batch / n_m``, sensitivity of a sum of clipped per-example gradients; each client's noise is
  calibrated to its own rate.
* Update perturbation (DESIGN §5.2): one release per participation, rate 1, sensitivity ``2C``
  (a clipped update of a fixed shard), a single noise multiplier for all clients.
* Client-level DP (DESIGN §5.3): the unit is a client; one release per round, clients Poisson-subsampled
  at ``client_rate``, sensitivity of a sum of clipped client updates; every client is charged every
  round (it may be sampled).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..privacy import GaussianEvent, Privacy, sensitivity
from ..privacy.sampling import poisson_overflow_probability, poisson_pad_size


@dataclass
class PrivacyPlan:
    privacy: Privacy
    kind: str  # "dp_sgd" | "shard_update" | "client"
    steps_per_participation: int
    rates: np.ndarray
    overflow: np.ndarray
    noise_multipliers: np.ndarray = None
    max_batch: int = 0

    def event(self, m: int, participations: int, noise_multiplier: float | None = None) -> GaussianEvent:
        """The event of ``participations`` participations of client ``m``."""
        z = float(self.noise_multipliers[m] if noise_multiplier is None else noise_multiplier)
        count = int(self.steps_per_participation * participations)
        p = self.privacy
        if self.kind == "shard_update":
            return GaussianEvent(z * p.clip / sensitivity(p.clip, p.neighbouring, "shard_update"), "none", 1.0, count)
        return p.step_event(z, float(self.rates[m]), count, float(self.overflow[m]))

    def calibrate(self, rounds: int | None) -> None:
        """Noise multiplier per client for the planned ``rounds`` (clients with equal plans share one)."""
        p = self.privacy
        if p.epsilon is not None and p.noise_multiplier is None and rounds is None:
            raise ValueError("calibrating the noise to a budget needs the planned number of rounds: "
                             "pass rounds=... to DPPVI (fit_dppvi does this for you)")
        rounds = rounds or 1
        solved: dict[tuple, float] = {}
        out = []
        for m in range(len(self.rates)):
            key = (float(self.rates[m]), float(self.overflow[m]))
            if key not in solved:
                solved[key] = p.resolve(lambda z, m=m: [self.event(m, rounds, z)])
            out.append(solved[key])
        self.noise_multipliers = np.asarray(out)

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


def dp_sgd_plan(privacy: Privacy, sizes, batch_size: int, local_steps: int, rounds: int | None) -> PrivacyPlan:
    sizes = np.asarray(sizes, int)
    if np.any(batch_size >= sizes):
        raise ValueError(f"batch_size={batch_size} must be smaller than every client's size "
                         f"(smallest: {sizes.min()}) so that batches are subsampled; lower batch_size")
    rates = batch_size / sizes
    if privacy.sampling == "poisson":
        steps = local_steps * (rounds or 1)
        max_batch = max(poisson_pad_size(int(n), float(q), steps) for n, q in zip(sizes, rates))
        overflow = np.array([poisson_overflow_probability(int(n), float(q), max_batch) for n, q in zip(sizes, rates)])
    else:
        max_batch, overflow = batch_size, np.zeros(len(sizes))
    plan = PrivacyPlan(privacy, "dp_sgd", local_steps, rates, overflow, max_batch=int(max_batch))
    plan.calibrate(rounds)
    return plan


def shard_update_plan(privacy: Privacy, num_clients: int, rounds: int | None) -> PrivacyPlan:
    plan = PrivacyPlan(privacy, "shard_update", 1, np.ones(num_clients), np.zeros(num_clients))
    plan.calibrate(rounds)
    return plan


def client_level_plan(privacy: Privacy, num_clients: int, rounds: int | None, client_rate: float) -> PrivacyPlan:
    if not (0.0 < client_rate <= 1.0):
        raise ValueError(f"client_rate must be in (0, 1], got {client_rate}")
    if client_rate < 1.0 and privacy.sampling != "poisson":
        raise ValueError("client subsampling is Poisson sampling over clients; use Privacy(sampling='poisson')")
    plan = PrivacyPlan(privacy, "client", 1, np.full(num_clients, client_rate), np.zeros(num_clients))
    plan.calibrate(rounds)
    return plan
