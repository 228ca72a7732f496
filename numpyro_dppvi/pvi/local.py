"""Local update rules of PVI: what one client does with the global ``q`` and its cavity.

Every rule has one interface, pure and ``vmap``-able over clients:

    rule.init_client_state(arrays, mask, key) -> client_state      (pytree; ``()`` when stateless)
    rule.update(q, cavity, arrays, mask, n, key, client_state) -> (q_new, client_state, metrics)

``q_new`` is the client's new approximate posterior in natural parameters; the server turns it into
the damped factor change ``delta_m = rho (eta(q_new) - eta(q))`` (Heikkila et al. 2023, Algorithm 1).
The local loop is a ``lax.scan`` over ``local_steps`` optimiser steps on ``(mu, log s)``, started from
the current ``q`` with a fresh optax state (DESIGN §4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from .. import factors, objectives
from ..factors import Gaussian


def uniform_batch(key: jax.Array, mask: jax.Array, batch_size: int) -> tuple[jax.Array, jax.Array]:
    """``batch_size`` distinct valid rows chosen uniformly (top-k of uniform keys over valid rows).

    Returns ``(indices, batch_mask)``; when the client has fewer valid rows than ``batch_size`` the
    surplus slots point at padding and are masked out. Not a privacy sampler: private rules use
    ``privacy.sampling`` so that the sampler matches the accountant.
    """
    scores = jnp.where(mask, jax.random.uniform(key, mask.shape), -1.0)
    top, idx = jax.lax.top_k(scores, batch_size)
    return idx, top >= 0.0


def take_rows(arrays: tuple, idx: jax.Array) -> tuple:
    return tuple(jnp.take(a, idx, axis=0) for a in arrays)


@dataclass(frozen=True)
class NonPrivate:
    """Plain PVI local step: ``local_steps`` optimiser steps on ``-L_m(q) / n_m`` (objectives.local_elbo)."""

    log_lik_rows: Callable
    dim: int
    optimizer: optax.GradientTransformation
    local_steps: int
    batch_size: int | None
    num_samples: int

    def init_client_state(self, arrays, mask, key) -> Any:
        return ()

    def batch(self, key, arrays, mask):
        if self.batch_size is None:
            return arrays, mask
        idx, bmask = uniform_batch(key, mask, min(self.batch_size, mask.shape[0]))
        return take_rows(arrays, idx), bmask

    def gradient(self, params, key, arrays, mask, n, cavity):
        """Gradient of the loss ``-L_m / n_m`` on one batch, and the loss."""
        key_batch, key_eps = jax.random.split(key)
        batch, bmask = self.batch(key_batch, arrays, mask)
        eps = jax.random.normal(key_eps, (self.num_samples, self.dim))
        loss = lambda p: -objectives.local_elbo(self.log_lik_rows, p, eps, batch, bmask, n, cavity)
        value, grads = jax.value_and_grad(loss)(params)
        return grads, value

    def update(self, q, cavity, arrays, mask, n, key, client_state):
        params = factors.to_loc_log_scale(q)
        params, losses = optimise(self.optimizer, params, self.local_steps, key,
                                  lambda p, k: self.gradient(p, k, arrays, mask, n, cavity))
        return factors.from_loc_log_scale(params), client_state, {"loss": losses[-1]}


def optimise(optimizer, params, steps: int, key, gradient_fn):
    """``steps`` optimiser steps in a ``lax.scan``; ``gradient_fn(params, key) -> (grads, loss)``.

    The step keys are ``fold_in(key, step)``, so no key is used twice.
    """
    opt_state = optimizer.init(params)

    def step(carry, t):
        params, opt_state = carry
        grads, loss = gradient_fn(params, jax.random.fold_in(key, t))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    (params, _), losses = jax.lax.scan(step, (params, opt_state), jnp.arange(steps))
    return params, losses


@dataclass(frozen=True)
class ServerFactorStep:
    """Refines the server-held prior factor ``t_0`` (DESIGN §4): the local step with no data.

    Maximises ``E_q[log p(T(u)) + log|J(u)|] + E_q[log cavity_0] + H[q]`` over the coordinates of
    non-Gaussian prior sites only (``mask``); the other coordinates keep their values. No data is
    touched, so it costs no privacy and counts no communication.
    """

    log_density: Callable
    mask: jax.Array
    optimizer: optax.GradientTransformation
    steps: int
    num_samples: int

    def update(self, q: Gaussian, cavity: Gaussian, key) -> Gaussian:
        params0 = factors.to_loc_log_scale(q)
        dim = q.eta1.shape[-1]

        def gradient(params, k):
            eps = jax.random.normal(k, (self.num_samples, dim))
            loss = lambda p: -objectives.server_elbo(self.log_density, p, eps, cavity)
            value, grads = jax.value_and_grad(loss)(params)
            return jax.tree.map(lambda g: jnp.where(self.mask, g, 0.0), grads), value

        params, _ = optimise(self.optimizer, params0, self.steps, key, gradient)
        new = factors.from_loc_log_scale(params)
        return Gaussian(jnp.where(self.mask, new.eta1, q.eta1), jnp.where(self.mask, new.eta2, q.eta2))
