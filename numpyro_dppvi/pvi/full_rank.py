"""Local steps of full-rank Gaussian factors (``family="full_rank"``, issue 22).

``q = N(mu, Lambda^{-1})`` with a full precision ``Lambda``; a factor holds ``eta1 = Lambda mu`` and
``eta2 = -Lambda / 2`` (``[D, D]``; :mod:`numpyro_dppvi.factors`). A client maximises PVI's local
objective (Heikkila et al. 2023, eq. 2; Ashman et al. 2022, eq. 6)::

    L_m(q) = E_q[f(u)] + E_q[log cavity_m(u)] + H[q],     f(u) = (n_m / |B|) sum_{i in B} log p(x_i | T(u)),

whose stationary points satisfy, by Bonnet's and Price's theorems (Opper & Archambeau 2009)::

    Lambda = Lambda_c - E_q[grad^2 f],       0 = E_q[grad f] + eta1_c - Lambda_c mu        (*)

(``Lambda_c = -2 eta2_c``: the cavity's precision, possibly not positive definite). The rule takes
natural-gradient steps (conjugate-computation VI, Khan & Lin 2017, eq. 12; the Bayesian learning
rule's Gaussian case, Khan & Rue 2023, §4.2) towards (*), with step ``beta``::

    T        = Lambda_c - E_q[grad^2 f]                          (the target precision)
    Lambda' = (1 - beta) Lambda + beta T                         (T positive definite)
    Lambda' = Lambda + beta G + beta^2 G Lambda^{-1} G / 2,  G = T - Lambda   (otherwise)
    mu'      = mu + beta P^{-1} (E_q[grad f] + eta1_c - Lambda_c mu),     P = Lambda (P = Lambda' at the first step),

the second form being the positivity-preserving step of Lin, Schmidt & Khan (2020, eq. 7): it equals
``Lambda / 2 + (Lambda + beta G) Lambda^{-1} (Lambda + beta G) / 2``, positive definite whenever
``Lambda`` is. Fixed points are exactly (*). The mean's preconditioner ``P`` is the precision before
this step's batch (:func:`newton_step`: with minibatches, a preconditioner holding the same batch's
Hessian biases the mean). For a Gaussian likelihood ``f`` is quadratic, both expectations are exact
whatever the draws, and the step contracts the errors of ``Lambda`` and ``mu`` by about ``1 - beta``
per step (after the first, ``Lambda >= beta T``, so ``beta P^{-1} T <= 1`` and the mean does not
overshoot): the exact posterior in a few dozen steps. **Trust region**: the mean moves at most one
sd of ``q'`` (``|| mu' - mu ||_{Lambda'} <= 1``), so that a step taken where the objective is not
concave cannot leave the basin.

The expectations are Monte Carlo averages over ``S`` draws ``u_s = mu + L^{-T} eps_s`` (``Lambda =
L L^T``; antithetic pairs), with the exact Hessian of each draw (forward over reverse: ``D`` gradient
evaluations of the batch per draw, ``O(|B| D^2)`` for a GLM, and an ``O(D^3)`` Cholesky per step).
Draws whose gradient or Hessian are not finite while their value is are left out of the averages (the
non-differentiable but finite corners of :func:`~numpyro_dppvi.objectives.finite_log_lik_draws`); a
draw whose *value* is not finite makes the update NaN, so the server drops it (``failed``).

The client's answer is the mean of ``(mu, Lambda)`` over the last ``average`` share of the steps
(tail averaging, as :func:`~numpyro_dppvi.pvi.local.optimise`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import factors, objectives
from ..factors import Gaussian
from ..optim import Newton
from .local import shuffled_order, tail_length, take_rows, window_batch


#: jaxlib's ``kMinWorkPerTask`` (``jaxlib/cpu/lapack_kernels.cc``): a batched LAPACK call whose ``batch x cost``
#: (cost per matrix at most ``D^3`` for the Cholesky, LU and triangular solves used here) reaches it is split over the
#: intra-op thread pool, each call blocking a worker until its pieces are done.
LAPACK_PARALLEL_WORK = 200_000


def lapack_safe_chunk(dim: int, outer: int = 1) -> int:
    """How many ``[D, D]`` problems one batched LAPACK call may hold, inside a ``vmap`` of width ``outer``, and
    still run on the calling thread: the largest ``k >= 1`` with ``outer k D^3 < LAPACK_PARALLEL_WORK``.

    Why: jaxlib 0.10's CPU LAPACK kernels split a large batch over the intra-op pool and wait for the pieces in
    the worker that runs them; two such calls that XLA runs concurrently can each hold a worker of a small pool
    (2 on a 2-core machine) and wait for pieces no free worker is left to run. Measured: the full-rank
    virtual-clients round at 10 clients x 1,000 one-record shards (``D = 6``) hung in 3 of 3 runs, every thread
    idle in ``jax::ParallelBatchMap``'s ``BlockingCounter::Wait`` (gdb); a ``lax.scan`` of an independent batched
    Cholesky and inverse of 5,000 ``6 x 6`` matrices hung in 2 of 3 runs, and never with one of the two. Shard
    rules map their shards in chunks of this size (:func:`map_in_chunks`), so that the calls whose batch grows
    with the data stay on the calling thread; the servers map their clients in chunks too (:func:`map_clients`),
    and ``outer`` is the clients of one chunk."""
    return max(1, (LAPACK_PARALLEL_WORK - 1) // (max(1, int(outer)) * int(dim) ** 3))


def map_in_chunks(fn: Callable, xs: tuple, chunk: int | None):
    """``vmap(fn)(*xs)`` over the leading axis of ``xs``; with ``chunk``, as a sequential ``lax.map`` over equal
    chunks of at most ``chunk`` items (each chunk a ``vmap``), so that no batched LAPACK call of ``fn`` holds more
    than ``chunk`` problems (:func:`lapack_safe_chunk`). The items are padded to a whole number of chunks with
    copies of the first (their results are dropped), so that one chunk's program is compiled, not a second one for
    a remainder. The same values either way, up to the order of floating-point work."""
    count = jax.tree.leaves(xs)[0].shape[0]
    if chunk is None or chunk >= count:
        return jax.vmap(fn)(*xs)
    chunks = -(-count // int(chunk))
    size = -(-count // chunks)
    padded = jax.tree.map(lambda a: jnp.concatenate([a, a[jnp.zeros(chunks * size - count, int)]]), xs)
    out = jax.lax.map(lambda x: fn(*x), padded, batch_size=size)
    return jax.tree.map(lambda a: a[:count], out)


def client_chunk(q: Gaussian, clients: int) -> int | None:
    """Clients per chunk of a map over ``clients`` clients whose work holds ``[D, D]`` LAPACK calls (``q`` full-rank
    or low-rank, whose steps are dense): None (one ``vmap``) where ``clients D^3`` stays under
    :data:`LAPACK_PARALLEL_WORK` or for a mean-field ``q``, else :func:`lapack_safe_chunk` of ``D`` (one client at
    a time from ``D = 59``: a batch of one is never split). Measured: a non-private full-rank PVI fit, synchronous,
    10 clients, ``D = 60``, hung in 2 of 2 runs without it (gdb: ``spotrf`` and ``sgetrf`` of ``[10, 60, 60]``
    waiting in ``ParallelBatchMap``)."""
    if not (factors.is_full_rank(q) or factors.is_low_rank(q)):
        return None
    batch = client_batch(int(q.eta1.shape[-1]), clients)
    return None if batch >= clients else batch


def client_batch(dim: int, clients: int) -> int:
    """How many of ``clients`` clients one ``vmap`` of dense (``[D, D]``) work holds: all of them where ``clients
    D^3`` stays under :data:`LAPACK_PARALLEL_WORK`, else :func:`lapack_safe_chunk` of ``D``. The ``outer`` of the
    shards' chunks (:func:`lapack_safe_chunk`)."""
    if clients < 2 or clients * int(dim) ** 3 < LAPACK_PARALLEL_WORK:
        return max(1, int(clients))
    return lapack_safe_chunk(dim)


def map_clients(fn: Callable, xs: tuple, q: Gaussian):
    """``vmap(fn)(*xs)`` over the clients (the leading axis of ``xs``), in chunks of :func:`client_chunk` where one
    ``vmap`` would batch enough ``[D, D]`` problems for jaxlib to split them over its pool."""
    return map_in_chunks(fn, xs, client_chunk(q, jax.tree.leaves(xs)[0].shape[0]))


def expected_derivatives(f: Callable, u: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(mean value, E[grad f], E[grad^2 f])`` over the draws ``u`` (``[S, D]``). Draws whose gradient
    or Hessian are not finite are left out (their values still count: a non-finite value makes every
    result NaN)."""

    def gradient(v):  # the Hessian is its forward derivative; the value and gradient ride along
        value, g = jax.value_and_grad(f)(v)
        return g, (value, g)

    def per_draw(v):
        hess, (value, g) = jax.jacfwd(gradient, has_aux=True)(v)
        return value, g, hess

    values, grads, hessians = jax.vmap(per_draw)(u)
    ok = jnp.all(jnp.isfinite(grads), axis=1) & jnp.all(jnp.isfinite(hessians), axis=(1, 2))
    poison = jnp.where(jnp.all(jnp.isfinite(values)), 0.0, jnp.nan)  # an impossible draw: the update fails
    weight = ok / jnp.maximum(jnp.sum(ok), 1) + poison
    return (jnp.mean(values),
            jnp.einsum("s,sd->d", weight, jnp.where(ok[:, None], grads, 0.0)),
            jnp.einsum("s,sde->de", weight, jnp.where(ok[:, None, None], hessians, 0.0)))


def newton_step(mean, precision, grad, hess, cavity: Gaussian, beta: float, lead=True, chol=None,
                growth: float = float("inf")):
    """One step towards (*) of the module docstring: ``(mean', precision')``.

    ``lead=False``: the mean's step is preconditioned by the current ``precision``, not ``precision'``.
    With minibatches ``precision'`` holds this step's batch Hessian, which is correlated with this
    step's batch gradient, and ``E[precision'^{-1} grad] != E[precision']^{-1} E[grad]``: the mean's
    fixed point moved by 0.16 posterior sd on a conjugate regression (batches of 25 of 225 rows). The
    current precision depends on earlier batches only, so the mean's step is unbiased given it. The
    first step of an update leads (``lead=True``): from a prior far wider than the posterior, the
    current precision would make the mean's step many sds long. ``chol``: the Cholesky factor of
    ``precision`` when the caller has it. ``growth`` (``c``, :class:`~numpyro_dppvi.optim.Newton`'s
    ``max_precision_growth``): where the largest eigenvalue ``r`` of ``Lambda^{-1} Lambda'`` exceeds ``c``,
    ``Lambda' <- Lambda + (c - 1) / (r - 1) (Lambda' - Lambda)`` (a point of the segment, so positive definite),
    whose largest ratio is ``c``."""
    cavity_precision = -2.0 * cavity.eta2
    target = cavity_precision - hess
    target = 0.5 * (target + target.T)
    gap = target - precision
    target_chol = jnp.linalg.cholesky(target)
    definite = jnp.all(jnp.isfinite(target_chol))
    second_order = 0.5 * beta ** 2 * gap @ jnp.linalg.solve(precision, gap)
    new = precision + beta * gap + jnp.where(definite, 0.0, 1.0) * second_order
    new = 0.5 * (new + new.T)
    chol = jnp.linalg.cholesky(precision) if chol is None else chol
    if growth != float("inf"):
        solve = functools.partial(jax.scipy.linalg.solve_triangular, chol, lower=True)
        ratio = jnp.max(jnp.linalg.eigvalsh(solve(solve(new).T)))  # of L^-1 Lambda' L^-T
        shrink = jnp.where(ratio > growth, (growth - 1.0) / jnp.maximum(ratio - 1.0, 1e-30), 1.0)
        new = precision + shrink * (new - precision)
    new_chol = jnp.linalg.cholesky(new)
    residual = grad + cavity.eta1 - cavity_precision @ mean
    preconditioner = jnp.where(lead, new_chol, chol)
    move = beta * jax.scipy.linalg.cho_solve((preconditioner, True), residual)
    length = jnp.sqrt(jnp.maximum(move @ new @ move, 0.0))
    move = move / jnp.maximum(length, 1.0)  # at most one sd of the new q
    return mean + move, new


def _from_mean_precision(mean, precision) -> Gaussian:
    return Gaussian(precision @ mean, -0.5 * precision)


def iterate(objective: Callable, q: Gaussian, cavity: Gaussian, steps: int, key, num_samples: int,
            beta, average: float, antithetic: bool = True, growth: float = float("inf")):
    """``steps`` Newton steps from ``q`` on ``E_q[objective(u, step)] + E_q[log cavity] + H[q]``;
    returns ``(q_new, last loss)``, ``q_new`` the tail average of ``(mu, Lambda)``."""
    mean0, precision0 = factors.mean_and_precision(q)
    dim = mean0.shape[-1]
    first = steps - tail_length(steps, average)

    def step(carry, t):
        mean, precision, sum_mean, sum_precision = carry
        chol = jnp.linalg.cholesky(precision)
        eps = objectives.standard_draws(jax.random.fold_in(key, t), num_samples, dim, antithetic)
        value, grad, hess = expected_derivatives(lambda v: objective(v, t), factors.precision_draws(mean, chol, eps))
        cov = jax.scipy.linalg.cho_solve((chol, True), jnp.eye(dim, dtype=mean.dtype))
        entropy = 0.5 * dim * jnp.log(2 * jnp.pi * jnp.e) - jnp.sum(jnp.log(jnp.diag(chol)))
        loss = -(value + factors.expected_log_factor_full(mean, cov, cavity) + entropy)
        mean, precision = newton_step(mean, precision, grad, hess, cavity, beta, lead=t == 0, chol=chol,
                                      growth=growth)
        keep = (t >= first).astype(mean.dtype)
        return (mean, precision, sum_mean + keep * mean, sum_precision + keep * precision), loss

    zero_m, zero_p = jnp.zeros_like(mean0), jnp.zeros_like(precision0)
    (_, _, sum_mean, sum_precision), losses = jax.lax.scan(
        step, (mean0, precision0, zero_m, zero_p), jnp.arange(steps))
    count = steps - first
    return _from_mean_precision(sum_mean / count, sum_precision / count), losses[-1]


@dataclass(frozen=True)
class NonPrivateFullRank:
    """PVI's non-private local step for full-rank factors: ``local_steps`` Newton steps (module
    docstring) on minibatches without replacement (:func:`~numpyro_dppvi.pvi.local.window_batch`;
    the whole client when ``batch_size`` is None or at least its size), ``num_samples`` antithetic draws
    per step, the answer tail-averaged over the last ``average`` share of the steps. Same interface as
    :class:`~numpyro_dppvi.pvi.local.NonPrivate`.

    With minibatches the step is ``beta |B| / n_m``: a sweep of the client's data moves ``q`` about as far
    as one full-batch step, so that ``q`` barely moves within a sweep and the batches' errors cancel in
    the tail average (without replacement a sweep's batch gradients sum to the full one). At ``beta``
    itself each step answered its own batch: on a conjugate regression (4 x 225 rows, batches of 25, 40
    steps, 20 rounds) the mean ended 0.1-0.5 posterior sd from the exact one, against 0.01-0.03 scaled.
    Give minibatch fits more ``local_steps`` (several sweeps per round)."""

    family = "full_rank"  # a class attribute, not a field: the initial state's factors are [D, D]
    #: The cavity ``q / t_m`` may be improper: it enters the local objective only through ``E_q[log cavity]`` and
    #: the Newton target ``Lambda_c - E_q[grad^2 f]`` (module docstring, (*)), both defined for any symmetric
    #: ``Lambda_c``, and the step keeps ``q`` positive definite; the server still requires every new ``q`` to be
    #: proper. A non-Gaussian likelihood makes a client's factor indefinite where the other clients' data reshape
    #: the posterior (a hierarchical scale: measured on the zoo's non-centred Poisson regression, factors with
    #: eigenvalues down to -15 after round 1 and the next client's cavity improper), and requiring a proper
    #: cavity made 1 of 1 such fit raise ``FitDiverged`` in round 2.
    uses_client_cavity = False

    log_lik_rows: Callable
    dim: int
    newton: Newton
    local_steps: int
    batch_size: int | None
    num_samples: int
    average: float = 0.0

    def init_client_state(self, arrays, mask, key) -> Any:
        return ()

    def full_batch(self, mask) -> bool:
        return self.batch_size is None or self.batch_size >= mask.shape[0]

    def update(self, q, cavity, arrays, mask, n, key, client_state):
        k_order, k_steps = jax.random.split(key)
        order = None if self.full_batch(mask) else shuffled_order(k_order, mask)

        def objective(u, t):
            if order is None:
                batch, bmask = arrays, mask
            else:
                idx, bmask = window_batch(order, mask, t, self.batch_size)
                batch = take_rows(arrays, idx)
            rows = self.log_lik_rows(u, batch)
            return n * jnp.sum(jnp.where(bmask, rows, 0.0)) / jnp.maximum(jnp.sum(bmask), 1.0)

        n_valid = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
        fraction = 1.0 if order is None else jnp.minimum(self.batch_size / n_valid, 1.0)
        q_new, loss = iterate(objective, q, cavity, self.local_steps, k_steps, self.num_samples,
                              self.newton.precision_step * fraction, self.average,
                              growth=self.newton.max_precision_growth)
        return q_new, client_state, {"loss": loss / n}


@dataclass(frozen=True)
class ServerFactorStepFullRank:
    """The server's prior factor ``t_0`` for full-rank ``q`` (the data-free local step of
    :class:`~numpyro_dppvi.pvi.local.ServerFactorStep`): Newton steps (module docstring) with
    ``f(u) = log p(T(u)) + log|J(u)|`` of the sites whose prior the server holds and ``cavity_0 = q / t_0``.
    ``f`` depends only on the coordinates of ``mask``, so ``E_q[grad^2 f]`` and hence ``t_0 = q / cavity_0``
    are zero off the ``mask`` block at every step (up to rounding, which the step removes): the fixed
    points are those of global VI with a full-rank ``q``. The answer averages the second half of the
    ``steps`` iterates. No data is touched: no privacy
    cost, no communication."""

    log_density: Callable
    mask: tuple
    steps: int
    num_samples: int
    step_size: float = 0.5

    def update(self, q: Gaussian, cavity: Gaussian, key) -> Gaussian:
        if not any(self.mask):
            return q
        q_new, _ = iterate(lambda u, t: self.log_density(u), q, cavity, self.steps, key, self.num_samples,
                           self.step_size, 0.5)
        inside = jnp.asarray(self.mask, q.eta1.dtype)
        t0 = factors.divide(q_new, cavity)  # zero off the mask block up to rounding: make it exactly so
        t0 = Gaussian(t0.eta1 * inside, t0.eta2 * jnp.outer(inside, inside))
        return factors.multiply(cavity, t0)
