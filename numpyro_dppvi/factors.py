"""Mean-field Gaussian factors in natural parameters.

A factor over the flat unconstrained vector ``u`` (length ``D``) is the unnormalised density

    t(u) = exp(eta1 . u + eta2 . u**2),

so for a proper Gaussian ``N(mu, s**2)``: ``eta1 = mu / s**2`` and ``eta2 = -1 / (2 s**2)``
(Heikkila et al. 2023, §3.1; Ashman et al. 2022, eq. 3). Products and quotients of factors add and
subtract natural parameters. A PVI site factor ``t_m`` may have ``eta2 >= 0``; the posterior and every
cavity must have ``eta2 < 0`` everywhere (checked by :func:`is_proper`).

Everything here is a pure function of :class:`Gaussian` pytrees; leaves may carry leading batch
axes (e.g. ``[M, D]`` for stacked client factors).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Gaussian(NamedTuple):
    """Natural parameters of a (possibly improper) diagonal Gaussian factor."""

    eta1: jax.Array
    eta2: jax.Array


def zeros(dim: int, dtype=jnp.float32) -> Gaussian:
    """The flat factor ``t(u) = 1`` (how every client factor starts)."""
    return Gaussian(jnp.zeros(dim, dtype), jnp.zeros(dim, dtype))


def from_loc_scale(loc, scale) -> Gaussian:
    """``eta1 = loc / scale**2``, ``eta2 = -1 / (2 scale**2)``."""
    precision = 1.0 / jnp.square(scale)
    return Gaussian(loc * precision, -0.5 * precision)


def to_loc_scale(g: Gaussian) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`from_loc_scale`; only meaningful where ``eta2 < 0``."""
    precision = -2.0 * g.eta2
    return g.eta1 / precision, jnp.sqrt(1.0 / precision)


def from_loc_log_scale(params: dict) -> Gaussian:
    """From the optimiser's parametrisation ``{"loc", "log_scale"}``."""
    return from_loc_scale(params["loc"], jnp.exp(params["log_scale"]))


def to_loc_log_scale(g: Gaussian) -> dict:
    loc, scale = to_loc_scale(g)
    return {"loc": loc, "log_scale": jnp.log(scale)}


def multiply(a: Gaussian, b: Gaussian) -> Gaussian:
    """Product of factors: natural parameters add."""
    return Gaussian(a.eta1 + b.eta1, a.eta2 + b.eta2)


def divide(a: Gaussian, b: Gaussian) -> Gaussian:
    """Quotient ``a / b`` (e.g. the cavity ``q / t_m``): natural parameters subtract."""
    return Gaussian(a.eta1 - b.eta1, a.eta2 - b.eta2)


def scale(a: Gaussian, c) -> Gaussian:
    """The power ``a**c``: natural parameters times ``c``."""
    return Gaussian(a.eta1 * c, a.eta2 * c)


def damp(old: Gaussian, new: Gaussian, rho) -> Gaussian:
    """Damped update ``old + rho (new - old)`` (Heikkila et al. 2023, Algorithm 1)."""
    return Gaussian(old.eta1 + rho * (new.eta1 - old.eta1), old.eta2 + rho * (new.eta2 - old.eta2))


def product(factors: Gaussian, axis: int = 0) -> Gaussian:
    """Product over a stacked axis of factors (sum of natural parameters)."""
    return Gaussian(jnp.sum(factors.eta1, axis=axis), jnp.sum(factors.eta2, axis=axis))


def is_proper(g: Gaussian) -> jax.Array:
    """True when every coordinate has ``eta2 < 0``, all parameters are finite and so are the means
    ``-eta1 / (2 eta2)`` (finite natural parameters can overflow the mean: ``-4e36 / 0.1`` in float32)."""
    return (jnp.all(g.eta2 < 0) & jnp.all(jnp.isfinite(g.eta1)) & jnp.all(jnp.isfinite(g.eta2))
            & jnp.all(jnp.isfinite(g.eta1 / g.eta2)))


def check_proper(g: Gaussian, what: str, advice: str = "use more damping (a smaller `damping`) or fewer "
                                                          "local steps so updates stay valid") -> None:
    """Host-side check raising a ``ValueError`` that says which object is invalid, why, and ``advice``
    (in the options of the function the user called)."""
    eta1, eta2 = np.asarray(g.eta1), np.asarray(g.eta2)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        finite = np.all(np.isfinite(eta1)) and np.all(np.isfinite(eta2)) and np.all(np.isfinite(eta1 / eta2))
    if not finite:
        raise ValueError(f"{what} has non-finite natural parameters or means: {advice}.")
    bad = np.flatnonzero(np.reshape(eta2 >= 0, -1))
    if bad.size:
        raise ValueError(
            f"{what} is not a proper Gaussian: eta2 >= 0 (non-positive precision) at "
            f"{bad.size} coordinate(s), first index {int(bad[0])}: {advice}."
        )


def expected_log_factor(loc, scale_, g: Gaussian) -> jax.Array:
    """``E_{N(loc, scale**2)}[log t(u)] = eta1 . loc + eta2 . (loc**2 + scale**2)`` summed over coordinates.

    ``t`` may be improper or flat (all zeros): this is the data-free part of the local objective,
    which equals ``-KL(q || t) - H[q]`` up to ``t``'s log normaliser when ``t`` is proper.
    """
    return jnp.sum(g.eta1 * loc + g.eta2 * (jnp.square(loc) + jnp.square(scale_)))


def entropy(scale_) -> jax.Array:
    """Entropy of a diagonal Gaussian: ``sum_d (0.5 log(2 pi e) + log s_d)``."""
    return jnp.sum(0.5 * jnp.log(2 * jnp.pi * jnp.e) + jnp.log(scale_))


def kl(q: Gaussian, p: Gaussian) -> jax.Array:
    """Analytic ``KL(q || p)`` of proper diagonal Gaussians, summed over coordinates:

    ``sum_d log(s_p/s_q) + (s_q^2 + (mu_q - mu_p)^2) / (2 s_p^2) - 1/2``.
    """
    mq, sq = to_loc_scale(q)
    mp, sp = to_loc_scale(p)
    return jnp.sum(jnp.log(sp / sq) + (jnp.square(sq) + jnp.square(mq - mp)) / (2 * jnp.square(sp)) - 0.5)
