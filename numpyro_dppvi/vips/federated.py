"""Federated VIPS building blocks: a conjugate client's local step and the server's M-step.

In PVI with a conjugate-exponential model the optimal factor of client ``m`` given the
current ``q`` is exact: ``t_m`` has natural parameters equal to the client's summed ESS under
the current expected natural parameters ``n̄`` (for models without local latents, e.g.
linear regression, this does not depend on ``n̄`` at all). The global posterior is

    ν̃ = ν + sum_m t_m         (the M-step of Eq. 19 applied to the sum of client ESS).

Privately, the client releases its clipped, noised ESS sum (the same joint Gaussian release
as :func:`numpyro_dppvi.fit_vips`, over all its rows, no subsampling) and its delta is the
change of that released factor. The release's sensitivity is the joint clip norm
``sqrt(B)`` (add/remove) or ``2 sqrt(B)`` (substitute) in bound-rescaled units, so each call is
one event ``Privacy.step_event(noise_multiplier, rate=1.0, count=1)`` for that client. With a
trusted aggregator each of ``M`` clients passes ``noise_multiplier / sqrt(M)`` and the
aggregated release is accounted with the full ``noise_multiplier``.

The model's clean-up of a noisy sum (PSD projection, clamping counts at zero) is not applied by
the client: :func:`conjugate_server_update` applies it to the **sum** of the factors, i.e. to a
complete release (with a trusted aggregator a single share carries only part of the noise, and a
nonlinear map of it would not be post-processing of the noisy sum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from numpyro_dppvi.vips.engine import blend, joint_sensitivity, scale_bounds
from numpyro_dppvi.vips.release import release_ess


def conjugate_client_delta(model, data, expected_natural_params, previous_factor=None, *, noise_key=None,
                           clip: float | None = 1.0, noise_multiplier: float = 0.0, mask=None):
    """One client's exact conjugate local step, released with clipping and Gaussian noise.

    Args:
        model: a :class:`~numpyro_dppvi.vips.engine.ConjugateModel`.
        data: the client's arrays (leading axis = record), in the model's layout.
        expected_natural_params: ``n̄`` of the current global ``q`` (from the server).
        previous_factor: the client's previous released factor (ESS dict), ``None`` = zero.
        noise_key: ``jax.random`` key for the privacy noise (never reuse one).
        clip: multiplier of the model's block bounds (``Privacy.clip``); ``None`` = no clipping
            (non-private only).
        noise_multiplier: ``sigma``, noise std / joint clip norm ``sqrt(B)``; 0 for no noise.
        mask: optional ``[n]`` bool marking real rows of a padded client.

    Returns:
        ``(delta, info)``: ``delta`` = new factor - previous factor (ESS dict; the new factor is
        ``previous_factor + delta``); ``info`` has ``factor`` (the new released factor),
        ``joint_clip`` (``sqrt(B)``), ``noise_std`` (std in rescaled units), ``noise_multiplier``,
        ``num_clipped``.
    """
    data = tuple(jnp.asarray(a) for a in data)
    n = data[0].shape[0]
    mask = jnp.ones(n, dtype=bool) if mask is None else jnp.asarray(mask, dtype=bool)
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
    if noise_multiplier > 0 and (clip is None or noise_key is None):
        raise ValueError("a private client step needs clip (bound multiplier) and a fresh noise_key.")
    bounds = None if clip is None else scale_bounds(model.block_bounds, clip)
    factor, num_clipped = model.clipped_ess_sum(expected_natural_params, data, mask, bounds)
    noise_std = 0.0
    if noise_multiplier > 0:
        noise_std = float(noise_multiplier) * joint_sensitivity(bounds)
        factor = release_ess(factor, bounds, noise_std, noise_key, tuple(model.symmetric_blocks))
    if previous_factor is None:
        previous_factor = jax.tree_util.tree_map(jnp.zeros_like, factor)
    delta = jax.tree_util.tree_map(lambda new, old: new - old, factor, previous_factor)
    info = {"factor": factor, "joint_clip": None if bounds is None else joint_sensitivity(bounds),
            "noise_std": noise_std, "noise_multiplier": float(noise_multiplier), "num_clipped": num_clipped}
    return delta, info


def conjugate_server_update(model, params, factor_sum, rho: float = 1.0, noisy: bool = False):
    """Server M-step from the sum of the clients' factors: ``ν̃ <- (1-rho) ν̃ + rho (ν + sum_m t_m)``
    followed by the model's hyperparameter refresh.

    Args:
      model: the :class:`~numpyro_dppvi.vips.ConjugateModel`.
      params: the current global parameters ``ν̃``.
      factor_sum: ``sum_m t_m``, the sum of the clients' factors (ESS trees).
      rho: the step towards the M-step's target, in ``(0, 1]``. Default 1.
      noisy: the sum holds released noise: the model's clean-up of a noisy ESS sum (``postprocess_noisy_ess``)
        is applied to ``factor_sum`` first (post-processing of the complete release). Default False.

    Returns:
      the new global parameters.
    """
    if noisy:
        factor_sum = model.postprocess_noisy_ess(factor_sum)
    target = model.m_step(params, factor_sum)
    return model.refresh(blend(params, target, rho))
