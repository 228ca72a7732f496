"""Bayesian linear regression as a conjugate-exponential model (known or unknown noise).

Both models have no latent variables: the ESS are the data's second moments and one
full-batch iteration with ``rho = 1`` is the exact posterior.

Bounds. The release needs a bound on each example's statistics. With
``feature_bound = B_x`` and ``target_bound = B_y`` every record is first mapped into the
bounded domain (``x <- x min(1, B_x/|x|)``, ``y <- clip(y, -B_y, B_y)``: a function of the
record alone), so that ``|x y| <= B_x B_y`` and ``|x x^T|_F = |x|^2 <= B_x^2``. Without
bounds the models run non-privately only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist

from numpyro_dppvi.vips.engine import ConjugateModelBase
from numpyro_dppvi.privacy.mechanisms import project_psd


def project_to_ball(x, radius):
    """``x min(1, radius/|x|)`` along the last axis (no change inside the ball)."""
    norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
    return x * jnp.minimum(1.0, radius / jnp.maximum(norm, 1e-30))


def as_precision_matrix(precision, dim: int) -> np.ndarray:
    """A scalar, a vector (diagonal) or a ``[D, D]`` matrix as a positive-definite matrix."""
    precision = np.asarray(precision, dtype=float)
    if precision.ndim == 0:
        precision = np.full(dim, float(precision))
    if precision.ndim == 1:
        if precision.shape != (dim,):
            raise ValueError(f"prior precision vector must have length {dim}, got {precision.shape}.")
        precision = np.diag(precision)
    if precision.shape != (dim, dim):
        raise ValueError(f"prior precision must be a scalar, a [{dim}] vector or [{dim}, {dim}].")
    if not np.allclose(precision, precision.T) or np.linalg.eigvalsh(precision).min() <= 0:
        raise ValueError("prior precision must be symmetric positive definite.")
    return precision


def _prior_mean(mean, dim: int) -> np.ndarray:
    mean = np.broadcast_to(np.asarray(mean, dtype=float), (dim,))
    return np.array(mean)


def _validate_xy(data, dim: int, name: str):
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise ValueError(f"{name} data must be a tuple (x [N, {dim}], y [N]).")
    x, y = (jnp.asarray(a) for a in data)
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"{name}: x must have shape [N, {dim}], got {x.shape}.")
    if y.shape != (x.shape[0],):
        raise ValueError(f"{name}: y must have shape [{x.shape[0]}], got {y.shape}.")
    return x, y


def gaussian_moments(eta, precision):
    """Mean and covariance from natural parameters ``(Lambda mu, Lambda)``."""
    chol = jnp.linalg.cholesky(precision)
    cov = jax.scipy.linalg.cho_solve((chol, True), jnp.eye(precision.shape[-1], dtype=precision.dtype))
    mean = cov @ eta
    return mean, 0.5 * (cov + cov.T)


def curvature_noise_covariance(mean, precision, variance):
    """``Lambda^-1 Cov(E m) Lambda^-1`` with ``Cov(E m) = variance (|m|^2 I + m m^T - diag(m o m))``: the first-order
    covariance of ``Lambda^-1 E m`` for a symmetric ``E`` whose upper triangle (diagonal included) is iid ``N(0,
    variance)`` (:meth:`BayesianLinearRegression.noise_aware_params`)."""
    mean = jnp.asarray(mean)
    square = mean * mean
    moved = variance * (jnp.sum(square) * jnp.eye(mean.shape[-1], dtype=mean.dtype) + jnp.outer(mean, mean)
                        - jnp.diag(square))
    inverse = jnp.linalg.inv(precision)
    inverse = 0.5 * (inverse + inverse.T)
    return inverse @ moved @ inverse


class _BoundedXY:
    """Record projection and block bounds shared by the two regression models."""

    feature_bound: float | None
    target_bound: float | None

    def _init_bounds(self, feature_bound, target_bound):
        for name, value in (("feature_bound", feature_bound), ("target_bound", target_bound)):
            if value is not None and not (float(value) > 0 and math.isfinite(float(value))):
                raise ValueError(f"{name} must be positive and finite (or None), got {value}.")
        self.feature_bound = None if feature_bound is None else float(feature_bound)
        self.target_bound = None if target_bound is None else float(target_bound)

    def _require_bounds(self):
        if self.feature_bound is None or self.target_bound is None:
            raise ValueError(
                f"{type(self).__name__} needs feature_bound and target_bound for a private fit: "
                "pass the public bounds on |x| and |y| when building the model.")

    def _bounded_record(self, x, y):
        if self.feature_bound is not None:
            x = project_to_ball(x, self.feature_bound)
        if self.target_bound is not None:
            y = jnp.clip(y, -self.target_bound, self.target_bound)
        return x, y


class BayesianLinearRegression(_BoundedXY, ConjugateModelBase):
    """``w ~ N(m0, Lambda0^-1)``, ``y_i | x_i, w ~ N(x_i^T w, s^2)`` with known ``s``.

    ESS of one example: ``xy = x y / s^2`` (bound ``B_x B_y / s^2``) and
    ``xx = x x^T / s^2`` (bound ``B_x^2 / s^2``, symmetric). Posterior:
    ``Lambda = Lambda0 + sum xx``, ``Lambda mu = Lambda0 m0 + sum xy``.
    Data: ``(x [N, D], y [N])``.
    """

    symmetric_blocks = ("xx",)

    def __init__(self, num_features: int, noise_scale: float, prior_mean=0.0, prior_precision=1.0,
                 feature_bound=None, target_bound=None):
        if int(num_features) < 1:
            raise ValueError("num_features must be a positive integer.")
        self.dim = int(num_features)
        if not float(noise_scale) > 0:
            raise ValueError(f"noise_scale must be positive, got {noise_scale}.")
        self.noise_scale = float(noise_scale)
        self.prior_mean = _prior_mean(prior_mean, self.dim)
        self.prior_precision = as_precision_matrix(prior_precision, self.dim)
        self._init_bounds(feature_bound, target_bound)

    @property
    def block_bounds(self):
        self._require_bounds()
        s2 = self.noise_scale**2
        return {"xy": self.feature_bound * self.target_bound / s2, "xx": self.feature_bound**2 / s2}

    def prior_params(self):
        return {"eta": jnp.asarray(self.prior_precision @ self.prior_mean),
                "precision": jnp.asarray(self.prior_precision)}

    def expected_natural_params(self, params):
        mean, cov = gaussian_moments(params["eta"], params["precision"])
        return {"mean": mean, "second_moment": cov + jnp.outer(mean, mean)}

    def example_ess(self, expected_natural_params, example):
        x, y = self._bounded_record(*example)
        s2 = self.noise_scale**2
        return {"xy": x * y / s2, "xx": jnp.outer(x, x) / s2}

    def m_step(self, params, ess_total):
        prior = self.prior_params()
        return {"eta": prior["eta"] + ess_total["xy"],
                "precision": prior["precision"] + ess_total["xx"]}

    def postprocess_noisy_ess(self, ess_total):
        return {**ess_total, "xx": project_psd(ess_total["xx"], 0.0)}

    def noise_aware_params(self, params, noise_variance: dict):
        """The posterior that accounts for the release noise left in ``params`` (Bernstein & Sheldon 2019 in the
        Gaussian approximation, to first order in the noise of the second moment). The data part of the fit is
        ``h = eta - Lambda0 m0`` (estimating ``X^T y / s^2``) and ``B = Lambda - Lambda0`` (estimating ``X^T X / s^2``).

        * Noise in ``h``: given ``w``, ``X^T y / s^2 ~ N(B w, B)``; the release adds noise of covariance ``V =
          noise_variance["xy"] I``, so ``h | w ~ N(B w, B + V)`` and the factor of ``w`` is ``(B (B + V)^-1 h,
          B (B + V)^-1 B)`` (:func:`numpyro_dppvi.pvi.noise_aware.noisy_observation_factor`).
        * Noise in ``B``: the released ``B~ = B + E``, ``E`` symmetric with its upper triangle iid ``N(0, v)``,
          ``v = noise_variance["xx"]`` (:func:`~numpyro_dppvi.privacy.mechanisms.add_symmetric_noise`). The mean
          ``m = Lambda~^-1 (Lambda0 m0 + h)`` moves by ``-Lambda~^-1 E m`` to first order, and ``Cov(E m) = v
          (|m|^2 I + m m^T - diag(m o m))`` (row ``i`` of ``E m`` sums ``v m_j^2``; rows ``i != k`` share the one
          entry ``E_ik``). Its covariance ``Lambda~^-1 Cov(E m) Lambda~^-1`` (``Lambda~``: the fitted precision,
          ``m``: the noise-aware mean) is added to the posterior's; the mean is kept.

        First order: where the noise in ``B`` is comparable to ``B`` itself (epsilon 1 with 2,000 rows in
        ``benchmarks/coverage.py``) the per-step projection onto the positive semi-definite cone biases ``B~``
        upwards and this under-states the error. Post-processing of the released parameters and the public noise
        variances: no privacy cost, no unreleased value used."""
        from ..pvi.noise_aware import noisy_observation_factor

        prior = self.prior_params()
        fitted = params["precision"]
        h, b = params["eta"] - prior["eta"], fitted - prior["precision"]
        noise = noise_variance["xy"] * jnp.eye(self.dim, dtype=b.dtype)
        h, b = noisy_observation_factor(h, b, noise)
        precision = prior["precision"] + b
        mean, covariance = gaussian_moments(prior["eta"] + h, precision)
        covariance = covariance + curvature_noise_covariance(mean, fitted, noise_variance["xx"])
        precision = jnp.linalg.inv(0.5 * (covariance + covariance.T))
        precision = 0.5 * (precision + precision.T)
        return {"eta": precision @ mean, "precision": precision}

    def validate_data(self, data):
        return _validate_xy(data, self.dim, type(self).__name__)

    def posterior_distribution(self, params):
        mean, cov = gaussian_moments(params["eta"], params["precision"])
        return dist.MultivariateNormal(mean, covariance_matrix=cov)

    def sample_posterior(self, params, rng_key, num_samples):
        return {"w": self.posterior_distribution(params).sample(rng_key, (num_samples,))}

    def predict_mean(self, params, x):
        mean, _ = gaussian_moments(params["eta"], params["precision"])
        if self.feature_bound is not None:
            x = project_to_ball(jnp.asarray(x), self.feature_bound)
        return jnp.asarray(x) @ mean


class NormalGammaLinearRegression(_BoundedXY, ConjugateModelBase):
    """Unknown noise: ``tau ~ Gamma(a0, b0)``, ``w | tau ~ N(m0, (tau Lambda0)^-1)``,
    ``y_i ~ N(x_i^T w, 1/tau)``.

    The Normal-Gamma posterior is exact. In natural parameters, linear in the data:
    ``Lambda = Lambda0 + sum x x^T``, ``Lambda m = Lambda0 m0 + sum x y``,
    ``c = b + m^T Lambda m / 2 = b0 + m0^T Lambda0 m0 / 2 + sum y^2 / 2``, ``a = a0 + N/2``.
    ESS of one example: ``xy`` (bound ``B_x B_y``), ``xx`` (``B_x^2``, symmetric) and
    ``y2_count = [y^2, 1]`` (bound ``sqrt(B_y^4 + 1)``; it carries the count so that ``N``
    itself is released with noise under add/remove).
    """

    symmetric_blocks = ("xx",)

    def __init__(self, num_features: int, prior_mean=0.0, prior_precision=1.0,
                 noise_concentration=1.0, noise_rate=1.0, feature_bound=None, target_bound=None):
        if int(num_features) < 1:
            raise ValueError("num_features must be a positive integer.")
        self.dim = int(num_features)
        self.prior_mean = _prior_mean(prior_mean, self.dim)
        self.prior_precision = as_precision_matrix(prior_precision, self.dim)
        if not (noise_concentration > 0 and noise_rate > 0):
            raise ValueError("noise_concentration and noise_rate must be positive.")
        self.noise_concentration = float(noise_concentration)
        self.noise_rate = float(noise_rate)
        self._init_bounds(feature_bound, target_bound)

    @property
    def block_bounds(self):
        self._require_bounds()
        return {"xy": self.feature_bound * self.target_bound, "xx": self.feature_bound**2,
                "y2_count": math.sqrt(self.target_bound**4 + 1.0)}

    def prior_params(self):
        m0, l0 = self.prior_mean, self.prior_precision
        return {"eta": jnp.asarray(l0 @ m0), "precision": jnp.asarray(l0),
                "a": jnp.asarray(self.noise_concentration),
                "c": jnp.asarray(self.noise_rate + 0.5 * m0 @ l0 @ m0)}

    def noise_rate_posterior(self, params):
        """``b = c - eta^T Lambda^-1 eta / 2`` (floored at a tiny positive value after noise)."""
        mean, _ = gaussian_moments(params["eta"], params["precision"])
        b = params["c"] - 0.5 * params["eta"] @ mean
        return jnp.maximum(b, 1e-6)

    def expected_natural_params(self, params):
        mean, cov = gaussian_moments(params["eta"], params["precision"])
        b = self.noise_rate_posterior(params)
        return {"mean": mean, "tau": params["a"] / b}

    def example_ess(self, expected_natural_params, example):
        x, y = self._bounded_record(*example)
        return {"xy": x * y, "xx": jnp.outer(x, x), "y2_count": jnp.stack([y * y, jnp.ones_like(y)])}

    def m_step(self, params, ess_total):
        prior = self.prior_params()
        return {"eta": prior["eta"] + ess_total["xy"],
                "precision": prior["precision"] + ess_total["xx"],
                "a": prior["a"] + 0.5 * ess_total["y2_count"][1],
                "c": prior["c"] + 0.5 * ess_total["y2_count"][0]}

    def postprocess_noisy_ess(self, ess_total):
        return {**ess_total, "xx": project_psd(ess_total["xx"], 0.0),
                "y2_count": jnp.maximum(ess_total["y2_count"], 0.0)}

    def validate_data(self, data):
        return _validate_xy(data, self.dim, type(self).__name__)

    def sample_posterior(self, params, rng_key, num_samples):
        key_tau, key_w = jax.random.split(rng_key)
        mean, cov = gaussian_moments(params["eta"], params["precision"])
        tau = dist.Gamma(params["a"], self.noise_rate_posterior(params)).sample(key_tau, (num_samples,))
        chol = jnp.linalg.cholesky(cov)
        z = jax.random.normal(key_w, (num_samples, self.dim), dtype=mean.dtype)
        w = mean + (z @ chol.T) / jnp.sqrt(tau)[:, None]
        return {"w": w, "noise_precision": tau}

    def predict_mean(self, params, x):
        mean, _ = gaussian_moments(params["eta"], params["precision"])
        if self.feature_bound is not None:
            x = project_to_ball(jnp.asarray(x), self.feature_bound)
        return jnp.asarray(x) @ mean
