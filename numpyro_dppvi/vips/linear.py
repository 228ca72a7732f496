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

from numpyro_dppvi.program_cache import jitted
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


NOISE_AWARE_DRAWS = 2000  # importance draws of X^T X in the noise-aware posterior (its Monte Carlo error: info)


@jitted(static_argnames="num_draws")
def noisy_statistics_posterior(prior_eta, prior_precision, eta, precision, xy_variance, xx_variance, rng_key,
                               num_draws: int = NOISE_AWARE_DRAWS):
    """The posterior of ``w`` given the noisy statistics a private fit released (Bernstein & Sheldon 2019, with
    the Gaussian release noise of :func:`~numpyro_dppvi.vips.fit.release_noise_variance`), as a mixture of
    Gaussians. The fit's data part ``h~ = eta - Lambda0 m0`` estimates ``X^T y / s^2`` and ``B~ = Lambda -
    Lambda0`` estimates ``B = X^T X / s^2``; the model of the releases is

        w ~ N(m0, Lambda0^-1),   B ~ flat on the positive semi-definite cone,
        h~ | w, B ~ N(B w, B + V)          (X^T y / s^2 | w ~ N(B w, B); V = xy_variance I, the release noise)
        B~ | B ~ B + E                     (E symmetric, its upper triangle iid N(0, xx_variance))

    and ``p(w | h~, B~) = int N(w; m_B, S_B) p(B | h~, B~) dB`` with ``S_B^-1 = Lambda0 + B (B + V)^-1 B`` and
    ``m_B = S_B (Lambda0 m0 + B (B + V)^-1 h~)`` (:func:`numpyro_dppvi.pvi.noise_aware.noisy_observation_factor`).
    ``p(B | h~, B~)`` is proportional to ``N(B~; B, E's law) 1[B >= 0] p(h~ | B)`` with ``p(h~ | B) = N(h~; B m0, B
    + V + B Lambda0^-1 B)`` (``w`` integrated out): ``num_draws`` draws ``B_k = B~ + E_k`` (the release mechanism's
    own noise, :func:`~numpyro_dppvi.privacy.mechanisms.add_symmetric_noise`), weighted by ``p(h~ | B_k)``, those
    outside the cone weighted 0 (self-normalised importance sampling, exact as ``num_draws`` grows).

    Returns ``(weights [K], means [K, D], scale_trils [K, D, D])``. Post-processing of the released ``eta`` and
    ``precision`` with public values (the prior, the noise variances, which the step sizes and the noise std
    determine); ``rng_key`` is Monte Carlo randomness, not a privacy mechanism, and needs no secrecy."""
    from ..privacy.mechanisms import add_symmetric_noise
    from ..pvi.noise_aware import noisy_observation_factor

    dim = precision.shape[-1]
    prior_mean = jnp.linalg.solve(prior_precision, prior_eta)
    prior_covariance = jnp.linalg.inv(prior_precision)
    information, curvature = eta - prior_eta, precision - prior_precision
    release = xy_variance * jnp.eye(dim, dtype=precision.dtype)
    draws = jax.vmap(lambda k: add_symmetric_noise(k, curvature, jnp.sqrt(xx_variance)))(
        jax.random.split(rng_key, num_draws))

    def component(b):
        b = 0.5 * (b + b.T)
        inside = jnp.linalg.eigvalsh(b)[0] >= 0.0
        marginal = b + release + b @ prior_covariance @ b
        log_weight = dist.MultivariateNormal(b @ prior_mean, covariance_matrix=0.5 * (marginal + marginal.T)
                                             ).log_prob(information)
        h, shrunk = noisy_observation_factor(information, b, release)
        mean, covariance = gaussian_moments(prior_eta + h, prior_precision + shrunk)
        return jnp.where(inside, log_weight, -jnp.inf), mean, jnp.linalg.cholesky(covariance)

    # lax.map, not vmap: the vmapped program deadlocks XLA's CPU runtime (jax 0.10.2; reproduced on 2 cores)
    log_weights, means, scale_trils = jax.lax.map(component, draws)
    return jax.nn.softmax(log_weights), means, scale_trils


def mixture_moments(weights, means, scale_trils):
    """Mean and covariance of ``sum_k weights_k N(means_k, L_k L_k^T)``."""
    mean = weights @ means
    spread = means - mean
    covariance = (jnp.einsum("k,kij,klj->il", weights, scale_trils, scale_trils)
                  + jnp.einsum("k,ki,kj->ij", weights, spread, spread))
    return mean, 0.5 * (covariance + covariance.T)


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

    Args:
      num_features: ``D``, the number of columns of ``x`` (and of weights ``w``).
      noise_scale: ``s``, the known noise standard deviation, positive.
      prior_mean: ``m0``, a scalar (every coordinate) or a ``[D]`` vector. Default 0.
      prior_precision: ``Lambda0``, a scalar, a ``[D]`` vector (diagonal) or a ``[D, D]`` positive-definite
        matrix. Default 1.
      feature_bound: ``B_x``, the public bound on ``|x_i|``; required by a private fit. When given, every ``x_i``
        is projected onto the ball of that radius. Default None.
      target_bound: ``B_y``, the public bound on ``|y_i|``; required by a private fit. When given, every ``y_i``
        is clipped to ``[-B_y, B_y]``. Default None.
    """

    symmetric_blocks = ("xx",)
    ess_uses_params = False  # the statistics are the data's: released steps are blended unprojected (fit.deferred_validity)

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

    def noise_aware_params(self, params, noise_variance: dict, rng_key=None):
        """The posterior that accounts for the release noise left in ``params``: the mixture of
        :func:`noisy_statistics_posterior` (Bernstein & Sheldon 2019's model of the noisy sufficient statistics,
        integrated by importance sampling over ``X^T X``). Returns ``{"eta", "precision"}`` of the mixture's mean
        and covariance (what :meth:`predict_mean` and the Gaussian summaries read) and ``"mixture"``: ``{"weights",
        "means", "scale_tril"}``, which :meth:`posterior_distribution` and :meth:`sample_posterior` draw from.
        ``rng_key``: Monte Carlo draws (public; default a fixed key, so the result is reproducible).

        Why not a first-order correction (this package's earlier rule, ``Var = Lambda^-1 Cov(E m) Lambda^-1``): at
        epsilon 1 with 2,000 rows the noise in ``X^T X`` is a fifth of it; on 50 data sets its 90% intervals covered
        0.95 with a posterior-mean RMSE of 0.41, the mixture 0.94 (its own quantiles) with 0.29
        (``benchmarks/coverage.py``). Post-processing of the released parameters and the public noise variances:
        no privacy cost, no unreleased value used."""
        prior = self.prior_params()
        key = jax.random.key(0) if rng_key is None else rng_key
        weights, means, scale_trils = noisy_statistics_posterior(
            prior["eta"], prior["precision"], params["eta"], params["precision"], noise_variance["xy"],
            noise_variance["xx"], key)
        if not bool(jnp.any(weights > 0)):
            raise ValueError(
                "noise-aware BayesianLinearRegression: no draw of X^T X given its noisy release is positive "
                "semi-definite: the release noise swamps the data. Raise epsilon, use more rows or a tighter "
                "feature_bound, or pass noise_aware=False to see the fitted parameters.")
        mean, covariance = mixture_moments(weights, means, scale_trils)
        precision = jnp.linalg.inv(covariance)
        precision = 0.5 * (precision + precision.T)
        return {"eta": precision @ mean, "precision": precision,
                "mixture": {"weights": weights, "means": means, "scale_tril": scale_trils}}

    def validate_data(self, data):
        return _validate_xy(data, self.dim, type(self).__name__)

    def posterior_distribution(self, params):
        """``N(mu, Lambda^-1)``; for noise-aware parameters (``"mixture"``) the mixture of Gaussians."""
        if "mixture" in params:
            mixture = params["mixture"]
            return dist.MixtureSameFamily(dist.Categorical(probs=mixture["weights"]),
                                          dist.MultivariateNormal(mixture["means"], scale_tril=mixture["scale_tril"]))
        mean, cov = gaussian_moments(params["eta"], params["precision"])
        return dist.MultivariateNormal(mean, covariance_matrix=cov)

    def sample_posterior(self, params, rng_key, num_samples):
        """Draws of ``w``; from a noise-aware mixture, a component for each draw and then its Gaussian (memory
        ``num_samples x D^2``; ``MixtureSameFamily.sample`` draws from every component for every draw:
        ``num_samples x K x D``, 20,000 draws of 2,000 components a few GB)."""
        if "mixture" not in params:
            return {"w": self.posterior_distribution(params).sample(rng_key, (num_samples,))}
        mixture = params["mixture"]
        key_component, key_normal = jax.random.split(rng_key)
        component = dist.Categorical(probs=mixture["weights"]).sample(key_component, (num_samples,))
        normal = jax.random.normal(key_normal, (num_samples, mixture["means"].shape[-1]), mixture["means"].dtype)
        return {"w": mixture["means"][component]
                + jnp.einsum("nij,nj->ni", mixture["scale_tril"][component], normal)}

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
    Data: ``(x [N, D], y [N])``.

    Args:
      num_features: ``D``, the number of columns of ``x`` (and of weights ``w``).
      prior_mean: ``m0``, a scalar (every coordinate) or a ``[D]`` vector. Default 0.
      prior_precision: ``Lambda0``, a scalar, a ``[D]`` vector (diagonal) or a ``[D, D]`` positive-definite
        matrix. Default 1.
      noise_concentration: ``a0``, the shape of the Gamma prior of the noise precision ``tau``, positive.
        Default 1.
      noise_rate: ``b0``, the rate of that Gamma prior, positive. Default 1.
      feature_bound: ``B_x``, the public bound on ``|x_i|``; required by a private fit. When given, every ``x_i``
        is projected onto the ball of that radius. Default None.
      target_bound: ``B_y``, the public bound on ``|y_i|``; required by a private fit. When given, every ``y_i``
        is clipped to ``[-B_y, B_y]``. Default None.
    """

    symmetric_blocks = ("xx",)
    ess_uses_params = False  # see BayesianLinearRegression

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
