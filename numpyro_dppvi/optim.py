"""Optimisers for the local steps: optax ``GradientTransformation`` objects on the parameters
``{"loc": mu, "log_scale": log s}`` of a mean-field Gaussian ``q``.

``cvi`` (the default of non-private PVI) takes the conjugate-computation step of Khan & Lin (2017)
for the precision and an Adam step, in units of ``q``'s own sds, for the mean; see :func:`cvi`.

``natural_gradient`` preconditions the gradient of a mean-field Gaussian's parameters
``{"loc": mu, "log_scale": log s}`` by the inverse Fisher information ``diag(s^2, 1/2)``:

    mu <- mu - lr * s^2 * dL/dmu,        log s <- log s - lr * (dL/dlog s) / 2.

For the PVI local objective this is a Newton-like step whose size follows each coordinate's
curvature. It matters for many small virtual clients (one row each): Adam normalises every
coordinate's step to about its learning rate, so a sum of thousands of tiny updates turns into a sum
of signs, while the natural gradient moves each virtual client by what its likelihood asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

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



class CVIState(NamedTuple):
    """State of :func:`cvi`: the sds the update started from, and the mean optimiser's state."""

    start_scale: Any
    mean: Any


def cvi(precision_step: float = 0.5, mean_optimizer: optax.GradientTransformation | None = None,
        max_precision_growth: float = 10.0) -> optax.GradientTransformationExtraArgs:
    """Local steps for a mean-field Gaussian ``q = N(mu, diag(s^2))``: a conjugate-computation
    (natural-gradient) step for the precisions and ``mean_optimizer`` (default ``optax.adam(0.1)``)
    for the means, measured in sds of the ``q`` the update started from.

    The objective ``L(q) = E_q[f] + E_q[log cavity] + H[q]`` (PVI's local objective, eq. 2 of
    Heikkila et al. 2023) has, by Stein's lemma, the gradient in ``log s``

        g_r = dL/dlog s = s^2 (E_q[f''] + 2 eta2_cavity) + 1 = 1 - s^2 T,
        T = P_cavity - E_q[f'']   (the precision of the optimum: ``g_r = 0`` iff ``1/s^2 = T``),

    so the reparameterised gradient already holds the target precision ``T = P (1 - g_r)``,
    ``P = 1/s^2``. The precision moves a fraction ``beta`` (``precision_step``) of the way:

        P_new = P + beta (T - P) = P (1 - beta g_r)                      (T > 0),
        P_new = P (1 - beta g_r + beta^2 g_r^2 / 2)                      (T <= 0, g_r >= 1),

    the conjugate-computation VI step in natural parameters (Khan & Lin 2017, eq. 12), with the
    second-order term of Lin, Schmidt & Khan (2020) where the target is not positive, which keeps
    ``P_new >= P / 2`` for ``beta <= 1/2`` (in ``(mu, log s)`` the first-order step ``log s += beta
    g_r / 2``, :func:`natural_gradient`, overshoots by many orders of magnitude when ``q`` is much
    wider than its optimum, ``g_r ~ -n``). Fixed points: ``g_r = 0``, those of ``L``. Unlike Adam on
    ``log s``, whose steps are about its learning rate whatever the gradient, the step follows the
    curvature: a prior of sd 1 reaches a posterior of sd 0.01 in a few steps instead of hundreds.

    A step multiplies a precision by at most ``c`` (``max_precision_growth``)::

        P_new = min(P (1 - beta g_r), c P),

    a trust region of ``(c - 1 - log c) / 2`` nats per coordinate (3.35 at ``c = 10``) that leaves the fixed
    points unchanged (there the factor is 1). Without it one step can set a precision to half of a target
    estimated in ``q``'s tails: where the likelihood's curvature grows without bound (a Weibull shape ``k``,
    whose curvature grows like ``(t / scale)^k``), ``E_q[f'']`` under a prior-wide ``q`` is dominated by
    the draws with the largest ``k``. Measured on the calibration zoo's censored Weibull regression (20 data
    sets x 3 keys): a first client's precision of ``log k`` jumped from 2.5 to 7e9 in one step, the
    second-order rule then shrinks it by only 0.625 a step, 20 steps left it near 1e9, and 13 of the 60 fits
    raised ``FitDiverged`` in round 2; none with ``c = 10``. A prior of sd 1 still reaches a posterior of sd
    0.01 (``P`` times 1e4) in four steps.

    The means are moved by ``mean_optimizer`` on ``z = (mu - mu_0) / s_0``, ``s_0`` the sds at
    ``init`` (every PVI local update starts afresh from the current ``q``): Adam's steps of about its
    learning rate are then a fixed fraction of the posterior's width on every coordinate, whatever
    the data size (on ``mu`` itself ``adam(1e-2)`` jumps a posterior sd per step on a client of 4,000
    rows); Adam's momentum, not a diagonal Newton step, crosses the ridges of correlated posteriors
    (measured on a GLMM with an LKJ prior: 0.2-0.4 NUTS sd from NUTS against 2-4 for a diagonal
    natural-gradient step on the means).

    The gradients handed to ``update`` are of ``-L / objective_scale`` (the local objectives are
    divided by the client's size, :mod:`~numpyro_dppvi.objectives`); the local loop passes
    ``objective_scale`` (:func:`~numpyro_dppvi.pvi.local.optimise`). The curvature comes from the
    Monte Carlo gradient of ``log s``: use it with antithetic draws (PVI's non-private local step
    does), and never on privatised gradients, whose noise would be read as curvature.
    """
    if not 0.0 < precision_step <= 0.5:
        raise ValueError(f"precision_step must lie in (0, 0.5] (larger steps can halve a precision at once), "
                         f"got {precision_step}")
    if not max_precision_growth > 1.0:
        raise ValueError(f"max_precision_growth must be > 1 (the factor a step may multiply a precision by), "
                         f"got {max_precision_growth}")
    beta, growth = float(precision_step), float(max_precision_growth)
    mean_optimizer = optax.adam(0.1) if mean_optimizer is None else mean_optimizer

    def init(params):
        if "log_scale" not in params:
            raise ValueError("optim.cvi takes the (loc, log_scale) of a mean-field q; a full-rank q "
                             "(family='full_rank') under DP optimisation takes an optax optimizer such as optax.adam")
        return CVIState(jnp.exp(params["log_scale"]), mean_optimizer.init(params["loc"]))

    def update(grads, state, params=None, *, objective_scale=1.0, **extra):
        if params is None:
            raise ValueError("cvi needs the current params: optimizer.update(grads, state, params)")
        g_r = -objective_scale * grads["log_scale"]
        factor = jnp.minimum(1.0 - beta * g_r + jnp.where(g_r >= 1.0, 0.5 * jnp.square(beta * g_r), 0.0), growth)
        step, mean_state = mean_optimizer.update(grads["loc"] * state.start_scale, state.mean)
        return ({"loc": step * state.start_scale, "log_scale": -0.5 * jnp.log(factor)},
                CVIState(state.start_scale, mean_state))

    return optax.GradientTransformationExtraArgs(init, update)



@dataclass(frozen=True)
class Newton:
    """The local steps of full-rank factors (``family="full_rank"``): natural-gradient (Newton) steps
    with exact expected Hessians, moving the precision a fraction ``precision_step`` (``beta`` in (0, 1/2])
    of the way to its target and the mean by ``beta`` times a Newton step inside a one-sd trust region
    (:mod:`numpyro_dppvi.pvi.full_rank`). Not an optax transformation: the step needs the Hessian of
    the expected log-likelihood, which the optax interface (gradients only) does not carry.

    ``max_precision_growth`` (``c``): a step multiplies the precision by at most ``c`` in every direction (the
    largest eigenvalue of ``Lambda^{-1} Lambda'``; a longer step is shortened along the segment from
    ``Lambda`` to ``Lambda'``, which keeps it positive definite), as :func:`cvi` does per coordinate and for the
    same reason: a target precision read in the tails of a prior-wide ``q``. Measured on the calibration zoo's
    10-group hierarchical Poisson regression (``benchmarks/calibration_zoo.py``, three data sets, damping 0.5):
    one of three fits raised ``FitDiverged`` without it, none with it; on 20 other data sets of that model 6 still
    raised at damping 0.5 and 2 at 0.25, from cavities ``q / t_m`` that are not positive definite where the
    likelihood is not log-concave (the reason full-rank is not non-private PVI's default there)."""

    precision_step: float = 0.5
    max_precision_growth: float = 10.0

    def __post_init__(self):
        if not 0.0 < self.precision_step <= 0.5:
            raise ValueError(f"precision_step must lie in (0, 0.5] (the mean's Newton step then never "
                             f"overshoots), got {self.precision_step}")
        if not self.max_precision_growth > 1.0:
            raise ValueError(f"max_precision_growth must be > 1 (the factor a step may multiply the precision by), "
                             f"got {self.max_precision_growth}")


@dataclass(frozen=True)
class PrivateNewton:
    """The local steps of DP optimisation by default (``family`` mean-field or full-rank): every step moves ``q``
    a fraction ``step`` of the way (in natural parameters) to the Newton answer of the client's likelihood factor
    estimated from its releases so far (:mod:`numpyro_dppvi.pvi.noise_aware`): the information and curvature of
    every step are averaged, so the steps follow the running estimate rather than each step's noise, and a
    target that is not a proper Gaussian is not taken (the coordinate, or a full-rank ``q``, stays). Not an optax
    transformation: the step reads the releases' curvature, which gradients do not carry. Post-processing of the
    releases, as every optimiser step of DP-SGD."""

    step: float = 0.5

    def __post_init__(self):
        if not 0.0 < self.step <= 1.0:
            raise ValueError(f"step must lie in (0, 1], got {self.step}")
