"""Optimisers for the local steps: optax ``GradientTransformation`` objects.

``natural_gradient`` preconditions the gradient of a mean-field Gaussian's parameters
``{"loc": mu, "log_scale": log s}`` by the inverse Fisher information ``diag(s^2, 1/2)``:

    mu <- mu - lr * s^2 * dL/dmu,        log s <- log s - lr * (dL/dlog s) / 2.

For the PVI local objective this is a Newton-like step whose size follows each coordinate's
curvature. It matters for many small virtual clients (one row each): Adam normalises every
coordinate's step to about its learning rate, so a sum of thousands of tiny updates turns into a sum
of signs, while the natural gradient moves each virtual client by what its likelihood asks for.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax


def natural_gradient(learning_rate: float) -> optax.GradientTransformation:
    """Natural-gradient descent on ``{"loc", "log_scale"}`` of a mean-field Gaussian (stateless)."""
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")

    def init(params):
        return optax.EmptyState()

    def update(grads, state, params):
        if params is None:
            raise ValueError("natural_gradient needs the current params: optimizer.update(grads, state, params)")
        variance = jnp.exp(2.0 * params["log_scale"])
        return {"loc": -learning_rate * variance * grads["loc"],
                "log_scale": -0.5 * learning_rate * grads["log_scale"]}, state

    return optax.GradientTransformation(init, update)
