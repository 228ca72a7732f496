"""Local objectives of PVI (Heikkila et al. 2023, eq. 2; Ashman et al. 2022, eq. 6).

The variational parameters are ``params = {"loc": mu, "log_scale": log s}`` of a mean-field
Gaussian ``q`` on the flat unconstrained vector. Client ``m`` maximises

    L_m(q) = (n_m / |B|) sum_{i in B} E_q[log p(x_i | theta)] - KL(q || cavity_m),

with ``theta = T(u)``, the expectation by ``num_samples`` reparameterised draws ``u = mu + s * eps``
shared across the batch, and the KL analytic. We write the KL term as
``E_q[log cavity(u)] + H[q]``, which equals ``-KL(q || cavity)`` up to the cavity's log normaliser,
so the same formula serves the server factor ``t_0`` whose cavity may be flat. Objectives are
divided by ``n_m`` so learning rates do not depend on the client size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import factors
from .factors import Gaussian


def draws(params: dict, eps: jax.Array) -> jax.Array:
    """Reparameterised draws ``u_s = mu + exp(log s) * eps_s``, ``[S, D]``."""
    return params["loc"] + jnp.exp(params["log_scale"]) * eps


def cavity_term(params: dict, cavity: Gaussian) -> jax.Array:
    """``E_q[log cavity(u)] + H[q]`` (= ``-KL(q || cavity) + log Z_cavity``), analytic."""
    scale = jnp.exp(params["log_scale"])
    return factors.expected_log_factor(params["loc"], scale, cavity) + factors.entropy(scale)


def expected_log_lik_rows(log_lik_rows, params: dict, eps: jax.Array, arrays: tuple) -> jax.Array:
    """Per-example ``E_q[log p(x_i | theta)]`` by Monte Carlo over shared draws, ``[B]``."""
    u = draws(params, eps)
    return jnp.mean(jax.vmap(log_lik_rows, in_axes=(0, None))(u, arrays), axis=0)


def expected_log_lik_row(log_lik_row, params: dict, eps: jax.Array, row: tuple) -> jax.Array:
    """``E_q[log p(x_i | theta)]`` of one row (the unit whose gradient DP-SGD clips)."""
    u = draws(params, eps)
    return jnp.mean(jax.vmap(log_lik_row, in_axes=(0, None))(u, row))


def local_elbo(log_lik_rows, params, eps, arrays, mask, n, cavity) -> jax.Array:
    """``L_m(q) / n_m`` with the batch sum rescaled by ``n_m / |B|`` (``|B|`` = valid rows in the batch)."""
    ell = expected_log_lik_rows(log_lik_rows, params, eps, arrays)
    batch = jnp.maximum(jnp.sum(mask), 1.0)
    return jnp.sum(jnp.where(mask, ell, 0.0)) / batch + cavity_term(params, cavity) / n


def server_elbo(log_density, params, eps, cavity) -> jax.Array:
    """Objective of the server factor ``t_0``: ``E_q[log p(T(u)) + log|J(u)|] + E_q[log cavity] + H[q]``."""
    u = draws(params, eps)
    return jnp.mean(jax.vmap(log_density)(u)) + cavity_term(params, cavity)
