"""Private adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially private
learning with adaptive clipping", Algorithm 1 with geometric update).

The clip norm ``C_t`` tracks the ``gamma``-quantile of per-example gradient norms. At each step,
on the same (subsampled) batch as the gradient sum, the client releases the noisy centred count

    b_t = sum_{i in batch} (1[||g_i|| <= C_t] - 1/2) + N(0, s_b^2)

and updates ``C_{t+1} = C_t * exp(-eta * (b_t / m + 1/2 - gamma))`` with ``m`` the *expected*
batch size (the realised Poisson batch size is private and never used). No non-private
percentile of the data is ever computed.

Sensitivity and accounting. Per record the count term ``1[.] - 1/2`` lies in ``[-1/2, 1/2]``:
one added/removed record moves the count by ``<= 1/2``, a replaced one by ``<= 1``. The step
releases the pair ``(sum clip(g_i) + N(0, s_g^2 I), b_t)``; whitening each block by its noise
std turns it into one Gaussian mechanism with unit noise and sensitivity
``sqrt((Delta_g / s_g)^2 + (Delta_b / s_b)^2)``, i.e. a single event with

    z = (z_g^-2 + z_b^-2)^-1/2,     z_g = s_g / Delta_g,  z_b = s_b / Delta_b

(Andrew et al., Theorem 1 / Sec. 3.1). Since ``s_g = z_g * Delta_g(C_t)`` scales with the
current clip, ``z_g`` is constant. Given the calibrated total ``z`` and the fraction ``f`` of
the "precision" ``z^-2`` spent on the count, :func:`split_noise_multiplier` returns
``z_g = z / sqrt(1 - f)`` and ``z_b = z / sqrt(f)``: the budget of the plain run is kept exactly.
The whitening needs the two blocks' noises independent: DP-PVI's local step draws them as disjoint
coordinates of one draw of the sampler (``add_gaussian_noise(key, (sum, count), (s_g, s_b))``), then
updates the clip by :func:`adaptive_clip_step`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .events import GaussianEvent, check_neighbouring
from .noise import add_gaussian_noise


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: The std of the noisy fraction below which :attr:`AdaptiveClip.noise_scaled_rate` keeps the full step.
FRACTION_NOISE = 0.1


@dataclass(frozen=True)
class AdaptiveClip:
    """Adaptive clipping settings for :class:`~numpyro_dppvi.privacy.config.Privacy`.

    Attributes:
      target_quantile: ``gamma`` in (0, 1), the quantile of per-example norms to track.
      learning_rate: ``eta > 0`` of the geometric update (Andrew et al. use 0.2).
      count_budget_fraction: ``f`` in (0, 1), share of ``z^-2`` spent on the count query.
        ``f = 0.01`` makes the gradient noise 0.5% larger and the count noise std ``10 z``
        times its sensitivity (5 counts at ``z = 1`` under add/remove; Andrew et al. suggest
        ``m / 20``, i.e. 5 for batches of 100).
      noise_scaled_rate: the geometric step is ``learning_rate * min(1, fraction_noise / s_b)``, ``s_b`` the std of
        the noisy fraction ``b_t / m`` (public: the count's noise std over the expected batch). Where the count's
        noise swamps the fraction (large noise multipliers: ``s_b = z_b Delta_b / m``), the plain step makes ``log C`` a
        random walk of ``learning_rate * s_b`` a step (measured: 400 steps at ``z = 37``, batches of 100, took the
        clip to ``e^+-15``); the scaled one bounds it at ``learning_rate * fraction_noise`` a step, still moving
        ``log C`` by ``learning_rate * fraction_noise / s_b`` per unit of quantile error. False (Andrew et al.'s
        rule) by default; :data:`~numpyro_dppvi.privacy.config.AUTO_CLIP` sets it.
      fraction_noise: the std of the noisy fraction below which ``noise_scaled_rate`` keeps the full step
        (default :data:`FRACTION_NOISE`, 0.1).
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_budget_fraction: float = 0.01
    noise_scaled_rate: bool = False
    fraction_noise: float = FRACTION_NOISE

    def __post_init__(self):
        for name, low, high in (
            ("target_quantile", 0.0, 1.0), ("count_budget_fraction", 0.0, 1.0), ("fraction_noise", 0.0, math.inf)
        ):
            value = getattr(self, name)
            if not _is_number(value) or not low < value < high:
                raise ValueError(
                    f"{name} must lie strictly between {low} and {high}, got {value!r}."
                )
        lr = self.learning_rate
        if not _is_number(lr) or not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"learning_rate must be a finite number > 0, got {lr!r}.")


class AdaptiveClipState(NamedTuple):
    """Pytree state of adaptive clipping (all float32 scalars, vmappable over clients).

    Attributes:
      clip: the current clip norm ``C_t``.
      target_quantile: ``gamma``, the quantile of per-example norms tracked.
      learning_rate: ``eta`` of the geometric update (already scaled when ``noise_scaled_rate``).
      count_noise_std: ``s_b``, the std of the noise added to the centred count.
      expected_batch_size: ``m``, the expected batch size the noisy count is divided by (public).
      below_sum: ``sum_t (b_t / m + 1/2)``, the noisy fractions of norms below the clip summed over the releases so
        far (post-processing of the released counts: public, as the clip they move is).
      releases: the number of releases so far.

    ``1 - (below_sum' - below_sum) / (releases' - releases)`` between two states is an unbiased estimate of the
    share of the batches' norms clipped in between (the count's noise has mean zero), with standard error
    ``count_noise_std / m / sqrt(releases' - releases)`` (:func:`clipped_share`).
    """

    clip: jax.Array
    target_quantile: jax.Array
    learning_rate: jax.Array
    count_noise_std: jax.Array
    expected_batch_size: jax.Array
    below_sum: jax.Array
    releases: jax.Array


def count_sensitivity(neighbouring: str) -> float:
    """Sensitivity of the centred count: 1/2 (add/remove) or 1 (substitute).

    Args:
      neighbouring: ``"add_remove"`` or ``"substitute"``.
    """
    return 0.5 if check_neighbouring(neighbouring) == "add_remove" else 1.0


def split_noise_multiplier(total: float, count_budget_fraction: float) -> tuple[float, float]:
    """``(z_g, z_b) = (z / sqrt(1 - f), z / sqrt(f))`` so that ``z_g^-2 + z_b^-2 = z^-2``.

    Args:
      total: ``z > 0``, the noise multiplier of the joint release, as calibrated for the plain run.
      count_budget_fraction: ``f`` in (0, 1), the share of ``z^-2`` spent on the count query.

    Returns:
      ``(z_g, z_b)``: the noise multipliers of the gradient sum and of the count.
    """
    if not total > 0:
        raise ValueError(f"total noise multiplier must be > 0, got {total}.")
    if not 0 < count_budget_fraction < 1:
        raise ValueError(f"count_budget_fraction must lie in (0, 1), got {count_budget_fraction}.")
    return total / math.sqrt(1 - count_budget_fraction), total / math.sqrt(count_budget_fraction)


def joint_noise_multiplier(gradient_noise_multiplier: float,
                           count_noise_multiplier: float) -> float:
    """Noise multiplier of the joint (gradient sum, count) release: ``(z_g^-2 + z_b^-2)^-1/2``.

    Args:
      gradient_noise_multiplier: ``z_g``, the gradient sum's noise std over its sensitivity.
      count_noise_multiplier: ``z_b``, the count's noise std over its sensitivity.
    """
    return (gradient_noise_multiplier**-2 + count_noise_multiplier**-2) ** -0.5


def adaptive_clip_events(
    gradient_noise_multiplier: float,
    count_noise_multiplier: float,
    sampling: str,
    rate: float,
    count: int = 1,
    overflow_probability: float = 0.0,
    dimension: int = 2,
) -> list[GaussianEvent]:
    """The events of ``count`` DP-SGD steps with adaptive clipping: one joint event of noise multiplier
    ``(z_g^-2 + z_b^-2)^-1/2`` (:func:`joint_noise_multiplier`).

    Args:
      gradient_noise_multiplier: ``z_g`` of the gradient sum.
      count_noise_multiplier: ``z_b`` of the centred count.
      sampling: the batches' sampling scheme, as :class:`~numpyro_dppvi.privacy.GaussianEvent`'s
        (``"poisson"``, ``"without_replacement"`` or ``"none"``).
      rate: the sampling rate in (0, 1].
      count: the number of steps. Default 1.
      overflow_probability: the per-step probability that a padded Poisson batch overflowed. Default 0.
      dimension: the noise coordinates of one step: the gradient's plus the count's one. Default 2.

    Returns:
      a list with the one :class:`~numpyro_dppvi.privacy.GaussianEvent`.
    """
    return [
        GaussianEvent(
            joint_noise_multiplier(gradient_noise_multiplier, count_noise_multiplier),
            sampling, rate, count, overflow_probability, dimension,
        )
    ]


def adaptive_clip_init(
    clip: float,
    expected_batch_size: float,
    count_noise_std: float,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    noise_scaled_rate: bool = False,
    fraction_noise: float = FRACTION_NOISE,
) -> AdaptiveClipState:
    """Initial state of adaptive clipping.

    Args:
      clip: the initial clip norm ``C_0 > 0``.
      expected_batch_size: ``m``: ``q n`` (Poisson) or the fixed batch size (without replacement).
      count_noise_std: ``s_b = z_b * count_sensitivity(relation)``, the std of the count's noise.
      target_quantile: ``gamma`` in (0, 1). Default 0.5.
      learning_rate: ``eta > 0`` of the geometric update. Default 0.2.
      noise_scaled_rate: scale the learning rate by ``min(1, fraction_noise / s_b)``,
        ``s_b = count_noise_std / expected_batch_size`` the std of the noisy fraction
        (:class:`~numpyro_dppvi.privacy.AdaptiveClip`). Default False.
      fraction_noise: the noisy fraction's std below which the scaled rate is the full one. Default
        :data:`FRACTION_NOISE`.
    """
    if noise_scaled_rate:
        learning_rate = learning_rate * min(1.0, fraction_noise * expected_batch_size / count_noise_std)
    for name, value in (("clip", clip), ("expected_batch_size", expected_batch_size),
                        ("count_noise_std", count_noise_std), ("learning_rate", learning_rate)):
        if isinstance(value, (int, float)) and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value}.")
    if isinstance(target_quantile, (int, float)) and not 0 < target_quantile < 1:
        raise ValueError(f"target_quantile must lie in (0, 1), got {target_quantile}.")
    # host values stay NumPy (no one-operation device programs at set-up); traced ones stay JAX
    f32 = lambda x: np.float32(x) if isinstance(x, (int, float)) else jnp.asarray(x, dtype=jnp.float32)  # noqa: E731
    zero = f32(0.0) if isinstance(clip, (int, float)) else jnp.zeros_like(f32(clip))
    return AdaptiveClipState(
        f32(clip), f32(target_quantile), f32(learning_rate), f32(count_noise_std),
        f32(expected_batch_size), zero, zero,
    )


def centred_count(norms, mask, clip) -> jax.Array:
    """``sum_{i: mask_i} (1[norms_i <= clip] - 1/2)``: the count query before noise; one record
    moves it by at most 1/2 (added/removed) or 1 (replaced).

    Args:
      norms: ``[B]`` per-example norms (unclipped).
      mask: ``[B]`` bool: the rows of the batch (padding excluded).
      clip: the current clip norm.
    """
    below = (norms <= clip).astype(jnp.float32) - 0.5
    return jnp.sum(jnp.where(mask, below, 0.0))


def adaptive_clip_update(state: AdaptiveClipState, norms, mask, key) -> AdaptiveClipState:
    """One private quantile step: noisy centred count of ``norms <= clip`` over the batch rows
    (``mask``), then the geometric update of the clip.

    Args:
      state: the :class:`AdaptiveClipState` before the step.
      norms: ``[B]``, the *unclipped* per-example norms of the step's batch (as returned by
        ``clip_per_example``).
      mask: ``[B]`` bool: the rows of the batch.
      key: the ``jax.random`` key of the count's noise.

    Returns:
      the :class:`AdaptiveClipState` with the updated clip.
    """
    count = centred_count(norms, mask, state.clip)
    return adaptive_clip_step(state, add_gaussian_noise(key, count, state.count_noise_std))


def adaptive_clip_step(state: AdaptiveClipState, noisy_count) -> AdaptiveClipState:
    """The geometric update of the clip from the released count ``count + N(0, count_noise_std^2)``
    (post-processing): ``C <- C exp(-eta (noisy / E|B| + 1/2 - gamma))``, and the running sum of the noisy
    fractions (:attr:`AdaptiveClipState.below_sum`)."""
    fraction_below = noisy_count / state.expected_batch_size + 0.5
    new_clip = state.clip * jnp.exp(-state.learning_rate * (fraction_below - state.target_quantile))
    return state._replace(clip=new_clip, below_sum=state.below_sum + fraction_below, releases=state.releases + 1.0)


def clipped_share(below_sum, releases, count_noise_std, expected_batch_size) -> tuple[np.ndarray, np.ndarray]:
    """The share of per-example norms above the clip over some releases, from the noisy counts alone:
    ``(1 - below_sum / releases, count_noise_std / m / sqrt(releases))``, the estimate (unbiased: the counts' noise
    has mean zero and each noisy fraction is unbiased for its batch's) and its standard error from the counts' noise
    (the batches' sampling adds ``p (1 - p) / m`` a release to the variance: small beside the noise's where the
    count is private enough to matter). Arrays broadcast
    (e.g. one entry per client); NaN where ``releases`` is 0. Post-processing of the releases: no privacy cost.

    Args:
      below_sum: the noisy fractions below the clip summed over the releases (differences of
        :attr:`AdaptiveClipState.below_sum`).
      releases: how many releases the sum holds.
      count_noise_std: ``s_b``, the count's noise std.
      expected_batch_size: ``m``, the expected batch size.
    """
    releases = np.asarray(releases, float)
    safe = np.where(releases > 0, releases, np.nan)
    share = 1.0 - np.asarray(below_sum, float) / safe
    return share, np.asarray(count_noise_std, float) / np.asarray(expected_batch_size, float) / np.sqrt(safe)
