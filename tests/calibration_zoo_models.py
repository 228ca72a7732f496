"""The calibration zoo's model classes (issue 59): models NumPyro users bring, each with a covariate generator, and
the simulation of their observations (``simulate``) where the model's own sampling is not the data's process
(censoring). Shared by ``benchmarks/calibration_zoo.py`` and ``tests/test_simulation_calibration.py``.

Every model takes ``(*covariates, *observations=None)``, so that
:func:`numpyro_dppvi.calibration_check` draws its parameters from the prior and simulates its observations at the
covariates. :data:`ZOO` maps a class name to ``ZooModel(model, covariates(rng, rows), simulate or None, note)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions.transforms import OrderedTransform

GROUPS = 20
POISSON_GROUPS = 10
WIDE = 60
CENSOR_TIME = 2.0


def hier_logistic_centred(x, g, y=None):
    """Random-intercept logistic regression over 20 groups, centred: ``a_g ~ N(mu, tau)``, ``tau ~ HalfNormal(1)``."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    a = numpyro.sample("a", dist.Normal(mu, tau).expand([GROUPS]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=a[g] + b * x), obs=y)


def hier_logistic_noncentred(x, g, y=None):
    """The same model, non-centred: ``a_g = mu + tau z_g``, ``z_g ~ N(0, 1)``."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([GROUPS]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=mu + tau * z[g] + b * x), obs=y)


def hier_poisson_noncentred(x, g, y=None):
    """Random-intercept Poisson regression over 10 groups, non-centred, a log-rate near 1 (counts of a few)."""
    mu = numpyro.sample("mu", dist.Normal(1.0, 0.5))
    tau = numpyro.sample("tau", dist.HalfNormal(0.5))
    z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([POISSON_GROUPS]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 0.5))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(mu + tau * z[g] + b * x)), obs=y)


def weibull_censored(x, t=None, event=None):
    """Weibull regression with administrative censoring at :data:`CENSOR_TIME`: ``T ~ Weibull(exp(b0 + x w), k)``,
    ``k ~ HalfNormal(2)``; a censored row adds ``log S(t) = -(t / scale)^k``."""
    b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 0.5).expand([2]).to_event(1))
    k = numpyro.sample("k", dist.HalfNormal(2.0))
    scale = jnp.exp(b0 + x @ w)
    with numpyro.plate("data", x.shape[0]):
        observed = None if event is None else event > 0.5
        numpyro.sample("t", dist.Weibull(scale, k).mask(observed if observed is not None else True), obs=t)
        censored = 0.0 if t is None else jnp.where(observed, 0.0, -((t / scale) ** k))
        numpyro.factor("censored", censored)


def simulate_weibull(rng_key, values, covariates):
    """``(x, min(T, C), 1[T <= C])`` with ``T`` from the model at ``values`` (censoring is the data's process)."""
    (x,) = covariates
    scale = np.exp(float(values["b0"]) + np.asarray(x) @ np.asarray(values["w"]))
    times = np.asarray(dist.Weibull(jnp.asarray(scale), float(values["k"])).sample(rng_key), np.float64)
    event = times <= CENSOR_TIME
    return x, np.minimum(times, CENSOR_TIME).astype(np.float32), event.astype(np.float32)


def ordinal(x, y=None):
    """Ordered-logistic regression, 3 covariates and 3 cut-points (4 categories), cut-points ``N(0, 2)`` ordered."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    cut = numpyro.sample("cut", dist.TransformedDistribution(dist.Normal(0.0, 2.0).expand([3]), OrderedTransform()))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.OrderedLogistic(x @ w, cut), obs=y)


def gamma_regression(x, y=None):
    """Gamma regression with a log link and an unknown shape: ``y ~ Gamma(phi, phi / mu)``, ``phi ~ Gamma(2, 0.5)``."""
    b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 0.5).expand([2]).to_event(1))
    phi = numpyro.sample("phi", dist.Gamma(2.0, 0.5))
    mean = jnp.exp(b0 + x @ w)
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Gamma(phi, phi / mean), obs=y)


def negative_binomial(x, y=None):
    """Negative-binomial (NB2) regression with an unknown dispersion: ``GammaPoisson(phi, phi / mu)``."""
    b0 = numpyro.sample("b0", dist.Normal(1.0, 0.5))
    w = numpyro.sample("w", dist.Normal(0.0, 0.5).expand([2]).to_event(1))
    phi = numpyro.sample("phi", dist.Gamma(2.0, 0.5))
    mean = jnp.exp(b0 + x @ w)
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.GammaPoisson(phi, phi / mean), obs=y)


def student_t(x, y=None):
    """Robust linear regression, ``y ~ StudentT(nu, b0 + x w, sigma)``, ``nu ~ Gamma(2, 0.1)`` (Juarez & Steel 2010)."""
    b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    nu = numpyro.sample("nu", dist.Gamma(2.0, 0.1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.StudentT(nu, b0 + x @ w, sigma), obs=y)


def wide_logistic(x, y=None):
    """Logistic regression on 60 binary (one-hot-like) columns and an intercept: 61 latents, above
    ``NEWTON_MAX_DIM`` (Adult's one-hot design is 108 columns wide)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)


def grouped(groups):
    def covariates(rng, rows):
        return (rng.normal(size=rows).astype(np.float32), rng.integers(0, groups, rows).astype(np.int32))
    return covariates


def normal_columns(width):
    def covariates(rng, rows):
        return (rng.normal(size=(rows, width)).astype(np.float32),)
    return covariates


def binary_columns(rng, rows):
    return ((rng.random((rows, WIDE)) < 0.15).astype(np.float32),)


@dataclass(frozen=True)
class ZooModel:
    model: Callable
    covariates: Callable  # (rng, rows) -> one client's covariate tuple
    simulate: Callable | None = None  # calibration_check(simulate=...)


ZOO = {
    "hier_logistic_centred": ZooModel(hier_logistic_centred, grouped(GROUPS)),
    "hier_logistic_noncentred": ZooModel(hier_logistic_noncentred, grouped(GROUPS)),
    "hier_poisson_noncentred": ZooModel(hier_poisson_noncentred, grouped(POISSON_GROUPS)),
    "weibull_censored": ZooModel(weibull_censored, normal_columns(2), simulate_weibull),
    "ordinal": ZooModel(ordinal, normal_columns(3)),
    "gamma_regression": ZooModel(gamma_regression, normal_columns(2)),
    "negative_binomial": ZooModel(negative_binomial, normal_columns(2)),
    "student_t": ZooModel(student_t, normal_columns(2)),
    "wide_logistic": ZooModel(wide_logistic, binary_columns),
}


def client_covariates(name: str, rows: int, clients: int = 5, seed: int = 0) -> list[tuple]:
    """``clients`` covariate tuples of ``rows // clients`` rows each for zoo model ``name`` (fixed seed)."""
    rng = np.random.default_rng(seed)
    return [ZOO[name].covariates(rng, rows // clients) for _ in range(clients)]


def pooled(clients: list[tuple]) -> tuple:
    """The clients' data stacked into one data set (NUTS's reference)."""
    return tuple(np.concatenate(parts) for parts in zip(*clients))


