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

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from .. import factors, objectives
from ..factors import Gaussian
from ..optim import PrivateNewton
from ..privacy.adaptive_clip import adaptive_clip_step, centred_count
from ..privacy.mechanisms import add_gaussian_noise, clipped_sum
from ..privacy import noise
from . import noise_aware
from ..privacy.sampling import poisson_fold, row_fold, without_replacement_batch


def shuffled_order(key: jax.Array, mask: jax.Array) -> jax.Array:
    """A uniformly random order of the client's valid rows (the first ``sum(mask)`` of its array),
    padding rows after them: the rows sorted by 64 random bits each (one O(n log n) sort per local
    update, not per step). Two rows tie only with probability ``n^2 2^-65``. Row ``i``'s bits come
    from ``fold_in(key, i)``, so the order of the valid rows does not depend on the padding (a client
    padded beside larger ones, or alone on a Flower node, draws the same batches)."""
    rows = jnp.arange(mask.shape[0], dtype=jnp.int32)
    bits = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), (2,), dtype=jnp.uint32))(rows)
    invalid = jnp.where(mask, 0, 1).astype(jnp.uint32)
    *_, order = jax.lax.sort((invalid, bits[:, 0], bits[:, 1], rows), num_keys=3)
    return order


def window_batch(order: jax.Array, mask: jax.Array, step, batch_size: int) -> tuple[jax.Array, jax.Array]:
    """Minibatch ``step`` of a local update: rows ``step * b, ..., step * b + b - 1`` (cyclically,
    modulo the client's ``n`` valid rows) of the update's random ``order``. Returns
    ``(indices [b], batch_mask [b])``.

    **Without replacement**, O(batch) per step: each batch is a contiguous window of a uniformly
    random cyclic order, hence a uniformly random subset of ``min(b, n)`` distinct rows, so every row
    is in a batch with probability ``b / n`` and ``(n / b) sum_{i in B} g_i`` is unbiased for
    ``sum_i g_i``. Successive windows continue where the last one ended, so any ``k`` consecutive steps
    use every row ``k b / n`` times, up to one: the rows weigh alike in the iterates the update
    averages (windows restarting at row 0 of each sweep gave the first ``b - n mod b`` rows of the order
    twice the weight of the others: 0.1-0.3 posterior sd of bias in a tail average at ``n = 225, b = 50``).
    When ``b >= n`` the slots past ``n`` are masked and every batch is exactly the client's whole data.
    Not a privacy sampler: private rules use ``privacy.sampling`` so that the sampler matches the
    accountant.
    """
    n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.int32)
    with noise._x64():  # step * b overflows int32 for large clients
        start = jnp.mod(jnp.asarray(step, jnp.int64) * batch_size, n.astype(jnp.int64)).astype(jnp.int32)
    slots = jnp.arange(batch_size, dtype=jnp.int32)
    return order[jnp.mod(start + slots, n)], slots < n


def take_rows(arrays: tuple, idx: jax.Array) -> tuple:
    """The rows ``idx`` of each of a client's arrays (``jnp.take`` along axis 0): a batch, as a tuple."""
    return tuple(jnp.take(a, idx, axis=0) for a in arrays)


@dataclass(frozen=True)
class NonPrivate:
    """Plain PVI local step: ``local_steps`` optimiser steps on ``-L_m(q) / n_m`` (objectives.local_elbo)
    over minibatches without replacement (:func:`window_batch`; the whole client when
    ``batch_size`` is None or at least its size), ``num_samples`` Monte Carlo draws per step
    (``antithetic`` pairs by default: :func:`~numpyro_dppvi.objectives.standard_draws`). The client's
    answer is the mean of the last ``average`` fraction of the iterates (:func:`optimise`)."""

    log_lik_rows: Callable
    dim: int
    optimizer: optax.GradientTransformation
    local_steps: int
    batch_size: int | None
    num_samples: int
    average: float = 0.0
    antithetic: bool = True

    def init_client_state(self, arrays, mask, key) -> Any:
        return ()

    def full_batch(self, mask) -> bool:
        return self.batch_size is None or self.batch_size >= mask.shape[0]

    def gradient(self, params, key, step, order, arrays, mask, n, cavity):
        """Gradient of the loss ``-L_m / n_m`` on batch ``step`` of ``order``, and the loss."""
        if self.full_batch(mask):
            batch, bmask = arrays, mask
        else:
            idx, bmask = window_batch(order, mask, step, self.batch_size)
            batch = take_rows(arrays, idx)
        eps = objectives.standard_draws(key, self.num_samples, self.dim, self.antithetic)
        loss = lambda p: -objectives.local_elbo(self.log_lik_rows, p, eps, batch, bmask, n, cavity)
        value, grads = jax.value_and_grad(loss)(params)
        return grads, value

    def update(self, q, cavity, arrays, mask, n, key, client_state):
        k_order, k_steps = jax.random.split(key)
        order = None if self.full_batch(mask) else shuffled_order(k_order, mask)
        params, losses, _ = optimise(
            self.optimizer, factors.to_loc_log_scale(q), self.local_steps, k_steps,
            lambda p, k, t: self.gradient(p, k, t, order, arrays, mask, n, cavity), average=self.average,
            objective_scale=n)
        return factors.from_loc_log_scale(params), client_state, {"loss": losses[-1]}


def tail_length(steps: int, average: float) -> int:
    """Number of final iterates averaged: ``ceil(average * steps)``, at least 1 (the last iterate)."""
    if not 0.0 <= average < 1.0:
        raise ValueError(f"average must lie in [0, 1), got {average}")
    return max(int(math.ceil(average * steps)), 1)


def optimise(optimizer, params, steps: int, key, gradient_fn, opt_state=None, average: float = 0.0, aux=None,
             objective_scale=1.0):
    """``steps`` optimiser steps in a ``lax.scan``; ``gradient_fn(params, key, step) -> (grads, loss)``, or
    with ``aux`` (a pytree carried from step to step, e.g. a private rule's client state)
    ``gradient_fn(params, key, step, aux) -> (grads, loss, aux)``.

    Starts from ``opt_state`` (a fresh ``optimizer.init`` when None) and returns
    ``(params, losses, opt_state)`` (and the final ``aux`` when given). The step keys are
    ``fold_in(key, step)``, so no key is used twice.

    ``average``: the returned ``params`` are the mean of the last ``ceil(average * steps)`` iterates
    (Polyak-Ruppert tail averaging; 0: the last iterate). A stochastic optimiser with a step size that
    does not vanish ends at a random point of a cloud around the optimum whose width is set by the step
    size and the gradient noise (Monte Carlo draws, minibatches, privacy noise); the mean of ``K``
    iterates of that cloud has about ``1 / sqrt(K / tau)`` of its spread (``tau`` the iterates'
    correlation time), and is where the cloud is centred: the optimum, to first order. Averaging is
    post-processing of the gradients the steps used (no privacy cost).

    ``objective_scale``: the gradients are of the loss divided by this (the client's size), passed to
    optimisers that take it as an extra argument (:func:`~numpyro_dppvi.optim.cvi`; optax's
    ``GradientTransformationExtraArgs``); others ignore it.
    """
    optimizer = optax.with_extra_args_support(optimizer)
    opt_state = optimizer.init(params) if opt_state is None else opt_state
    first = steps - tail_length(steps, average)
    carried = aux is not None

    def step(carry, t):
        params, opt_state, total, extra = carry
        k = jax.random.fold_in(key, t)
        if carried:
            grads, loss, extra = gradient_fn(params, k, t, extra)
        else:
            grads, loss = gradient_fn(params, k, t)
        updates, opt_state = optimizer.update(grads, opt_state, params, objective_scale=objective_scale)
        params = optax.apply_updates(params, updates)
        total = jax.tree.map(lambda s, p: s + jnp.where(t >= first, p, 0.0), total, params)
        return (params, opt_state, total, extra), loss

    zero = jax.tree.map(jnp.zeros_like, params)
    (params, opt_state, total, aux), losses = jax.lax.scan(
        step, (params, opt_state, zero, aux if carried else ()), jnp.arange(steps))
    if first < steps - 1:
        params = jax.tree.map(lambda s: s / (steps - first), total)
    return (params, losses, opt_state, aux) if carried else (params, losses, opt_state)


@dataclass(frozen=True)
class ServerFactorStep:
    """Refines the server-held prior factor ``t_0`` (DESIGN §4): the local step with no data.

    Its objective is the local objective without data, ``E_q[f(u)] + E_q[log cavity_0(u)] + H[q]``
    with ``f(u) = log p(T(u)) + log|J(u)|`` summed over the sites whose prior the server holds, and
    ``cavity_0 = q / t_0`` (the exact Gaussian prior part times every client factor). It is
    maximised by natural-gradient steps written in the factor's own parameters (conjugate-computation
    VI, Khan & Lin 2017; the Bayesian learning rule), on the coordinates of ``mask`` only:

        P    <- P + beta G (+ beta^2 G^2 / (2 P) when the target precision is not positive),
        G     = (P_cavity - E_q[d^2 f / du^2]) - P,
        mu   <- mu + beta (E_q[df/du] + eta1_cavity + 2 eta2_cavity mu) / P_new,

    ``P = -2 eta2_q`` (Lin, Schmidt & Khan 2020 for the positivity-preserving second-order term).
    The stationary points are those of the objective (``d/dmu = 0`` and ``d/ds = 0`` are
    ``E[df/du] + eta1_c + 2 eta2_c mu = 0`` and ``eta2_q = eta2_c + E[d^2 f/du^2] / 2`` by Price's
    theorem), so every fixed point is still one of global VI. ``t_0 = q / cavity_0`` is then
    ``(E[df/du] - E[d^2f/du^2] mu, E[d^2f/du^2] / 2)``: a quantity on the scale of the prior's
    curvature, estimated with an error on that scale.

    Why not Adam on ``(mu, log s)`` of ``q`` (the former rule, issue 15): ``q`` carries the data's
    precision, ``n`` times the prior's, and Adam moves ``log s`` by about ``lr`` per step whatever
    the gradient, so ``t_0 = q_new / cavity_0`` absorbed errors of ``~ lr * n`` in precision, far
    more than the prior's own precision; a few rounds turned ``t_0``'s precision negative and the
    client's cavity improper (``FitDiverged`` in ``fit_global_vi`` on a Poisson GLM with
    HalfNormal/LogNormal priors).

    **Trust region**: a mean moves at most one sd of the new ``q`` per iteration, and not at all where
    the target precision is not positive (there the objective is not locally concave and a Newton step
    points nowhere in particular; only the precision moves). The fixed points are unchanged (there the
    move is zero and the target precision is ``q``'s, positive), but an iteration cannot leave the
    basin of the optimum: when the clients' factors sum to a non-positive precision on a coordinate
    (legitimate in PVI), ``cavity_0`` is improper there and the objective has its optimum only
    locally, next to an unbounded direction. Without this, the Monte Carlo estimate of a heavy-tailed
    gradient (a HalfNormal(10) prior's ``e^{2u}``) threw the mean of a negative-binomial dispersion to
    ``-4e11``, from where it ran to ``-inf`` while every client update failed (issue 21).

    The returned factor is the average of the iterates of the second half of the ``steps``
    iterations (Monte Carlo noise of the expectations, ``num_samples`` draws each, is averaged
    down). An iteration whose statistics are not finite leaves the factor as it was on those
    coordinates. ``optimizer`` is not used by this rule (kept so the constructor is unchanged).
    No data is touched, so the step costs no privacy and counts no communication.
    """

    log_density: Callable
    mask: tuple  # bools per coordinate (a tuple, so that the step is hashable: it keys compiled programs)
    optimizer: optax.GradientTransformation
    steps: int
    num_samples: int
    step_size: float = 0.5  # beta of the natural-gradient step

    def update(self, q: Gaussian, cavity: Gaussian, key) -> Gaussian:
        index = [i for i, inside in enumerate(self.mask) if inside]  # static
        if not index:
            return q
        index = jnp.asarray(index, jnp.int32)
        dim = q.eta1.shape[-1]
        beta = float(self.step_size)
        half = self.steps // 2
        c1, c2 = cavity.eta1[index], cavity.eta2[index]
        t1, t2 = q.eta1[index] - c1, q.eta2[index] - c2  # the current t_0 on the mask
        loc0, scale0 = factors.to_loc_scale(q)  # off the mask q stays as it is

        def step(carry, i):
            t1, t2, s1, s2 = carry
            precision = -2.0 * (c2 + t2)
            mu = (c1 + t1) / precision
            loc, scale = loc0.at[index].set(mu), scale0.at[index].set(jnp.sqrt(1.0 / precision))
            eps = jax.random.normal(jax.random.fold_in(key, i), (self.num_samples, dim))
            grad, curv = objectives.expected_grad_and_diag_hessian(self.log_density, loc, scale, eps, index)
            target = -2.0 * c2 - curv
            gap = target - precision
            new_precision = precision + beta * gap + jnp.where(target > 0, 0.0, 0.5 * beta ** 2 * gap ** 2 / precision)
            move = beta * (grad + c1 + 2.0 * c2 * mu) / new_precision
            bound = jnp.sqrt(1.0 / new_precision)  # trust region: at most one sd of q per iteration
            new_mu = mu + jnp.where(target > 0, jnp.clip(move, -bound, bound), 0.0)
            n1, n2 = new_mu * new_precision - c1, -0.5 * new_precision - c2
            ok = jnp.isfinite(n1) & jnp.isfinite(n2) & (new_precision > 0)
            t1, t2 = jnp.where(ok, n1, t1), jnp.where(ok, n2, t2)
            keep = (i >= half).astype(t1.dtype)
            return (t1, t2, s1 + keep * t1, s2 + keep * t2), None

        zero = jnp.zeros_like(t1)
        (_, _, s1, s2), _ = jax.lax.scan(step, (t1, t2, zero, zero), jnp.arange(self.steps))
        count = self.steps - half
        return Gaussian(q.eta1.at[index].set(c1 + s1 / count), q.eta2.at[index].set(c2 + s2 / count))


def releases_pairs(optimizer, family: str) -> bool:
    """Whether DP optimisation with this local step and family releases the pair gradients
    (:attr:`DPOptimisation.pair_release`): every family and step but an optax step of a mean-field ``q``, which
    releases the scaled variational gradient (:func:`~numpyro_dppvi.objectives.per_example_scaled_grads`)."""
    return family != "mean_field" or isinstance(optimizer, PrivateNewton)


@dataclass(frozen=True)
class DPOptimisation(NonPrivate):
    """DP-SGD inside the local step (Heikkila et al. 2023, §4.1, Theorem 6; DESIGN §5.1).

    Each step draws a batch with the sampler the ledger accounts (Poisson: every valid row with
    probability ``q_m``, the plan's rate ``batch_size / N_m`` rounded up (``N_m`` the client's public size:
    a declared bound, else its number of rows; :mod:`numpyro_dppvi.privacy.sizes`); or exactly ``batch_size``
    rows without replacement), computes per-example gradients of the likelihood term
    ``g_i = d/d(mu, log s) E_q[log p(x_i | theta)]`` only, clips each jointly to norm ``C``, sums,
    and adds ``N(0, noise_std^2 I)`` with ``noise_std = sigma C``:

        g_data = (sum_{i in B} clip_C(g_i) + N(0, sigma^2 C^2 I)) / (q_m N_m),
        g = -(g_data + d/d(mu, log s) [E_q log cavity + H[q]] / N_m)

    (the loss per public row: ``1 / q_m`` makes the batch sum an unbiased estimate of the sum over the
    ``n_m <= N_m`` rows, whatever ``n_m`` is).

    The vector actually clipped and noised is one from which ``g_i`` is a public linear function
    (:attr:`pair_release`): with :class:`~numpyro_dppvi.optim.PrivateNewton` steps, and any step of a full-rank or
    low-rank ``q``, the pair gradients of the likelihood at antithetic draws
    (:func:`~numpyro_dppvi.objectives.per_example_pair_grads`, ``2 P D`` coordinates), from which the step reads
    both the gradient above and the factor estimates of the noise-aware answer (:mod:`.noise_aware`); with an optax
    step of a mean-field ``q``, ``g_i`` with its log-scale block scaled by the public ``kappa / (s sigma)``
    (:func:`~numpyro_dppvi.objectives.per_example_scaled_grads`, ``2 D`` coordinates), so that the curvature it
    carries is not swamped by the noise. The sensitivity argument below holds for any such vector.

    A Poisson batch is never padded: :func:`~numpyro_dppvi.privacy.sampling.poisson_fold` walks it
    ``chunk`` rows at a time, so the work follows the batch actually drawn (no pad sized for its
    extreme tail, no truncation to charge).

    **Full-rank** ``q`` (``family="full_rank"``): the parameters are the mean and the Cholesky factor of the
    covariance, ``(mu, log diag L, L below the diagonal)`` (:func:`~numpyro_dppvi.factors.to_params`), and
    ``g_i`` their per-example gradients (``D (D + 3) / 2`` coordinates, clipped jointly; the noise has as
    many). **Low-rank** ``q`` (``family="low_rank"``): the parameters are ``(mu, log s, W)`` with the precision
    ``S^{-1} (I + W W^T) S^{-1}`` (NumPyro's ``AutoLowRankMultivariateNormal`` mirrored onto the precision, whose
    sums stay positive semi-definite), ``2 D + D r`` coordinates; the answer's new directions ``S^{-1} W`` widen
    the public basis at the server (post-processing of the released gradients). The sensitivity argument below concerns the norm of ``g_i``, whatever its coordinates.

    Sensitivity: the released sum changes by at most ``C`` when a record is added or removed and
    ``2C`` when one is replaced (each clipped term has norm <= C; a non-finite term is zeroed); the
    cavity term is data-independent and added after the noise, so it costs nothing. Accounting: per
    client, one subsampled Gaussian release per local step at rate ``q_m``. The per-step loss
    reported to the server is the data-free part only (no unprivatised data-dependent value leaves
    the client).

    The noise std and the rate are per client (each client's noise is calibrated to its own
    sampling rate), carried in ``client_state["noise_std"]`` and ``client_state["rate"]``.
    ``log_lik_row(u, row)`` takes the flat ``u``; or, with ``blocks`` (the model's ``site_sizes``),
    the list of its site blocks (``ModelAdapter.log_lik_row_blocks``), which only changes the speed
    of the per-example gradients (``objectives.per_example_log_lik_grads``).
    """

    log_lik_row: Callable = None
    curvature_weight: float = 1.0  # kappa of the released curvature block (objectives.per_example_pair_grads,
    # objectives.per_example_scaled_grads)
    clip: float = 1.0
    sampling: str = "poisson"
    max_batch: int = 0  # the fixed batch of sampling without replacement
    blocks: tuple = None
    chunk: int = 8  # rows per chunk of a Poisson batch
    row_sampler: bool = False  # Poisson batches row by row (sampling.row_fold) instead of the skips' walk
    family: str = "mean_field"  # "full_rank": q and the factors [D, D], parameters (loc, L) (factors.to_params)
    rank: int = 0  # family "low_rank": parameters (loc, log_scale, factor [D, r]), draws from D + r normals
    damping: float = 1.0  # the server's damping, for the noise covariance of the damped factor (noise_aware)
    average_from: int = 0  # the update of each client from which its factor averages its estimates (damping 1)
    answer_radius: float = 3.0  # trust region of the answer around the iterate, in sds (noise_aware.probe_step)
    noise_aware: bool = False  # the answer's factor is the noisy observation's (noise_aware.noisy_observation_factor)

    @property
    def pairs(self) -> int:
        """Antithetic pairs of draws per step: ``num_samples // 2`` (at least one)."""
        return max(self.num_samples // 2, 1)

    #: Client-state entries added after the checkpoint and client-store formats were fixed: a state saved before
    #: them lacks them, and a resumed fit starts them at zero (:func:`numpyro_dppvi.checkpoint.with_added_leaves`).
    #: ``gain_noise`` then enters each client's damped estimate from its next update on, so the noise-aware
    #: posterior of a fit resumed from such a save under-states the gain's noise for a few updates.
    ADDED_STATE = ("gain_noise",)

    def init_client_state(self, arrays, mask, key) -> Any:
        """The covariance ``N_m`` of the noise in the client's factor (:mod:`.noise_aware`): ``[D]``, ``[D, D]``
        full-rank (low-rank answers are not estimated from the trace and carry none)."""
        square = jnp.zeros((self.dim, self.dim), jnp.float32)
        scalar = jnp.zeros((), jnp.float32)
        return {"factor_noise": square, "scatter_sum": square, "curvature_sum": square, "factor_curvature": square,
                "curvature_spread_sum": square, "curvature_bias": square, "gain_noise": square,
                "information_sum": jnp.zeros(self.dim, jnp.float32), "factor_count": scalar, "dof": scalar,
                "updates": jnp.zeros((), jnp.int32)}

    @property
    def trace_answer(self) -> bool:
        """The answer is the trace's factor estimate (:mod:`.noise_aware`) for mean-field and full-rank ``q`` with
        :class:`~numpyro_dppvi.optim.PrivateNewton` steps; with an optax optimizer it is the (tail-averaged) iterate."""
        return self.family in ("mean_field", "full_rank") and isinstance(self.optimizer, PrivateNewton)

    @property
    def pair_release(self) -> bool:
        """Whether a step releases the per-example pair gradients
        (:func:`~numpyro_dppvi.objectives.per_example_pair_grads`, ``2 P D`` coordinates), which the trace's factor
        estimates need (:attr:`trace_answer`) and full-rank and low-rank optax steps read; an optax step of a
        mean-field ``q`` releases the per-example variational gradient with its log-scale block scaled
        (:func:`~numpyro_dppvi.objectives.per_example_scaled_grads`, ``2 D`` coordinates), all it reads."""
        return releases_pairs(self.optimizer, self.family)

    def release_zero(self, params, eps):
        """A zero of the released sum's layout: ``[2, P, D]`` (pair release) or a tree like ``params``."""
        if self.pair_release:
            return jnp.zeros((2, self.pairs, self.dim), eps.dtype)
        return jax.tree.map(jnp.zeros_like, params)

    def clipped_sum(self, params, eps, rows, bmask, clip=None):
        """``sum_{i in B} clip_C(Gamma_i)`` over given rows (pre-noise) of the per-example vectors the step releases
        (:attr:`pair_release`): the pair gradients ``[2, P, D]``, or the scaled variational gradients, a tree like
        ``params``."""
        return self.clipped_sum_and_norms(params, eps, rows, bmask, clip)[0]

    def clipped_sum_and_norms(self, params, eps, rows, bmask, clip=None):
        """:meth:`clipped_sum` and the unclipped per-example norms (for adaptive clipping)."""
        if self.pair_release:
            per_example = objectives.per_example_pair_grads(self.log_lik_row, params, eps, rows,
                                                             self.curvature_weight, self.blocks)
        else:
            per_example = objectives.per_example_scaled_grads(self.log_lik_row, params, eps, rows,
                                                               self.curvature_weight, self.blocks)
        summed, norms = clipped_sum(per_example, self.clip if clip is None else clip, bmask)
        return summed, norms

    def sampled_clipped_sum(self, params, eps, arrays, mask, key, rate, clip):
        """``(sum_{i in B} clip_C(Gamma_i), sum_{i in B} (1[||Gamma_i|| <= C] - 1/2))`` over the batch ``B`` the
        accounted sampler draws (the released query before noise, and the adaptive-clipping count)."""
        if self.sampling == "poisson":
            def add_chunk(carry, indices, chunk_mask):
                total, count = carry
                summed, norms = self.clipped_sum_and_norms(params, eps, take_rows(arrays, indices), chunk_mask, clip)
                return jax.tree.map(jnp.add, total, summed), count + centred_count(norms, chunk_mask, clip)

            zero = (self.release_zero(params, eps), jnp.zeros(()))
            return (row_fold if self.row_sampler else poisson_fold)(key, mask, rate, self.chunk, add_chunk, zero)
        indices, bmask = without_replacement_batch(key, mask, self.max_batch)
        summed, norms = self.clipped_sum_and_norms(params, eps, take_rows(arrays, indices), bmask, clip)
        return summed, centred_count(norms, bmask, clip)

    def released_draw_sums(self, params, key, arrays, mask, client_state):
        """One DP-SGD release of the pair gradients (:attr:`pair_release`), read as estimates of ``sum_i G_is``
        over the client's rows: ``(draw_sums [S, D], eps, client_state)``, ``draw_sums = sqrt(S) (sum_{i in B}
        clip_C(Gamma_i) + N(0, sigma^2 C^2 I)) / q_m`` (:func:`~numpyro_dppvi.objectives.per_example_pair_grads`;
        ``E[|B|] = q_m n_m``, so ``1 / q_m`` makes the batch sum unbiased for the sum over the ``n_m <= N_m``
        rows)."""
        noisy, eps, rate, client_state = self.release(params, key, arrays, mask, client_state)
        return objectives.draw_sums_from_pair_sums(params, noisy, self.curvature_weight) / rate, eps, client_state

    def release(self, params, key, arrays, mask, client_state):
        """One DP-SGD release: ``(sum_{i in B} clip_C(Gamma_i) + N(0, sigma^2 C^2 I), eps, q_m, client_state)``
        over the batch ``B`` the accounted sampler draws, ``Gamma_i`` the per-example vector of
        :meth:`clipped_sum_and_norms`, ``eps`` the step's antithetic draws.

        With adaptive clipping (``client_state["clip"]``, Andrew et al. 2021) the clip norm is the
        client's current private quantile estimate; the gradient noise scales with it
        (``noise_per_clip * C_t``, a constant noise multiplier) and the noisy count of norms below
        ``C_t`` on the same batch updates it; the pair is one accounted release
        (``privacy.adaptive_clip``).
        """
        k_batch, k_eps, k_noise = jax.random.split(key, 3)
        rate = client_state["rate"]
        eps = objectives.antithetic_pairs(k_eps, self.pairs, self.dim + self.rank)
        adaptive = "clip" in client_state
        clip = client_state["clip"].clip if adaptive else self.clip
        summed, count = self.sampled_clipped_sum(params, eps, arrays, mask, k_batch, rate, clip)
        # a float32 product rounds by half an ulp at most: one ulp up keeps the std >= the calibrated one
        std = jnp.nextafter(client_state["noise_per_clip"] * clip, jnp.inf) if adaptive else client_state["noise_std"]
        if adaptive:  # the sum's and the count's noise from one draw (one copy of the sampler in the program)
            noisy, noisy_count = add_gaussian_noise(k_noise, (summed, count), (std, client_state["clip"].count_noise_std))
            client_state = dict(client_state, clip=adaptive_clip_step(client_state["clip"], noisy_count))
        else:
            noisy = add_gaussian_noise(k_noise, summed, std)
        return noisy, eps, rate, client_state

    def gradients(self, params, eps, draw_sums, n, cavity):
        """``(gradient of the loss -L_m / N_m, data-free loss)`` from one pair release's ``draw_sums`` (aligned
        gradients: :func:`~numpyro_dppvi.objectives.data_gradients_from_draw_sums`)."""
        return self.loss_gradients(params, objectives.data_gradients_from_draw_sums(params, eps, draw_sums), n,
                                   cavity)

    def loss_gradients(self, params, data, n, cavity):
        """``(gradient of the loss -L_m / N_m, data-free loss)`` from the released estimate ``data`` of the
        likelihood term's gradient (summed over the client's rows); the cavity term is data-independent and
        exact."""
        prior_value, prior_grad = jax.value_and_grad(lambda p: objectives.cavity_term(p, cavity) / n)(params)
        return jax.tree.map(lambda d, pg: -(d / n + pg), data, prior_grad), -prior_value

    def private_step(self, params, key, arrays, mask, n, cavity, client_state):
        """One DP-SGD step: ``(gradient of the loss, data-free loss, client_state)``."""
        if self.pair_release:
            draw_sums, eps, client_state = self.released_draw_sums(params, key, arrays, mask, client_state)
            grads, loss = self.gradients(params, eps, draw_sums, n, cavity)
            return grads, loss, client_state
        noisy, _, rate, client_state = self.release(params, key, arrays, mask, client_state)
        data = objectives.gradients_from_scaled(params, jax.tree.map(lambda v: v / rate, noisy), self.curvature_weight)
        grads, loss = self.loss_gradients(params, data, n, cavity)
        return grads, loss, client_state

    def update(self, q, cavity, arrays, mask, n, key, client_state):
        trace = self.trace_answer  # PrivateNewton steps only: an optax step's answer is its (tail-averaged) iterate

        def gradient_fn(p, k, t, cs):
            grads, loss, cs = self.private_step(p, k, arrays, mask, n, cavity, cs)
            return grads, (loss, ()), cs

        if isinstance(self.optimizer, PrivateNewton):
            iterate, (losses, estimates), client_state = self.newton_steps(q, cavity, arrays, mask, n, key,
                                                                           client_state)
        else:
            params, (losses, estimates), _, client_state = optimise(
                self.optimizer, factors.to_params(q), self.local_steps, key, gradient_fn,
                average=self.average, aux=client_state, objective_scale=n)
            iterate = factors.from_params(params)
        if not trace:
            if factors.is_low_rank(q):  # in the basis [B, S^-1 W]: the server widens B by the answer's directions
                iterate = factors.prepend_basis(iterate, q.eta2.basis)
            return iterate, client_state, {"loss": losses[-1], "bound": jnp.zeros((), bool),
                                           "floored": jnp.zeros((), bool)}
        answer, bound, client_state = self.trace_answer_of(estimates, cavity, iterate, client_state)
        floored = noise_aware.floors(client_state["factor_curvature"], self.family == "full_rank")
        return answer, client_state, {"loss": losses[-1], "bound": bound, "floored": floored}

    def averaging(self, client_state):
        """Whether this update's estimates join the client's earlier ones (:meth:`trace_answer_of`)."""
        return (self.damping == 1.0) & (client_state["updates"] >= self.average_from)

    def newton_steps(self, q, cavity, arrays, mask, n, key, client_state):
        """``local_steps`` steps of :class:`~numpyro_dppvi.optim.PrivateNewton` from ``q``: ``(last iterate,
        (data-free losses, per-step estimates (h_t, B_t)), client_state)``. The step's target is the Newton
        answer of the mean of every estimate of this update (and of the client's earlier ones it averages
        with); the iterate moves ``step`` of the way there in natural parameters where that is proper."""
        averaging = self.averaging(client_state)
        carried = lambda name: jnp.where(averaging, client_state[name], 0.0)
        start = (carried("information_sum"), carried("curvature_sum"), carried("factor_count"))

        def step(carry, t):
            probe, sums, cs = carry
            params = factors.to_params(probe)
            draw_sums, eps, cs = self.released_draw_sums(params, jax.random.fold_in(key, t), arrays, mask, cs)
            probe, sums, out = self.after_release(probe, sums, cs, cavity, n, eps, draw_sums)
            return (probe, sums, cs), out

        (probe, _, client_state), outputs = jax.lax.scan(step, (q, start, client_state), jnp.arange(self.local_steps))
        return probe, outputs, client_state

    def after_release(self, probe: Gaussian, sums, client_state, cavity: Gaussian, n, eps, draw_sums):
        """The post-processing of one release by :class:`~numpyro_dppvi.optim.PrivateNewton` (no data: the
        release ``draw_sums``, its draws ``eps``, the public ``probe``, ``cavity`` and size, and values computed
        from earlier releases): ``(next probe, running sums, (data-free loss, (h_t, B_t)))``. The step's target
        is the Newton answer of the mean of every estimate so far (:meth:`newton_steps`)."""
        h_sum, b_sum, count = sums
        params = factors.to_params(probe)
        h, b = noise_aware.factor_estimate(params, eps, draw_sums)
        sums = (h_sum + h, b_sum + b, count + 1.0)
        information, curvature = sums[0] / sums[2], sums[1] / sums[2]
        if self.noise_aware:  # the answer's shrinkage, with the noise known for certain (the mechanism's)
            dp_variance = jnp.square(self.noise_std_of(client_state) / client_state["rate"]) / sums[2]
            information, curvature = noise_aware.noisy_observation_factor(
                information, curvature, dp_variance * jnp.eye(self.dim, dtype=curvature.dtype))
        target = noise_aware.newton_answer(cavity, information, curvature, params["loc"])
        moved, _ = noise_aware.probe_step(probe, target, self.optimizer.step)
        loss = -objectives.cavity_term(params, cavity) / n
        return moved, sums, (loss, (h, b))

    def trace_answer_of(self, estimates, cavity: Gaussian, iterate: Gaussian, client_state):
        """The client's answer from this update's per-step estimates ``(h_t, B_t)`` (:mod:`.noise_aware`), its
        noise, and the client state carrying both: ``(q_new, bound, client_state)``.

        The estimates of the last half of the steps (all of them after the client's first update, which starts
        from the prior) give this update's ``(h, B)``. From the client's ``average_from``-th update on (with
        ``damping = 1``) its estimate is the mean over every update since, weighted by their steps:
        Polyak-Ruppert averaging across rounds. The answer is the Newton step to that factor
        (:func:`~.noise_aware.newton_answer`) from the iterate, inside a trust region of ``answer_radius`` sds
        (:func:`~.noise_aware.probe_step`; ``bound``: it held the answer back). Its noise is the pooled step
        covariance (:func:`~.noise_aware.step_covariance`) over the steps averaged; with ``damping < 1`` the
        factor's noise follows the damped updates (:func:`~.noise_aware.damped_noise`). The state also carries the
        bias that the curvature's own noise gives the factor's precision (:func:`~.noise_aware.curvature_noise_bias`,
        from the scatter of the per-step curvatures weighted by ``(B + V)^{-1}`` of their update, pooled like
        ``c_t``'s; damped like the curvature), which the reported posterior takes off, and the variance that noise
        adds to the answer's pull on the mean (:func:`~.noise_aware.gain_noise_covariance`, from this update's
        steps; damped like the factor's noise), which the reported posterior adds (the answer uses neither)."""
        information, curvatures = estimates
        steps = self.local_steps
        first = client_state["updates"] == 0
        keep = jnp.arange(steps) >= jnp.where(first, steps - tail_length(steps, 0.5), 0)
        kept = jnp.sum(keep).astype(jnp.float32)
        averaging = self.averaging(client_state)
        carried = lambda name, x: jnp.where(averaging, client_state[name], 0.0) + x
        count = carried("factor_count", kept)
        reference = factors.to_loc_scale(iterate)[0]
        answer_of = lambda h, b: noise_aware.probe_step(iterate, noise_aware.newton_answer(cavity, h, b, reference),
                                                        1.0, self.answer_radius)
        mean_of = lambda h, b: factors.to_loc_scale(answer_of(carried("information_sum", kept * h) / count,
                                                              carried("curvature_sum", kept * b) / count)[0])[0]
        this_h, this_b, scatter = noise_aware.tail_estimate(information, curvatures, keep, mean_of)
        information_sum = carried("information_sum", kept * this_h)
        curvature_sum = carried("curvature_sum", kept * this_b)
        scatter_sum, dof = carried("scatter_sum", scatter), carried("dof", kept - 1.0)
        curvature = curvature_sum / count
        # of a_t's mean-pair block, at the last clip: an adaptive clip that grew over the steps averaged makes this
        # overstate their noise (1.15-2.3x on the zoo's Weibull regression); their mean narrowed the intervals onto
        # the clipping bias (Gamma, 2,000 rows, epsilon 1: 90% coverage .85 -> .74), so it stays until that bias is
        # removed (benchmarks/results/auto_clip_count_share.json)
        dp_variance = jnp.square(self.noise_std_of(client_state) / client_state["rate"])
        fresh = noise_aware.step_covariance(scatter_sum, dof, dp_variance) / count
        information = information_sum / count
        weight = jnp.linalg.inv(noise_aware.semidefinite(curvature, True) + fresh
                                + 1e-12 * jnp.eye(self.dim, dtype=curvature.dtype))
        spread_sum = carried("curvature_spread_sum", noise_aware.curvature_spread(curvatures, keep, weight))
        bias = noise_aware.curvature_noise_bias(curvature, fresh, spread_sum / jnp.maximum(dof, 1.0) / count)
        gain_noise = noise_aware.gain_noise_covariance(curvature, fresh, information - curvature @ reference,
                                                       curvatures, keep, count)
        if self.noise_aware:
            information, curvature = noise_aware.noisy_observation_factor(information, curvature, fresh)
        answer, bound = answer_of(information, curvature)
        if self.damping != 1.0:
            fresh = noise_aware.damped_noise(client_state["factor_noise"], fresh, self.damping)
            curvature = (1.0 - self.damping) * client_state["factor_curvature"] + self.damping * curvature
            bias = (1.0 - self.damping) * client_state["curvature_bias"] + self.damping * bias
            gain_noise = noise_aware.damped_noise(client_state["gain_noise"], gain_noise, self.damping)
        keep_finite = lambda new, old: jnp.where(jnp.all(jnp.isfinite(new)), new, old)
        client_state = dict(client_state, updates=client_state["updates"] + 1, factor_count=count,
                            information_sum=information_sum, curvature_sum=curvature_sum, scatter_sum=scatter_sum,
                            dof=dof, curvature_spread_sum=spread_sum,
                            factor_noise=keep_finite(fresh, client_state["factor_noise"]),
                            factor_curvature=keep_finite(curvature, client_state["factor_curvature"]),
                            curvature_bias=keep_finite(bias, client_state["curvature_bias"]),
                            gain_noise=keep_finite(gain_noise, client_state["gain_noise"]))
        return answer, bound, client_state

    def noise_std_of(self, client_state):
        """The std of the Gaussian mechanism's noise per coordinate of the release (with adaptive clipping: at
        the current clip)."""
        if "clip" in client_state:
            return client_state["noise_per_clip"] * client_state["clip"].clip
        return client_state["noise_std"]
