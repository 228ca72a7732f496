"""Held-out evaluation of a Gaussian posterior ``q`` over the unconstrained latents.

Mean log predictive density ``(1/n) sum_i log (1/S) sum_s p(y_i | x_i, theta_s)``, ``theta_s = T(u_s)``,
``u_s ~ q``; for models whose observations are Bernoulli, accuracy is the fraction of rows whose
observed label has predictive probability above 1/2.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from . import factors
from .program_cache import jitted


@jitted(static_argnums=(0, 4))
def _log_predictive(log_lik_rows, q, arrays, key, num_samples):
    u = factors.draws(q, jax.random.normal(key, (num_samples,) + q.eta1.shape))
    ll = jax.lax.map(lambda u_s: log_lik_rows(u_s, arrays), u)  # [S, n]
    return jax.scipy.special.logsumexp(ll, axis=0) - jnp.log(num_samples)


def log_predictive_density(adapter, q, arrays, key, num_samples: int = 100) -> np.ndarray:
    """Per-row ``log (1/S) sum_s p(x_i | theta_s)``, ``theta_s = T(u_s)``, ``u_s ~ q``: ``[n]``."""
    return np.asarray(_log_predictive(adapter.log_lik_rows, q, tuple(arrays), key, int(num_samples)))


def evaluate(adapter, q, arrays, key, num_samples: int = 100) -> dict:
    """``{"log_lik": mean log predictive density, "accuracy": ... (Bernoulli models)}`` on ``arrays``."""
    lpd = log_predictive_density(adapter, q, arrays, key, num_samples)
    out = {"log_lik": float(np.mean(lpd))}
    if adapter.bernoulli_observed:
        out["accuracy"] = float(np.mean(lpd > np.log(0.5)))
    return out
