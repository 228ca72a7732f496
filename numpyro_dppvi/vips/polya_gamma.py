"""Polya-Gamma variables PG(1, c): the mean used by VIPS and a series sampler.

Polson, Scott & Windle (2013), Theorem 1: for ``omega ~ PG(1, 0)``,
``exp(psi)^y / (1 + exp(psi)) = 1/2 exp((y - 1/2) psi) E[exp(-omega psi^2 / 2)]``,
which turns a Bernoulli likelihood with logit ``psi`` into a Gaussian in ``psi`` given
``omega`` (VIPS paper, Park et al. 2020, Eq. 34-35). The variational posterior of the
auxiliary variable is ``q(omega) = PG(1, c)`` with ``c^2 = E[psi^2]`` (Eq. 37, 49) and the
only quantity the E-step needs is its mean

    E[omega] = tanh(c / 2) / (2 c),        E[omega] -> 1/4 as c -> 0,

which is even in ``c``, decreasing in ``|c|`` and never above 1/4 (paper Fig. 4). That
maximum is what bounds the sensitivity of every PG-weighted sufficient statistic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PG_MEAN_MAX = 0.25
_SERIES_SWITCH = 1e-3


def polya_gamma_mean(c):
    """``E[omega]`` for ``omega ~ PG(1, c)``: ``tanh(c/2) / (2c)``, 1/4 at ``c = 0``.

    Near zero the ratio is replaced by its Taylor series ``1/4 - c^2/48 + c^4/480``
    so that the value and its gradient stay finite in float32.

    Args:
      c: the tilting parameter, an array (elementwise); only ``|c|`` matters.
    """
    c = jnp.abs(jnp.asarray(c))
    small = c < _SERIES_SWITCH
    safe_c = jnp.where(small, 1.0, c)
    exact = jnp.tanh(safe_c / 2.0) / (2.0 * safe_c)
    c2 = c * c
    series = PG_MEAN_MAX - c2 / 48.0 + c2 * c2 / 480.0
    return jnp.where(small, series, exact)


def sample_polya_gamma(rng_key, c, num_draws: int, num_terms: int = 1000):
    """Draws of ``PG(1, c)`` by its infinite-sum representation, truncated.

    ``omega = 1/(2 pi^2) sum_{k>=1} g_k / ((k - 1/2)^2 + c^2 / (4 pi^2))``, ``g_k ~ Gamma(1, 1)``
    (Polson et al. 2013, Eq. 1). Truncating after ``num_terms`` terms lowers the mean by
    at most ``1 / (2 pi^2 num_terms)`` (5e-5 for 1000 terms). Meant for tests and
    diagnostics, not for the inference loop (which only needs the mean).

    Args:
      rng_key: a ``jax.random`` key.
      c: the tilting parameter, an array (one ``PG(1, c)`` per element).
      num_draws: the number of draws of each element.
      num_terms: the terms of the sum kept. Default 1000.

    Returns:
      an array of shape ``(num_draws,) + jnp.shape(c)``.
    """
    c = jnp.asarray(c)
    k = jnp.arange(1, num_terms + 1, dtype=jnp.result_type(float))
    denominators = (k - 0.5) ** 2 + (c[..., None] ** 2) / (4.0 * jnp.pi**2)
    gammas = jax.random.exponential(rng_key, (num_draws,) + c.shape + (num_terms,))
    return jnp.sum(gammas / denominators, axis=-1) / (2.0 * jnp.pi**2)
