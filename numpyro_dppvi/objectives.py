"""Local objectives of PVI (Heikkila et al. 2023, eq. 2; Ashman et al. 2022, eq. 6).

The variational parameters are ``params = {"loc": mu, "log_scale": log s}`` of a mean-field
Gaussian ``q`` on the flat unconstrained vector. Client ``m`` maximises::

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


def standard_draws(key, num_samples: int, dim: int, antithetic: bool = True) -> jax.Array:
    """``[S, D]`` standard-normal draws ``eps`` for the reparameterised Monte Carlo estimates.

    ``antithetic``: ``S / 2`` draws and their negatives (``S`` odd: one more fresh draw). Both halves
    are exactly ``N(0, I)``, so every estimate stays unbiased, and the terms linear in ``eps`` cancel:
    the estimate of ``E_q[grad f] = grad f(mu) + O(s^2)`` loses the noise ``H s eps`` of the
    curvature (the whole of it for a quadratic ``f``), and the estimate of ``E_q[grad f * eps]``
    (the gradient for ``log s``, ``s^2 E_q[diag Hessian]`` by Stein's lemma) loses the noise
    ``grad f(mu) * eps``, which dominates where the likelihood is far from its maximum (on every
    client of PVI: its optimum balances the likelihood against the cavity).
    """
    if not antithetic or num_samples < 2:
        return jax.random.normal(key, (num_samples, dim))
    half = jax.random.normal(key, ((num_samples + 1) // 2, dim))
    return jnp.concatenate([half, -half[: num_samples // 2]], axis=0)


def draws(params: dict, eps: jax.Array) -> jax.Array:
    """Reparameterised draws ``u_s = mu + exp(log s) * eps_s``, ``[S, D]``; full-rank parameters
    (:func:`~numpyro_dppvi.factors.to_params`): ``u_s = mu + L eps_s``."""
    if "offdiag" in params:
        return params["loc"] + eps @ factors.scale_tril(params).T
    if "factor" in params:  # low-rank: eps is [S, D + r]
        return factors.low_rank_draw_map(params, eps)
    return params["loc"] + jnp.exp(params["log_scale"]) * eps


def cavity_term(params: dict, cavity: Gaussian) -> jax.Array:
    """``E_q[log cavity(u)] + H[q]`` (= ``-KL(q || cavity) + log Z_cavity``), analytic (full-rank ``q``:
    ``E_q[log cavity]`` with ``Sigma = L L^T`` and ``H[q] = D log(2 pi e) / 2 + sum_i log L_ii``)."""
    if "offdiag" in params:
        lower = factors.scale_tril(params)
        dim = lower.shape[-1]
        entropy = 0.5 * dim * jnp.log(2 * jnp.pi * jnp.e) + jnp.sum(params["log_diag"])
        return factors.expected_log_factor_full(params["loc"], lower @ lower.T, factors.to_full_rank(cavity)) + entropy
    if "factor" in params:
        return (factors.expected_log_factor_full(params["loc"], factors.low_rank_covariance(params),
                                                 factors.to_full_rank(cavity)) + factors.low_rank_entropy(params))
    scale = jnp.exp(params["log_scale"])
    return factors.expected_log_factor(params["loc"], scale, cavity) + factors.entropy(scale)


def finite_log_lik_draws(log_lik_rows, u: jax.Array, arrays: tuple) -> jax.Array:
    """``log p(x_i | T(u_s))`` for every draw ``s`` and row ``i``, ``[S, B]``, whose gradient is
    taken as zero where it is not finite although the draw's values are.

    The Monte Carlo draws of ``q`` reach regions the model never meant to visit, where a model can
    be finite but not differentiable in floating point. NumPyro's Hilbert-space GP is one: ``sqrt``
    of a spectral density that underflows to 0 at long length scales, a finite value with a NaN
    derivative (``inf * 0``) whose true value is about 0. Without this, one such draw in one step
    made the whole client's update NaN and the client was dropped from the round (issue 15: every
    client of an HSGP fit, for 6 to 20 rounds). Only the non-finite entries of the draw's gradient
    are zeroed (its other coordinates keep theirs); for differentiable models this is the identity.

    A draw whose *value* is not finite (``-inf``: an impossible observation; an overflowing rate)
    is left as it is: its NaN reaches the client's update, which the server drops (``failed`` in
    the history). Dropping such draws instead would remove the strongest penalty the likelihood
    has and let ``q`` drift into the region that produced them (measured on a Poisson GLMM: the
    fit moved away from NUTS round after round).
    """
    batch = lambda v: jax.vmap(log_lik_rows, in_axes=(0, None))(v, arrays)

    @jax.custom_vjp
    def terms(v):
        return batch(v)

    def forward(v):
        values, pullback = jax.vjp(batch, v)
        finite = jnp.all(jnp.isfinite(values), axis=tuple(range(1, values.ndim)))
        return values, (pullback, finite)

    def backward(residuals, cotangent):
        pullback, finite = residuals
        (du,) = pullback(cotangent)
        finite = jnp.reshape(finite, finite.shape + (1,) * (du.ndim - 1))
        return (jnp.where(finite & ~jnp.isfinite(du), 0.0, du),)

    terms.defvjp(forward, backward)
    return terms(u)


def expected_log_lik_rows(log_lik_rows, params: dict, eps: jax.Array, arrays: tuple) -> jax.Array:
    """Per-example ``E_q[log p(x_i | theta)]`` by Monte Carlo over shared draws, ``[B]`` (a non-finite
    gradient of a finite draw counts as zero: :func:`finite_log_lik_draws`)."""
    return jnp.mean(finite_log_lik_draws(log_lik_rows, draws(params, eps), arrays), axis=0)


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
    if "offdiag" in params:
        return _per_example_full_rank_grads(log_lik_row, params, eps, rows, blocks)
    if "factor" in params:
        return _per_example_low_rank_grads(log_lik_row, params, eps, rows, blocks)
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


def expected_grad_and_diag_hessian(log_density, loc, scale, eps, index) -> tuple[jax.Array, jax.Array]:
    """``E_q[d f / d u_k]`` and ``E_q[d^2 f / d u_k^2]`` for the coordinates ``k`` in ``index``.

    ``q = N(loc, scale^2)`` (diagonal), ``f = log_density``, expectations over the draws
    ``u_s = loc + scale * eps_s`` (``eps`` is ``[S, D]``); ``index`` is a static integer array of
    ``K`` coordinates. The diagonal of the Hessian is exact (one Hessian-vector product per
    coordinate and draw, forward over reverse), not a stochastic estimate: these are the statistics
    of the natural-gradient (Bonnet / Price) form of Gaussian VI, by which the server refines the
    prior factor (:class:`~numpyro_dppvi.pvi.local.ServerFactorStep`). Draws whose statistics are
    not finite are left out of the averages (non-finite results when every draw is). Returns two
    ``[K]`` arrays.
    """
    index = jnp.asarray(index, jnp.int32)
    k = index.shape[0]
    basis = jnp.zeros((k, loc.shape[-1]), loc.dtype).at[jnp.arange(k), index].set(1.0)
    grad_fn = jax.grad(log_density)

    def per_draw(u):
        hvp = lambda v: jax.jvp(grad_fn, (u,), (v,))[1]
        diag = jnp.take_along_axis(jax.vmap(hvp)(basis), index[:, None], axis=1)[:, 0]
        return grad_fn(u)[index], diag

    grads, diags = jax.vmap(per_draw)(loc + scale * eps)
    finite = jnp.all(jnp.isfinite(grads), axis=1) & jnp.all(jnp.isfinite(diags), axis=1)
    weight = finite / jnp.sum(finite)  # draws with a non-finite statistic are left out (all of them: NaN)
    mean = lambda a: jnp.sum(jnp.where(finite[:, None], a, 0.0) * weight[:, None], axis=0)
    return mean(grads), mean(diags)


def _per_example_full_rank_grads(log_lik_row, params: dict, eps: jax.Array, rows: tuple, blocks) -> dict:
    """Per-example gradients w.r.t. the full-rank parameters ``{"loc", "log_diag", "offdiag"}`` of
    ``u_s = mu + L eps_s`` (:func:`~numpyro_dppvi.factors.scale_tril`): with ``G_is = grad_u log p(x_i | u_s)``
    and ``M_i = (1/S) sum_s G_is eps_s^T`` (``d/dL``),

        g_i^mu = (1/S) sum_s G_is,    g_i^{log_diag} = diag(M_i) * diag(L),    g_i^{offdiag} = M_i below the diagonal,

    leaves ``[B, D]``, ``[B, D]``, ``[B, D (D - 1) / 2]``: the ``D (D + 3) / 2`` coordinates DP-SGD clips
    jointly. ``blocks``: as :func:`per_example_log_lik_grads`."""
    dim = eps.shape[-1]
    if blocks is None:
        row_fn = log_lik_row
    else:
        offsets = [sum(blocks[:k]) for k in range(len(blocks))]
        row_fn = lambda v, row: log_lik_row([v[..., o:o + b] for o, b in zip(offsets, blocks)], row)
    lower = factors.scale_tril(params)
    u = params["loc"] + eps @ lower.T
    per_row = lambda row: jax.vmap(jax.grad(row_fn), in_axes=(0, None))(u, row)
    grads = jax.vmap(per_row)(rows)  # [B, S, D]
    num_samples = eps.shape[0]
    outer = jnp.einsum("bsd,se->bde", grads, eps) / num_samples  # d/dL, [B, D, D]
    r, c = jnp.tril_indices(dim, -1)
    return {"loc": jnp.mean(grads, axis=1),
            "log_diag": jnp.diagonal(outer, axis1=-2, axis2=-1) * jnp.diagonal(lower),
            "offdiag": outer[:, r, c]}


def _row_function(log_lik_row, blocks):
    """``log_lik_row`` as a function of the flat ``u`` (``blocks``: as :func:`per_example_log_lik_grads`)."""
    if blocks is None:
        return log_lik_row
    offsets = [sum(blocks[:k]) for k in range(len(blocks))]
    return lambda v, row: log_lik_row([v[..., o:o + b] for o, b in zip(offsets, blocks)], row)


def _per_example_low_rank_grads(log_lik_row, params: dict, eps: jax.Array, rows: tuple, blocks) -> dict:
    """Per-example gradients w.r.t. the low-rank parameters ``{"loc", "log_scale", "factor"}`` of the draws
    ``u_s = mu + s z_s`` (:func:`~numpyro_dppvi.factors.low_rank_draw_map`): ``g_i = J^T G_i / S`` with ``G_is =
    grad_u log p(x_i | u_s)`` and ``J`` the Jacobian of the draw map (one vector-Jacobian product per example,
    ``O(S D r)``), leaves ``[B, D]``, ``[B, D]``, ``[B, D, r]``: the ``2 D + D r`` coordinates DP-SGD clips
    jointly."""
    row_fn = _row_function(log_lik_row, blocks)
    u, pullback = jax.vjp(lambda p: factors.low_rank_draw_map(p, eps), params)
    grads = jax.vmap(lambda row: jax.vmap(jax.grad(row_fn), in_axes=(0, None))(u, row))(rows)  # [B, S, D]
    return jax.vmap(lambda g: pullback(g / eps.shape[0])[0])(grads)



def antithetic_pairs(key, pairs: int, dim: int) -> jax.Array:
    """``[2 P, D]`` draws ``[eps_1, ..., eps_P, -eps_1, ..., -eps_P]`` (the layout of :func:`standard_draws`)."""
    half = jax.random.normal(key, (pairs, dim))
    return jnp.concatenate([half, -half], axis=0)


def probe_scale(params: dict) -> jax.Array:
    """The root mean square of the marginal sds of ``q`` (mean-field ``s``; full-rank ``sqrt(diag L L^T)``;
    low-rank from its draw map), a scalar: the public scale of the curvature block of a pair release."""
    if "offdiag" in params:
        variances = jnp.sum(jnp.square(factors.scale_tril(params)), axis=-1)
    elif "factor" in params:
        variances = jnp.diagonal(factors.low_rank_covariance(params))
    else:
        variances = jnp.exp(2.0 * params["log_scale"])
    return jnp.sqrt(jnp.mean(variances))


def pair_release_dimension(dim: int, num_samples: int) -> int:
    """Noise coordinates of one DP optimisation release of the pair gradients (:func:`per_example_pair_grads`,
    the release of :class:`~numpyro_dppvi.optim.PrivateNewton` steps and of every step of a full-rank or low-rank
    ``q``): the pair means and half-differences of
    ``max(num_samples // 2, 1)`` antithetic pairs, ``2 P D``."""
    return 2 * max(int(num_samples) // 2, 1) * int(dim)


def per_example_scaled_grads(log_lik_row, params: dict, eps: jax.Array, rows: tuple, curvature_weight,
                             blocks: tuple[int, ...] | None = None) -> dict:
    """The per-example vector DP optimisation with an optax step clips and noises (mean-field ``q``): the
    variational gradient of :func:`per_example_log_lik_grads` with its log-scale block put on the scale of the
    pair release's curvature block (:func:`per_example_pair_grads`),

        a_i = g_i^mu = (1/S) sum_s G_is,        b_i = kappa (1/S) sum_s G_is * eps_s / sigma = kappa g_i^{log s} / (s sigma),

    ``sigma`` the root mean square of ``q``'s sds (:func:`probe_scale`), ``kappa`` = ``curvature_weight``. With
    antithetic draws (``sum_s eps_s = 0``) ``b_i`` is about ``kappa diag(H_i) s / sigma``: the curvature in units of
    ``q``'s sds, where ``g_i^{log s}`` is ``O(s^2)`` and the noise of a joint clip sized by ``g_i^mu`` would swamp it
    by ``1 / s^2`` (measured: ``q``'s sds 2-5 times too wide, benchmarks/results/coverage.json). ``s`` and ``sigma``
    are public (``q``), so the gradient is post-processing of the release (:func:`gradients_from_scaled`). Leaves
    ``[B, D]``. Dividing by the coordinate's own ``s`` is bounded here: ``b_i`` is ``E_q[G e]``, one coordinate's
    own curvature, not the curvature of other coordinates through it."""
    grads = per_example_log_lik_grads(log_lik_row, params, eps, rows, blocks)
    scale = curvature_weight / (jnp.exp(params["log_scale"]) * probe_scale(params))
    return {"loc": grads["loc"], "log_scale": grads["log_scale"] * scale}


def gradients_from_scaled(params: dict, scaled: dict, curvature_weight) -> dict:
    """Inverse of :func:`per_example_scaled_grads` applied to a sum over rows: the gradient in ``(mu, log s)``."""
    scale = jnp.exp(params["log_scale"]) * probe_scale(params) / curvature_weight
    return {"loc": scaled["loc"], "log_scale": scaled["log_scale"] * scale}


def release_dimension(dim: int, num_samples: int, pair_release: bool) -> int:
    """Noise coordinates of one DP optimisation release (the ``dimension`` of its ledger event): the pair release's
    (:func:`pair_release_dimension`), or ``2 D`` for the scaled variational gradient of a mean-field ``q``
    (:func:`per_example_scaled_grads`)."""
    return pair_release_dimension(dim, num_samples) if pair_release else 2 * int(dim)


def per_example_pair_grads(log_lik_row, params: dict, eps: jax.Array, rows: tuple, curvature_weight,
                           blocks: tuple[int, ...] | None = None) -> jax.Array:
    """The per-example vector DP optimisation clips and noises: for each antithetic pair ``p`` of draws
    ``u_p^+-`` of ``q`` (``eps = [e, -e]``, :func:`antithetic_pairs`), with ``G^+-_ip = grad_u log p(x_i |
    u_p^+-)``, the pair's mean and its scaled half-difference,

        m_ip = (G^+_ip + G^-_ip) / 2,       h_ip = kappa (G^+_ip - G^-_ip) / (2 sigma),

    ``sigma`` the root mean square of ``q``'s marginal sds (:func:`probe_scale`) and ``kappa`` = ``curvature_weight``, stacked as
    ``[B, 2, P, D] / sqrt(P)``. ``h_ip`` is about ``kappa H_i (L e_p) / sigma``, a Hessian-vector product of
    the row's log-likelihood in units of ``q``'s sds (one scalar ``sigma`` for all coordinates: a coordinate's own
    sd would divide the other coordinates' curvature through it by it, unbounded where ``q``'s sds differ): scaling this block by the public ``kappa / sigma``
    before the joint clip (per-block scaling) gives the curvature a share of the clip norm on the scale of
    the gradient's, where the plain per-draw gradients carry it as a difference ``O(sigma)`` of terms ``O(1)``
    and their noise would swamp it by ``1 / sigma``. Every ``G^+-`` is a linear function of ``(m, h)``
    (:func:`draw_sums_from_pair_sums`), so all gradients and estimates are post-processing of the release.
    ``blocks``: as :func:`per_example_log_lik_grads`."""
    row_fn = _row_function(log_lik_row, blocks)
    u = draws(params, eps)
    grads = jax.vmap(lambda row: jax.vmap(jax.grad(row_fn), in_axes=(0, None))(u, row))(rows)  # [B, 2P, D]
    pairs = eps.shape[0] // 2
    plus, minus = grads[:, :pairs], grads[:, pairs:]
    scale = curvature_weight / (2.0 * probe_scale(params))
    stacked = jnp.stack([0.5 * (plus + minus), (plus - minus) * scale], axis=1)  # [B, 2, P, D]
    return stacked / jnp.sqrt(jnp.asarray(pairs, grads.dtype))


def draw_sums_from_pair_sums(params: dict, pair_sums: jax.Array, curvature_weight) -> jax.Array:
    """Inverse of the stacking of :func:`per_example_pair_grads` applied to a sum over rows: from ``[2, P, D]``
    (scaled by ``sqrt(P)``) back to the per-draw sums ``[2 P, D]`` in the layout of the draws
    (``G^+- = m +- sigma h / kappa``)."""
    pairs = pair_sums.shape[1]
    mean, diff = pair_sums[0] * jnp.sqrt(jnp.asarray(pairs, pair_sums.dtype)), pair_sums[1] * jnp.sqrt(
        jnp.asarray(pairs, pair_sums.dtype))
    half = diff * probe_scale(params) / curvature_weight
    return jnp.concatenate([mean + half, mean - half], axis=0)


def data_gradients_from_draw_sums(params: dict, eps: jax.Array, draw_sums: jax.Array) -> dict:
    """The gradient in the variational parameters of ``sum_i E_q[log p(x_i | theta)]`` from estimated per-draw
    sums ``draw_sums[s] = sum_i G_is`` (``[S, D]``): the vector-Jacobian product of the draw map with
    ``draw_sums / S`` (mean-field: ``d/dmu = mean_s G_s``, ``d/dlog s = s mean_s G_s eps_s``; full-rank and
    low-rank the same chain rule, as in :func:`per_example_log_lik_grads`). Post-processing only."""
    _, pullback = jax.vjp(lambda p: draws(p, eps), params)
    return pullback(draw_sums / eps.shape[0])[0]
