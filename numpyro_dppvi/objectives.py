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


def per_example_log_lik_grads(log_lik_row, params: dict, eps: jax.Array, rows: tuple,
                              blocks: tuple[int, ...] | None = None) -> dict:
    """Per-example gradients ``g_i = d/d(mu, log s) E_q[log p(x_i | theta)]``, leaves ``[B, D]``.

    By the chain rule through ``u_s = mu + s * eps_s`` (Heikkila et al. 2023, §4.1 clips exactly
    these ``g_i``), with ``G_is = grad_u log p(x_i | u_s)``:

        g_i^mu = (1/S) sum_s G_is,      g_i^{log s} = s * (1/S) sum_s G_is * eps_s.

    Equal to ``vmap(grad(expected_log_lik_row))`` up to float rounding, but written so that XLA
    fuses the per-draw gradients into the sums over draws instead of materialising the
    ``[B, S, D]`` array ``G`` (benchmarks/dp_step.py): each block of ``u`` has a single consumer,
    ``sum_s G_is[..., None] * [1, eps_s] / S``. With ``blocks=None``, ``log_lik_row(u, row)``
    takes the flat ``u``; with ``blocks`` (the sizes of the model's sites, summing to ``D``) it
    takes the list of blocks of ``u`` (``ModelAdapter.log_lik_row_blocks``), so that no
    gradient is padded back to ``D`` columns inside the model.
    """
    dim = eps.shape[-1]
    if blocks is None:
        blocks, flat = (dim,), log_lik_row
        log_lik_row = lambda parts, row: flat(parts[0], row)
    blocks = tuple(int(b) for b in blocks)
    if sum(blocks) != dim:
        raise ValueError(f"blocks {blocks} must sum to the dimension {dim} of u.")
    offsets = [sum(blocks[:k]) for k in range(len(blocks))]
    split = lambda v: [v[..., o:o + b] for o, b in zip(offsets, blocks)]
    scale = jnp.exp(params["log_scale"])
    parts = split(params["loc"] + scale * eps)
    per_row = lambda row: jax.vmap(jax.grad(log_lik_row), in_axes=(0, None))(parts, row)
    grads = jax.vmap(per_row)(rows)  # one [B, S, b] array per block
    num_samples = eps.shape[0]
    sums = []
    for g, e in zip(grads, split(eps)):
        weights = jnp.stack([jnp.ones_like(e), e], axis=-1) / num_samples  # [S, b, 2]
        sums.append(sum(g[:, s, :, None] * weights[s] for s in range(num_samples)))
    both = jnp.concatenate(sums, axis=1)
    return {"loc": both[..., 0], "log_scale": scale * both[..., 1]}


def local_elbo(log_lik_rows, params, eps, arrays, mask, n, cavity) -> jax.Array:
    """``L_m(q) / n_m`` with the batch sum rescaled by ``n_m / |B|`` (``|B|`` = valid rows in the batch)."""
    ell = expected_log_lik_rows(log_lik_rows, params, eps, arrays)
    batch = jnp.maximum(jnp.sum(mask), 1.0)
    return jnp.sum(jnp.where(mask, ell, 0.0)) / batch + cavity_term(params, cavity) / n


def server_elbo(log_density, params, eps, cavity) -> jax.Array:
    """Objective of the server factor ``t_0``: ``E_q[log p(T(u)) + log|J(u)|] + E_q[log cavity] + H[q]``."""
    u = draws(params, eps)
    return jnp.mean(jax.vmap(log_density)(u)) + cavity_term(params, cavity)
