"""Split neural networks as VFL client sub-models (Hassan et al., §5.3).

A client network ``h_j = f_{phi_j}(x_j)`` (layers of ``numpyro.param`` weights, point estimates)
ends in a last layer ``w_j``:

* split NN: ``w_j`` is a point parameter and the client's contribution is
  ``z_ij = h_ij^T w_j`` (deterministic; fit with ``fit_vfl(..., formulation="split")``: the client
  sends ``z_j``, the server returns ``dlog p(y | sum_j z_j)/dz_j``);
* hierarchical Bayes split NN: ``w_j ~ N(0, prior_scale^2)`` and ``g_ij = h_ij^T w_j`` is the mean
  of ``z_ij ~ N(g_ij, rho)`` in the augmented-variable model (fit with
  ``fit_vfl(..., formulation="augmented", guide="amortised")``).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist


def _glorot(shape):
    def init(key):
        fan_in, fan_out = shape
        return jax.random.normal(key, shape) * jnp.sqrt(2.0 / (fan_in + fan_out))

    return init


def mlp_submodel(hidden: Sequence[int] = (8, 2), *, bayesian_last_layer: bool = True,
                 prior_scale: float = 1.0, activation=jnp.tanh):
    """A client sub-model ``x_j [n, p_j] -> g_j [n]``: an MLP with widths ``hidden``.

    ``h = act(... act(x W_1 + b_1) ...)`` has ``hidden[-1]`` features; ``g = h w``. The hidden layers'
    weights and biases are point parameters (``numpyro.param`` sites ``"W0"``, ``"b0"``, ...).

    Args:
      hidden: the widths of the hidden layers, a non-empty sequence of positive ints.
      bayesian_last_layer: make the last layer ``w`` a latent site ``"w"`` with a ``N(0, prior_scale^2)``
        prior (default); False: a point parameter (the plain split NN).
      prior_scale: the prior standard deviation of ``w`` when it is latent.
      activation: the activation function of the hidden layers (default ``jnp.tanh``).

    Returns:
      the sub-model ``submodel(x)``, for :class:`~numpyro_dppvi.VFLClient`.
    """
    hidden = tuple(int(h) for h in hidden)
    if not hidden or min(hidden) < 1:
        raise ValueError(f"hidden must be a non-empty sequence of positive widths, got {hidden}")

    def submodel(x):
        x = jnp.asarray(x, jnp.float32)
        if x.ndim != 2:
            raise ValueError(f"mlp_submodel expects x_j of shape [n, p_j], got {x.shape}")
        h = x
        widths = (x.shape[1],) + hidden
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            W = numpyro.param(f"W{i}", _glorot((a, b)))
            c = numpyro.param(f"b{i}", jnp.zeros((b,)))
            h = activation(h @ W + c)
        if bayesian_last_layer:
            w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([hidden[-1]]).to_event(1))
        else:
            w = numpyro.param("w", _glorot((hidden[-1], 1)))[:, 0]
        return h @ w

    return submodel
