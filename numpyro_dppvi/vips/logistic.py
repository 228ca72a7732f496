"""Bayesian logistic regression through Polya-Gamma augmentation (VIPS paper §5-6).

Model (Eq. 43): ``y_i | x_i, w ~ Bernoulli(sigmoid(x_i^T w))`` with either a fixed Gaussian
prior ``w ~ N(m0, Lambda0^-1)`` or the paper's hierarchical prior
``w | alpha ~ N(0, alpha^-1 I)``, ``alpha ~ Gamma(a0, b0)``.

With ``omega_i ~ PG(1, 0)`` the likelihood given ``omega_i`` is Gaussian in ``w`` (Eq. 45):
``exp((y_i - 1/2) x_i^T w - omega_i (x_i^T w)^2 / 2)``. Natural parameters ``[w, -ww^T/2]``,
sufficient statistics (Eq. 47, 50)

    s1_i = (y_i - 1/2) x_i,        s2_i = E[omega_i] x_i x_i^T,
    E[omega_i] = tanh(c_i/2)/(2 c_i),  c_i^2 = x_i^T E[w w^T] x_i           (Eq. 49).

M-step (Eq. 51-54): ``Lambda = E[alpha] I + sum s2``, ``Lambda mu = sum s1``; then
``q(alpha) = Gamma(a0 + D/2, b0 + (mu^T mu + tr Sigma)/2)`` (Eq. 53).

Sensitivity (Eq. 57, 59, for the sums this package releases): records are mapped into
``|x| <= B`` (``feature_bound``), so ``|s1_i| <= B/2`` and, because ``E[omega] <= 1/4``,
``|s2_i|_F = E[omega_i] |x_i|^2 <= B^2/4``. The noisy ``s2`` sum gets symmetric noise and is
projected onto the PSD cone (negative eigenvalues set to a small positive value).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist

from numpyro_dppvi.vips.engine import ConjugateModelBase
from numpyro_dppvi.vips.linear import (
    _BoundedXY, _prior_mean, _validate_xy, as_precision_matrix, gaussian_moments, project_to_ball)
from numpyro_dppvi.vips.polya_gamma import PG_MEAN_MAX, polya_gamma_mean
from numpyro_dppvi.privacy.mechanisms import project_psd


class PolyaGammaLogisticRegression(_BoundedXY, ConjugateModelBase):
    """Logistic regression for VIPS; see the module docstring for the formulas.

    Args:
        num_features: ``D`` (include a column of ones in ``x`` for an intercept).
        prior_mean: the fixed Gaussian prior's mean, a scalar or a ``[D]`` vector (default 0; ignored with
            ``hyperprior``, whose prior mean is 0).
        prior_precision: the fixed Gaussian prior's precision, a scalar, a ``[D]`` vector (diagonal) or a
            ``[D, D]`` positive-definite matrix (default 1; ignored with ``hyperprior``).
        hyperprior: ``(a0, b0)`` for ``alpha ~ Gamma(a0, b0)`` on the weight precision
            (the paper uses ``(1, 1)``); ``None`` for the fixed prior.
        feature_bound: public ``B`` with records projected into ``|x| <= B``; required for a
            private fit (the paper scales inputs so that ``B = 1``).

    Data: ``(x [N, D], y [N])`` with ``y`` in ``{0, 1}``.
    """

    symmetric_blocks = ("s2",)

    def __init__(self, num_features: int, prior_mean=0.0, prior_precision=1.0, hyperprior=None,
                 feature_bound=None):
        if int(num_features) < 1:
            raise ValueError("num_features must be a positive integer.")
        self.dim = int(num_features)
        if hyperprior is not None:
            a0, b0 = (float(v) for v in hyperprior)
            if not (a0 > 0 and b0 > 0):
                raise ValueError(f"hyperprior (a0, b0) must be positive, got {hyperprior}.")
            self.hyperprior = (a0, b0)
            self.prior_mean = np.zeros(self.dim)
            self.prior_precision = None
        else:
            self.hyperprior = None
            self.prior_mean = _prior_mean(prior_mean, self.dim)
            self.prior_precision = as_precision_matrix(prior_precision, self.dim)
        self._init_bounds(feature_bound, 1.0)

    @property
    def block_bounds(self):
        """Bounds on one record's ESS blocks: ``{"s1": B/2, "s2": B^2/4}`` with ``B = feature_bound``.

        ``|s1_i| = |x_i|/2`` and ``|s2_i|_F = E[omega_i] |x_i|^2`` with ``E[omega] <= 1/4``
        (the module docstring's sensitivity). Raises ValueError when ``feature_bound`` is None
        (a private fit needs it).
        """
        if self.feature_bound is None:
            raise ValueError("PolyaGammaLogisticRegression needs feature_bound for a private fit: "
                             "pass the public bound B on |x| (records are projected into |x| <= B).")
        return {"s1": 0.5 * self.feature_bound, "s2": PG_MEAN_MAX * self.feature_bound**2}

    def _prior_natural(self, params):
        if self.hyperprior is None:
            return (jnp.asarray(self.prior_precision @ self.prior_mean), jnp.asarray(self.prior_precision))
        expected_alpha = params["alpha_a"] / params["alpha_b"]
        eye = jnp.eye(self.dim, dtype=jnp.result_type(float))
        return jnp.zeros(self.dim, dtype=eye.dtype), expected_alpha * eye

    def prior_params(self):
        if self.hyperprior is None:
            eta, precision = self._prior_natural(None)
            return {"eta": eta, "precision": precision}
        a0, b0 = self.hyperprior
        params = {"alpha_a": jnp.asarray(a0), "alpha_b": jnp.asarray(b0)}
        eta, precision = self._prior_natural(params)
        return {"eta": eta, "precision": precision, **params}

    def expected_natural_params(self, params):
        """``[E[w], E[w w^T]]`` (Eq. 55; the ``-1/2`` factor is applied where used)."""
        mean, cov = gaussian_moments(params["eta"], params["precision"])
        return {"mean": mean, "second_moment": cov + jnp.outer(mean, mean)}

    def _bounded_x(self, x):
        return x if self.feature_bound is None else project_to_ball(x, self.feature_bound)

    def example_ess(self, expected_natural_params, example):
        x, y = example
        x = self._bounded_x(x)
        c = jnp.sqrt(jnp.maximum(x @ expected_natural_params["second_moment"] @ x, 0.0))
        omega = polya_gamma_mean(c)
        return {"s1": (y - 0.5) * x, "s2": omega * jnp.outer(x, x)}

    def m_step(self, params, ess_total):
        eta0, precision0 = self._prior_natural(params)
        return {**params, "eta": eta0 + ess_total["s1"], "precision": precision0 + ess_total["s2"]}

    def refresh(self, params):
        """Hyperprior update, Eq. 53: ``a0 + D/2``, ``b0 + (mu^T mu + tr Sigma)/2``."""
        if self.hyperprior is None:
            return params
        a0, b0 = self.hyperprior
        mean, cov = gaussian_moments(params["eta"], params["precision"])
        return {**params, "alpha_a": jnp.asarray(a0 + 0.5 * self.dim, dtype=mean.dtype),
                "alpha_b": b0 + 0.5 * (mean @ mean + jnp.trace(cov))}

    def postprocess_noisy_ess(self, ess_total):
        return {**ess_total, "s2": project_psd(ess_total["s2"], 0.0)}

    def validate_data(self, data):
        x, y = _validate_xy(data, self.dim, type(self).__name__)
        if not np.all(np.isin(np.asarray(y), (0, 1))):
            raise ValueError("PolyaGammaLogisticRegression: y must contain only 0 and 1.")
        return x, y.astype(x.dtype)

    def posterior_distribution(self, params):
        mean, cov = gaussian_moments(params["eta"], params["precision"])
        return dist.MultivariateNormal(mean, covariance_matrix=cov)

    def sample_posterior(self, params, rng_key, num_samples):
        key_w, key_alpha = jax.random.split(rng_key)
        out = {"w": self.posterior_distribution(params).sample(key_w, (num_samples,))}
        if self.hyperprior is not None:
            out["alpha"] = dist.Gamma(params["alpha_a"], params["alpha_b"]).sample(key_alpha, (num_samples,))
        return out

    def predict_proba(self, params, x):
        """``P(y = 1 | x) = E_q[sigmoid(x^T w)]`` by the probit approximation
        ``sigmoid(m / sqrt(1 + pi v / 8))`` with ``m, v`` the mean and variance of ``x^T w``."""
        mean, cov = gaussian_moments(params["eta"], params["precision"])
        x = self._bounded_x(jnp.asarray(x, dtype=mean.dtype))
        m = x @ mean
        v = jnp.einsum("nd,de,ne->n", x, cov, x)
        return jax.nn.sigmoid(m / jnp.sqrt(1.0 + jnp.pi * v / 8.0))
