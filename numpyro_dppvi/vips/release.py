"""The private release of a minibatch ESS sum: one joint Gaussian draw, and its accounting.

Mechanism (VIPS paper §3.2 and Eq. 72). Every record's ESS blocks are clipped to their bounds
``C_b`` (:func:`~numpyro_dppvi.vips.engine.clip_example_blocks`). The released vector is the
concatenation of ``S_b / C_b`` over the ``B`` blocks, where ``S_b`` is the batch sum of block
``b``, plus ``N(0, (sigma sqrt(B))^2 I)``; the engine multiplies each block back by ``C_b``, so
block ``b`` carries noise of std ``sigma sqrt(B) C_b``.

Sensitivity: one record's rescaled blocks have joint norm ``<= sqrt(B)`` (each ``<= 1``), so the
rescaled sum moves by ``<= sqrt(B)`` when a record is added or removed and ``<= 2 sqrt(B)``
when one is replaced. ``sqrt(B)`` plays the role of the clip norm ``C`` of DP-SGD, and
``sigma = Privacy.noise_multiplier`` is noise std / ``C`` as everywhere in the package; the
event noise multiplier (std / sensitivity) is ``Privacy.to_event(sigma)``. Symmetric matrix
blocks get noise on the upper triangle (with the diagonal), mirrored
(:func:`~numpyro_dppvi.privacy.symmetric_gaussian_noise`); those are the independent
coordinates of the release, and their change is bounded by the Frobenius norm of the
change, so the same sensitivity holds.

Accounting: ``T`` identical releases with the sampler's rate (Poisson with a padded batch, or
fixed-size batches without replacement under substitution), recorded on a one-client
:class:`~numpyro_dppvi.privacy.PrivacyLedger` — the sampler used is the one accounted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dppvi.privacy import (
    GaussianEvent, Privacy, PrivacyLedger, add_gaussian_noise, add_symmetric_noise, poisson_batch,
    poisson_overflow_probability, poisson_pad_size, without_replacement_batch)
from numpyro_dppvi.privacy.ledger import extra_mass
from numpyro_dppvi.vips.engine import joint_sensitivity, scale_bounds


@dataclass
class ReleasePlan:
    """Everything fixed before the first iteration of a private fit.

    Attributes:
        bounds: block name -> clip bound ``C_b`` (model bound times ``Privacy.clip``).
        noise_multiplier: ``sigma``, noise std / joint clip norm ``sqrt(B)``.
        noise_std_rescaled: ``sigma sqrt(B)``, the std in bound-rescaled units.
        event: the :class:`GaussianEvent` of all ``T`` releases.
        sampler: ``key -> (indices, mask)``, static batch shape.
        privacy: the user's :class:`Privacy`.
    """

    bounds: dict
    noise_multiplier: float
    noise_std_rescaled: float
    event: GaussianEvent
    sampler: Callable
    privacy: Privacy

    def record(self, ledger: PrivacyLedger | None = None, client: int = 0, seed: str = "unspecified") -> PrivacyLedger:
        """Record the fit's releases (a new one-client ledger unless one is given)."""
        ledger = self.privacy.ledger(1, seed=seed, charges=extra_mass([self.event])) if ledger is None else ledger
        ledger.record(client, self.event)
        return ledger


def make_sampler(privacy: Privacy, n: int, batch_size: int, iterations: int, size: int | None = None):
    """``(sampler, rate, overflow_probability)`` for the configured sampling scheme over ``n`` rows;
    the rate, pad and charge come from ``size`` (the public size, :mod:`~numpyro_dppvi.privacy.sizes`;
    default ``n``), the largest number of rows the guarantee covers."""
    size = n if size is None else int(size)
    rate = batch_size / size
    if batch_size == size:
        def sample_all(key):
            del key
            return jnp.arange(n), jnp.ones(n, dtype=bool)
        return sample_all, 1.0, 0.0
    if privacy.sampling == "poisson":
        pad = poisson_pad_size(size, rate, iterations)
        overflow = poisson_overflow_probability(size, rate, pad)
        return (lambda key: poisson_batch(key, n, rate, pad)), rate, overflow
    return (lambda key: without_replacement_batch(key, n, batch_size)), rate, 0.0


def plan_release(privacy: Privacy, block_bounds, n: int, batch_size: int, iterations: int,
                 dimension: int = 1, size: int | None = None) -> ReleasePlan:
    """Clip bounds, sampler, noise (calibrated to ``privacy.epsilon`` if no noise is given)
    and the event of a private VIPS fit of ``iterations`` steps, each drawing ``dimension`` noise
    coordinates (:func:`noise_coordinates`)."""
    if not isinstance(privacy, Privacy):
        raise TypeError("privacy must be a numpyro_dppvi.Privacy(...) or None.")
    if privacy.epsilon_max is not None:
        raise ValueError("epsilon_max is a per-client stop rule of federated fits; fit_vips runs a fixed "
                         "number of releases: give epsilon (the budget) or noise_multiplier instead.")
    if privacy.adaptive is not None:
        raise ValueError("VIPS clips every ESS block to its declared bound; adaptive_clip is not supported.")
    bounds = scale_bounds(block_bounds, privacy.clip)
    sampler, rate, overflow = make_sampler(privacy, n, batch_size, iterations, size)

    def plan(noise_multiplier):
        return [privacy.step_event(noise_multiplier, rate, iterations, overflow, dimension)]

    sigma = privacy.resolve(plan)
    joint = joint_sensitivity(bounds)
    return ReleasePlan(bounds=bounds, noise_multiplier=float(sigma), noise_std_rescaled=float(sigma * joint),
                       event=plan(sigma)[0], sampler=sampler, privacy=privacy)


def release_ess(ess_sum: dict, bounds: dict, noise_std_rescaled, key, symmetric_blocks=()) -> dict:
    """``S_b + C_b * noise_b`` for every block, with one independent key per block.

    ``noise_b`` has std ``noise_std_rescaled``; for a block named in ``symmetric_blocks`` the
    noise is symmetric in the last two axes (drawn per leading index). The noise comes from the
    float64 sampler of :mod:`numpyro_dppvi.privacy.noise` and is added before rounding.
    """
    names = sorted(ess_sum)
    keys = dict(zip(names, jax.random.split(key, len(names))))
    released = {}
    for name in names:
        block = ess_sum[name]
        std = bounds[name] * noise_std_rescaled
        if name in symmetric_blocks:
            released[name] = add_symmetric_noise(keys[name], block, std)
        else:
            released[name] = add_gaussian_noise(keys[name], block, std)
    return released


def noise_coordinates(ess_sum: dict, symmetric_blocks=()) -> int:
    """Noise coordinates of one release (symmetric blocks: the upper triangle with the diagonal)."""
    total = 0
    for name, block in ess_sum.items():
        shape = jnp.shape(block)
        if name in symmetric_blocks:
            lead = int(np.prod(shape[:-2], dtype=int))
            total += lead * shape[-1] * (shape[-1] + 1) // 2
        else:
            total += int(np.prod(shape, dtype=int))
    return total
