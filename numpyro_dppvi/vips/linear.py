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


#: Monte Carlo draws of the second moment in :func:`second_moment_mixture`.
MIXTURE_DRAWS = 2000


def second_moment_mixture(h, b, prior_eta, prior_precision, xy_variance, xx_variance, draws: int = MIXTURE_DRAWS):
    """``(mean, covariance)`` of the posterior of ``w`` from the released ``h~`` (noise variance ``xy_variance``
    per coordinate) and ``B~`` (symmetric noise, upper triangle of variance ``xx_variance``), by importance
    sampling over ``B`` (:meth:`BayesianLinearRegression.noise_aware_params`): ``B_k = B~ - E_k``, weights
    ``1[B_k >= 0] N(h~; B_k m0, B_k Lambda0^-1 B_k + B_k + V)``, each ``B_k`` giving the Gaussian of the noisy
    observation factor. Draws from the fixed key 0 (post-processing: any key is as good)."""
    from ..pvi.noise_aware import noisy_observation_factor

    dim = b.shape[-1]
    b = 0.5 * (b + b.T)
    noise = xy_variance * jnp.eye(dim, dtype=b.dtype)

    def gaussian_at(bk):  # the noisy observation's posterior at B = bk (eigenvalues floored at 0)
        info, curvature = noisy_observation_factor(h, bk, noise)
        return gaussian_moments(prior_eta + info, prior_precision + curvature)

    upper = jnp.triu(jax.random.normal(jax.random.key(0), (draws, dim, dim), b.dtype)) * jnp.sqrt(xx_variance)
    samples = b - (upper + jnp.swapaxes(jnp.triu(upper, 1), -1, -2))  # all B~ when xx_variance is 0
    prior_mean = jnp.linalg.solve(prior_precision, prior_eta)
    prior_cov = jnp.linalg.inv(prior_precision)

    def one(bk):
        marginal = bk @ prior_cov @ bk + bk + noise
        chol = jnp.linalg.cholesky(0.5 * (marginal + marginal.T))
        z = jax.scipy.linalg.solve_triangular(chol, h - bk @ prior_mean, lower=True)
        log_weight = -0.5 * z @ z - jnp.sum(jnp.log(jnp.diagonal(chol)))
        on_cone = (jnp.linalg.eigvalsh(bk)[0] >= 0.0) & jnp.isfinite(log_weight)
        mean, cov = gaussian_at(bk)
        return jnp.where(on_cone, log_weight, -jnp.inf), mean, cov

    log_weights, means, covs = jax.vmap(one)(samples)
    any_on_cone = jnp.any(jnp.isfinite(log_weights))
    weights = jax.nn.softmax(jnp.where(any_on_cone, log_weights, 0.0))
    mean = jnp.einsum("k,kd->d", weights, means)
    centred = means - mean
    covariance = jnp.einsum("k,kde->de", weights, covs) + jnp.einsum("k,kd,ke->de", weights, centred, centred)
    fallback_mean, fallback_cov = gaussian_at(b)  # no draw on the cone: B~ projected onto it
    return (jnp.where(any_on_cone, mean, fallback_mean),
            jnp.where(any_on_cone, 0.5 * (covariance + covariance.T), fallback_cov))


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

    def noise_aware_params(self, params, noise_variance: dict, released=None):
        """The posterior that accounts for the release noise left in the fit (Bernstein & Sheldon 2019 in the
        Gaussian approximation, by Monte Carlo over the second moment). The data part of the fit is ``h = eta -
        Lambda0 m0`` (estimating ``X^T y / s^2``) and ``B = Lambda - Lambda0`` (estimating ``X^T X / s^2``), read from
        ``released``, the blend of the noisy releases *before* the per-step projection onto the positive
        semi-definite cone (unbiased: the projection biases ``B`` upwards and shrinks the mean), else from
        ``params``.

        * Noise in ``h``: given ``w``, ``X^T y / s^2 ~ N(B w, B)``; the release adds noise of covariance ``V =
          noise_variance["xy"] I``, so ``h | w ~ N(B w, B + V)`` and the factor of ``w`` is ``(B (B + V)^-1 h,
          B (B + V)^-1 B)`` (:func:`numpyro_dppvi.pvi.noise_aware.noisy_observation_factor`).
        * Noise in ``B``: the released ``B~ = B + E``, ``E`` symmetric with its upper triangle iid ``N(0, v)``,
          ``v = noise_variance["xx"]`` (:func:`~numpyro_dppvi.privacy.mechanisms.add_symmetric_noise`). With a
          flat prior on the positive semi-definite cone, ``B | B~`` is ``B~ - E`` restricted to the cone, and
          ``h~`` weighs it by ``p(h~ | B) = N(B m0, B Lambda0^-1 B + B + V)`` (``w`` integrated out). The posterior
          of ``w`` is the mixture, over :data:`MIXTURE_DRAWS` draws ``B_k`` (importance weights ``p(h~ | B_k)``,
          draws off the cone weighted 0), of the Gaussians of the first item at ``B_k``, reported by its mean and
          covariance (:func:`second_moment_mixture`). Where no draw lies on the cone (noise far above the
          data), ``B~`` projected onto it stands in, and the result is the first item's alone.

        Post-processing of the released values and the public noise variances: no privacy cost, no unreleased
        value used; the draws are the analyst's own Monte Carlo (a fixed, public key: the result is
        reproducible)."""
        from ..program_cache import cached

        prior = self.prior_params()
        source = params if released is None else released
        h, b = source["eta"] - prior["eta"], source["precision"] - prior["precision"]
        program = cached(("vips-second-moment-mixture",), lambda: jax.jit(second_moment_mixture))
        mean, covariance = program(h, b, prior["eta"], prior["precision"], noise_variance["xy"], noise_variance["xx"])
        precision = jnp.linalg.inv(covariance)
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
