"""Conjugate pairs without latent variables: Beta-Bernoulli/Binomial, Dirichlet-Categorical,
Gamma-Poisson.

For these models the complete-data likelihood has no latent variables, so the E-step
is the data themselves and one full-batch VB iteration (``rho = 1``) gives the exact
posterior, which is what the tests check. Each class documents the per-example
sufficient statistic and the bound on its L2 norm that the release relies on.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.scipy.special import digamma

from numpyro_dppvi.vips.engine import ConjugateModelBase


def _as_positive(value, name: str) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}.")
    return value


def _single_array(data, name: str):
    if isinstance(data, (tuple, list)):
        if len(data) != 1:
            raise ValueError(f"{name} takes one data array (the observations), got {len(data)}.")
        data = data[0]
    return jnp.asarray(data)


class BetaBernoulli(ConjugateModelBase):
    """``p ~ Beta(a0, b0)``, ``y_i | p ~ Binomial(n, p)`` (``n = total_count``, Bernoulli if 1).

    Sufficient statistic of one example: ``s_i = [y_i, n - y_i]``; its L2 norm is at most
    ``n`` (``y^2 + (n-y)^2 <= n^2`` for ``0 <= y <= n``), the block bound.
    Posterior (M-step, Eq. 19): ``Beta(a0 + sum y_i, b0 + sum (n - y_i))``.
    Data: ``(y,)`` with ``y`` of shape ``[N]``, integers in ``[0, n]``.

    Args:
      concentration1: ``a0``, the prior's first concentration (of successes), positive. Default 1.
      concentration0: ``b0``, the prior's second concentration (of failures), positive. Default 1.
      total_count: ``n``, the number of trials of each observation, a positive integer (1: Bernoulli).
    """

    symmetric_blocks = ()

    def __init__(self, concentration1=1.0, concentration0=1.0, total_count: int = 1):
        self.concentration1 = _as_positive(concentration1, "concentration1")
        self.concentration0 = _as_positive(concentration0, "concentration0")
        if int(total_count) != total_count or total_count < 1:
            raise ValueError(f"total_count must be a positive integer, got {total_count}.")
        self.total_count = int(total_count)
        self.block_bounds = {"counts": float(self.total_count)}

    def prior_params(self):
        return {"alpha": jnp.asarray(self.concentration1), "beta": jnp.asarray(self.concentration0)}

    def expected_natural_params(self, params):
        total = digamma(params["alpha"] + params["beta"])
        return {"log_p": digamma(params["alpha"]) - total, "log_1mp": digamma(params["beta"]) - total}

    def example_ess(self, expected_natural_params, example):
        (y,) = example
        y = jnp.asarray(y, dtype=jnp.result_type(float))
        return {"counts": jnp.stack([y, self.total_count - y])}

    def m_step(self, params, ess_total):
        return {"alpha": self.concentration1 + ess_total["counts"][0],
                "beta": self.concentration0 + ess_total["counts"][1]}

    def validate_data(self, data):
        y = _single_array(data, "BetaBernoulli")
        if y.ndim != 1:
            raise ValueError(f"BetaBernoulli data must be a vector of counts [N], got shape {y.shape}.")
        y_np = np.asarray(y)
        if np.any((y_np < 0) | (y_np > self.total_count)) or np.any(y_np != np.round(y_np)):
            raise ValueError(f"BetaBernoulli observations must be integers in [0, {self.total_count}].")
        return (y,)

    def posterior_distribution(self, params):
        return dist.Beta(params["alpha"], params["beta"])

    def sample_posterior(self, params, rng_key, num_samples):
        return {"p": self.posterior_distribution(params).sample(rng_key, (num_samples,))}


class DirichletCategorical(ConjugateModelBase):
    """``p ~ Dirichlet(alpha0)``, ``y_i | p ~ Categorical(p)`` over ``K`` classes.

    Sufficient statistic: ``one_hot(y_i)``, L2 norm exactly 1 (the bound).
    Posterior: ``Dirichlet(alpha0 + counts)``. Data: ``(y,)``, integers in ``[0, K)``.

    Args:
      concentration: ``alpha0``, a vector of ``K >= 2`` positive prior concentrations (its length is the
        number of classes).
    """

    symmetric_blocks = ()

    def __init__(self, concentration):
        concentration = np.asarray(concentration, dtype=float)
        if concentration.ndim != 1 or concentration.size < 2 or np.any(concentration <= 0):
            raise ValueError("concentration must be a vector of K >= 2 positive numbers.")
        self.concentration = concentration
        self.num_classes = concentration.size
        self.block_bounds = {"counts": 1.0}

    def prior_params(self):
        return {"concentration": jnp.asarray(self.concentration)}

    def expected_natural_params(self, params):
        c = params["concentration"]
        return {"log_p": digamma(c) - digamma(jnp.sum(c))}

    def example_ess(self, expected_natural_params, example):
        (y,) = example
        return {"counts": jax.nn.one_hot(y, self.num_classes, dtype=jnp.result_type(float))}

    def m_step(self, params, ess_total):
        return {"concentration": jnp.asarray(self.concentration) + ess_total["counts"]}

    def validate_data(self, data):
        y = _single_array(data, "DirichletCategorical")
        y_np = np.asarray(y)
        if y.ndim != 1 or np.any((y_np < 0) | (y_np >= self.num_classes)) or np.any(y_np != np.round(y_np)):
            raise ValueError(
                f"DirichletCategorical data must be a vector [N] of class labels in [0, {self.num_classes}).")
        return (y.astype(jnp.int32),)

    def posterior_distribution(self, params):
        return dist.Dirichlet(params["concentration"])

    def sample_posterior(self, params, rng_key, num_samples):
        return {"p": self.posterior_distribution(params).sample(rng_key, (num_samples,))}


class GammaPoisson(ConjugateModelBase):
    """``lam ~ Gamma(a0, b0)`` (shape, rate), ``y_i | lam ~ Poisson(lam)``.

    Sufficient statistic: ``s_i = [y_i, 1]``. Counts are unbounded, so a private fit needs
    a public ``count_bound = B``: every count is first truncated, ``y <- min(y, B)`` (a
    function of the record alone), so the block norm is at most ``sqrt(B^2 + 1)``.
    Truncation biases the rate down when counts exceed ``B``: choose ``B`` from public
    knowledge of their range. ``count_bound=None`` (no truncation) runs non-privately only.
    Posterior: ``Gamma(a0 + sum y_i, b0 + N)``. Data: ``(y,)``, non-negative integers.

    Args:
      concentration: ``a0``, the prior's shape, positive. Default 1.
      rate: ``b0``, the prior's rate, positive. Default 1.
      count_bound: ``B``, the public bound to which counts are truncated, positive; required by a private fit.
        Default None (no truncation).
    """

    symmetric_blocks = ()

    def __init__(self, concentration=1.0, rate=1.0, count_bound: float | None = None):
        self.concentration = _as_positive(concentration, "concentration")
        self.rate = _as_positive(rate, "rate")
        self.count_bound = None if count_bound is None else _as_positive(count_bound, "count_bound")

    @property
    def block_bounds(self):
        """Bound on one record's ESS block: ``{"counts": sqrt(B^2 + 1)}`` with ``B = count_bound``.

        A record contributes ``(min(y, B), 1)`` (its truncated count, and one). Raises ValueError
        when ``count_bound`` is None (a private fit needs it).
        """
        if self.count_bound is None:
            raise ValueError("GammaPoisson needs count_bound for a private fit: pass the public bound on "
                             "the counts (larger counts are truncated to it).")
        return {"counts": math.sqrt(self.count_bound**2 + 1.0)}

    def prior_params(self):
        return {"concentration": jnp.asarray(self.concentration), "rate": jnp.asarray(self.rate)}

    def expected_natural_params(self, params):
        return {"lam": params["concentration"] / params["rate"],
                "log_lam": digamma(params["concentration"]) - jnp.log(params["rate"])}

    def example_ess(self, expected_natural_params, example):
        (y,) = example
        y = jnp.asarray(y, dtype=jnp.result_type(float))
        if self.count_bound is not None:
            y = jnp.minimum(y, self.count_bound)
        return {"counts": jnp.stack([y, jnp.ones_like(y)])}

    def m_step(self, params, ess_total):
        return {"concentration": self.concentration + ess_total["counts"][0],
                "rate": self.rate + ess_total["counts"][1]}

    def validate_data(self, data):
        y = _single_array(data, "GammaPoisson")
        y_np = np.asarray(y)
        if y.ndim != 1 or np.any(y_np < 0) or np.any(y_np != np.round(y_np)):
            raise ValueError("GammaPoisson data must be a vector [N] of non-negative integer counts.")
        return (y,)

    def posterior_distribution(self, params):
        return dist.Gamma(params["concentration"], params["rate"])

    def sample_posterior(self, params, rng_key, num_samples):
        return {"lam": self.posterior_distribution(params).sample(rng_key, (num_samples,))}
