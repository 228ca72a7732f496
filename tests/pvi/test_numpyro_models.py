"""Ordinary NumPyro models fitted by non-private PVI and checked against NUTS (issue 15).

Each model is a kind users write (GLMs, hierarchical scales, LKJ, Dirichlet, AR(1), a Hilbert-space
GP), with small data simulated from fixed seeds, split over 4 clients and fitted by
``fit_dppvi(method="pvi")``. The reference is NumPyro's NUTS on the pooled data (one chain, 500
warm-up, 500 draws); the yardstick is NumPyro's own mean-field VI, ``AutoNormal`` SVI, on the same
pooled data.

The criterion, on the unconstrained space where ``q`` lives (so that LKJ and simplex sites have no
degenerate coordinates): the largest gap over every coordinate of every latent site between the
posterior mean and NUTS's, in NUTS posterior standard deviations,

    gap = max_k |E_q[u_k] - E_NUTS[u_k]| / sd_NUTS[u_k],

must satisfy ``gap_PVI <= max(0.5, gap_AutoNormal + 0.25)``. Why these numbers: PVI's fixed point is
mean-field global VI, i.e. AutoNormal's optimum, so PVI should be as close to NUTS as AutoNormal
is; the 0.25 sd covers what separates two finite runs of stochastic optimisers (the Monte Carlo and
optimiser noise that remains at the last round, measured at about 0.1-0.2 sd with the settings
below), and 0.5 sd is the floor under which a posterior mean is accurate for any practical use
even where mean-field VI itself happens to match NUTS closely. NUTS's own error (500 draws, an
effective sample size of a few hundred) is about 0.05-0.1 sd.

Settings (see :data:`SETTINGS`): a sequential schedule, 40 rounds (80 for the HSGP, see
:data:`MODELS`) of 50 local Adam steps at ``lr = 5e-3``, 10 draws. ``fit_dppvi``'s defaults
(synchronous, damping 1, 10 rounds of 10 steps of ``adam(1e-2)``) failed: after 10 rounds the
AR(1), GLMM and HSGP were 2.5, 2.0 and 1.9 sd from NUTS (100 Adam steps move a coordinate by about
1 at most); with 50 rounds the AR(1) converged, but the GLMM and HSGP oscillated (``q`` moving
2-4 sd a round, ending 4.8 and 6.6 sd away). Damping 0.5 removes the oscillation but converges
slowly (0.44 and 1.13 sd after 50 rounds); the sequential schedule is stable and the fastest. A
fresh Adam state every round leaves a noise floor: ``q`` moves 0.3-0.5 sd a round at convergence
with 10 steps of ``lr = 1e-2`` and 0.1-0.25 sd with 50 steps of ``lr = 5e-3``.
"""

from __future__ import annotations

import importlib
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro.contrib.hsgp.approximation import hsgp_squared_exponential
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_dppvi as dppvi
from numpyro_dppvi.model import ModelAdapter

NUM_CLIENTS = 4

# --------------------------------------------------------------------------- models and data


@dppvi.model
def logistic(x, y=None):
    """Logistic regression with fixed Normal priors (the exact-prior path: no server factor)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)


def logistic_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 3)).astype(np.float32)
    y = rng.binomial(1, 1 / (1 + np.exp(-(x @ np.array([1.0, -0.5, 0.25]) - 0.3)))).astype(np.float32)
    return x, y


@dppvi.model
def poisson(x, y=None):
    """Poisson regression, coefficients with a HalfNormal scale, a LogNormal baseline rate."""
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    w = numpyro.sample("w", dist.Normal(0.0, tau).expand([x.shape[1]]).to_event(1))
    base = numpyro.sample("base", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Poisson(base * jnp.exp(x @ w)), obs=y)


def poisson_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3)).astype(np.float32)
    y = rng.poisson(2.0 * np.exp(x @ np.array([0.5, -0.3, 0.2]))).astype(np.float32)
    return x, y


NUM_GROUPS = 6


@dppvi.model
def hierarchical(g, y=None):
    """Group means around a Normal-prior mean with a HalfCauchy scale (centred), HalfNormal noise.

    ``mu`` has an exact Normal prior and is the parent of the group means: the server factor must
    carry ``log p(a | mu, tau)`` on ``mu``'s coordinate too.
    """
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    a = numpyro.sample("a", dist.Normal(mu, tau).expand([NUM_GROUPS]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", g.shape[0]):
        numpyro.sample("y", dist.Normal(a[g], sigma), obs=y)


def hierarchical_data():
    rng = np.random.default_rng(2)
    g = np.repeat(np.arange(NUM_GROUPS), 20).astype(np.int32)
    y = (1.0 + 0.8 * rng.normal(size=NUM_GROUPS)[g] + 1.0 * rng.normal(size=g.size)).astype(np.float32)
    return g, y


GLMM_GROUPS = 8


@dppvi.model
def glmm(x, g, y=None):
    """Poisson GLMM: correlated random intercept and slope per group, HalfNormal scales, an
    LKJ-Cholesky correlation, a Normal fixed intercept."""
    beta0 = numpyro.sample("beta0", dist.Normal(0.0, 2.0))
    scales = numpyro.sample("scales", dist.HalfNormal(1.0).expand([2]).to_event(1))
    corr = numpyro.sample("corr", dist.LKJCholesky(2, concentration=2.0))
    z = numpyro.sample("z", dist.MultivariateNormal(jnp.zeros(2), scale_tril=scales[:, None] * corr)
                       .expand([GLMM_GROUPS]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(beta0 + z[g, 0] + z[g, 1] * x)), obs=y)


def glmm_data():
    rng = np.random.default_rng(3)
    g = np.repeat(np.arange(GLMM_GROUPS), 25).astype(np.int32)
    x = rng.normal(size=g.size).astype(np.float32)
    cov = np.array([[0.5 ** 2, 0.5 * 0.3 * 0.4], [0.5 * 0.3 * 0.4, 0.3 ** 2]])
    z = rng.multivariate_normal(np.zeros(2), cov, size=GLMM_GROUPS)
    y = rng.poisson(np.exp(0.7 + z[g, 0] + z[g, 1] * x)).astype(np.float32)
    return x, g, y


MIXTURE_LOCS = jnp.array([-2.0, 0.0, 2.0])


@dppvi.model
def mixture(y):
    """A Gaussian mixture with known component locations: Dirichlet weights, HalfNormal scale."""
    weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(3)))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.MixtureSameFamily(dist.Categorical(probs=weights), dist.Normal(MIXTURE_LOCS, sigma)),
                       obs=y)


def mixture_data():
    rng = np.random.default_rng(4)
    k = rng.choice(3, size=200, p=[0.5, 0.3, 0.2])
    return (np.asarray(MIXTURE_LOCS)[k] + 0.7 * rng.normal(size=200)).astype(np.float32),


@dppvi.model
def ar1(y_lag, y=None):
    """AR(1), rows = time steps given the lagged value: ``y_t ~ Normal(c + phi y_{t-1}, sigma)``,
    ``phi ~ Uniform(-1, 1)`` (an interval support), HalfNormal noise."""
    c = numpyro.sample("c", dist.Normal(0.0, 1.0))
    phi = numpyro.sample("phi", dist.Uniform(-1.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", y_lag.shape[0]):
        numpyro.sample("y", dist.Normal(c + phi * y_lag, sigma), obs=y)


def ar1_data():
    rng = np.random.default_rng(5)
    series = np.zeros(201)
    for t in range(1, 201):
        series[t] = 0.5 + 0.6 * series[t - 1] + 0.5 * rng.normal()
    return series[:-1].astype(np.float32), series[1:].astype(np.float32)


HSGP_BOUNDARY, HSGP_BASIS = 4.0, 12  # fixed (not data-derived: the model runs on one row at a time)


@dppvi.model
def hsgp(x, y=None):
    """A Gaussian process by NumPyro's Hilbert-space approximation (squared exponential kernel,
    12 basis functions, non-centred coefficients), HalfNormal amplitude and noise, LogNormal
    length scale."""
    alpha = numpyro.sample("alpha", dist.HalfNormal(1.0))
    length = numpyro.sample("length", dist.LogNormal(0.0, 0.5))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    f = hsgp_squared_exponential(x[:, None], alpha=alpha, length=length, ell=HSGP_BOUNDARY, m=HSGP_BASIS)
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(f, sigma), obs=y)


def hsgp_data():
    rng = np.random.default_rng(6)
    x = rng.uniform(-2.0, 2.0, size=100).astype(np.float32)
    return x, (np.sin(2.0 * x) + 0.3 * rng.normal(size=100)).astype(np.float32)


# --------------------------------------------------------------------------- references


def split(data, contiguous=False, seed=0):
    """4 clients: a random split of the rows (contiguous blocks for a time series)."""
    n = data[0].shape[0]
    order = np.arange(n) if contiguous else np.random.default_rng(seed).permutation(n)
    return [tuple(a[idx] for a in data) for idx in np.array_split(order, NUM_CLIENTS)]


def nuts_moments(model, data, seed=0):
    """Posterior mean and sd of the flat unconstrained vector by NUTS (500 + 500, one chain)."""
    mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=500, num_chains=1, progress_bar=False)
    mcmc.run(jax.random.key(seed), *data)
    adapter = ModelAdapter(model, data)
    samples = mcmc.get_samples()
    u = jax.vmap(adapter.unconstrain)({s.name: samples[s.name] for s in adapter.sites})
    return np.asarray(jnp.mean(u, 0)), np.asarray(jnp.std(u, 0))


def autonormal_loc(model, data, steps=20000, seed=0):
    """AutoNormal's variational mean on the flat unconstrained vector (Adam, 1e-2 decaying to 1e-3).

    20000 steps: at 6000 the HSGP's fit was not converged (the gap to NUTS of two seeds 0.47 and
    0.62, against 0.65 for both at 20000), which made the yardstick depend on luck."""
    guide = AutoNormal(model)
    schedule = optax.exponential_decay(1e-2, steps, 0.1)
    result = SVI(model, guide, optax.adam(schedule), Trace_ELBO()).run(
        jax.random.key(seed), steps, *data, progress_bar=False)
    adapter = ModelAdapter(model, data)
    return np.concatenate([np.reshape(result.params[f"{s.name}_auto_loc"], -1) for s in adapter.sites])


def gap(loc, reference) -> float:
    """Largest |posterior-mean gap| in NUTS posterior sds over all unconstrained coordinates."""
    mean, sd = reference
    return float(np.max(np.abs(np.asarray(loc) - mean) / sd))


#: Non-private PVI settings that converge on every model here (why not the defaults: module docstring).
SETTINGS = dict(method="pvi", schedule="sequential", rounds=40, local_steps=50, optimizer=optax.adam(5e-3),
                num_samples=10)

#: name: (model, data, options of :func:`split`, changes to :data:`SETTINGS`). The HSGP converges
#: slowly (mean-field coordinate coupling of the amplitude, the length scale and the coefficients:
#: still moving by about 0.01 sd a round at round 40); at 80 rounds it matches converged AutoNormal
#: coordinate by coordinate (within 0.1 sd).
MODELS = {
    "logistic": (logistic, logistic_data, {}, {}),
    "poisson": (poisson, poisson_data, {}, {}),
    "hierarchical": (hierarchical, hierarchical_data, {}, {}),
    "glmm_lkj": (glmm, glmm_data, {}, {}),
    "mixture_dirichlet": (mixture, mixture_data, {}, {}),
    "ar1": (ar1, ar1_data, {"contiguous": True}, {}),
    "hsgp": (hsgp, hsgp_data, {}, {"rounds": 80}),
}


def compare(name, **overrides):
    """``(gap_PVI, gap_AutoNormal, seconds)`` of one model; ``overrides`` change :data:`SETTINGS`."""
    model, make_data, options, tuned = MODELS[name]
    data = make_data()
    reference = nuts_moments(model, data)
    start = time.perf_counter()
    settings = dict(SETTINGS, **tuned, **overrides)
    result = dppvi.fit_dppvi(model, split(data, **options), rng_key=jax.random.key(0), **settings)
    seconds = time.perf_counter() - start
    pvi_loc = np.concatenate([np.reshape(result.posterior[s.name]["loc"], -1) for s in result.adapter.sites])
    return gap(pvi_loc, reference), gap(autonormal_loc(model, data), reference), seconds


_NUTS = {}


def nuts_reference(name):
    """NUTS moments of a model of :data:`MODELS`, computed once per test session."""
    if name not in _NUTS:
        model, make_data, _, _ = MODELS[name]
        _NUTS[name] = nuts_moments(model, make_data())
    return _NUTS[name]


def flat_loc(result) -> np.ndarray:
    return np.concatenate([np.reshape(result.posterior[s.name]["loc"], -1) for s in result.adapter.sites])


# --------------------------------------------------------------------------- PVI against NUTS

FAST = ("ar1",)  # the default suite's representative (about 10 s); CI runs the rest


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in MODELS])
def test_pvi_is_as_close_to_nuts_as_autonormal(name):
    """Non-private PVI on 4 clients lands where NumPyro's mean-field VI does: largest posterior-mean
    gap to NUTS <= max(0.5, AutoNormal's + 0.25) NUTS sds (the tolerance: module docstring).

    Measured with :data:`SETTINGS` (PVI gap / AutoNormal gap, NUTS sds): logistic 0.13 / 0.14,
    poisson 0.20 / 0.07, hierarchical 0.12 / 0.14, glmm_lkj 0.22 / 0.21, mixture_dirichlet
    0.08 / 0.09, ar1 0.13 / 0.11, hsgp 0.60 / 0.65 (there mean-field VI's own error dominates: the
    GP's length scale is 0.65 sd from NUTS at VI's optimum, and PVI gets there). Other PVI keys
    move PVI's gaps by about 0.1 sd.
    """
    model, make_data, options, tuned = MODELS[name]
    data = make_data()
    reference = nuts_reference(name)
    settings = dict(SETTINGS, **tuned)
    result = dppvi.fit_dppvi(model, split(data, **options), rng_key=jax.random.key(0), **settings)
    assert result.rounds == settings["rounds"]
    assert not any(entry.get("failed") for entry in result.history)
    pvi_gap = gap(flat_loc(result), reference)
    autonormal_gap = gap(autonormal_loc(model, data), reference)
    assert pvi_gap <= max(0.5, autonormal_gap + 0.25), (name, pvi_gap, autonormal_gap)


# --------------------------------------------------------------------------- global VI: no divergence


def test_global_vi_runs_through_where_it_used_to_diverge_quick():
    """Issue 15's reproduction, without NUTS: ``fit_global_vi`` on the Poisson GLM (HalfNormal scale,
    LogNormal rate) at ``adam(1e-2)`` raised ``FitDiverged`` at round 5; it must run all 10 rounds."""
    result = dppvi.fit_global_vi(poisson, split(poisson_data()), steps=1000, optimizer=optax.adam(1e-2),
                                 rng_key=jax.random.key(0))
    assert result.rounds == 10


@pytest.mark.slow
@pytest.mark.parametrize("name", ["poisson", "glmm_lkj"])
def test_global_vi_stays_stable_where_it_used_to_diverge(name):
    """Issue 15: ``fit_global_vi`` with ``adam(1e-2)`` raised ``FitDiverged`` at round 5 (Poisson)
    and 17 (GLMM) of 50 before the server factor was refined by natural-gradient steps
    (:class:`~numpyro_dppvi.pvi.local.ServerFactorStep`); it must now run all 50 rounds and end near
    NUTS. Tolerance 1 sd: batches of 100 rows and a fresh Adam state at ``lr = 1e-2`` every 100
    steps leave a noise floor (measured: a gap of 0.43 on both; 0.22 / 0.64 at ``lr = 1e-3``,
    where the GLMM is not yet converged)."""
    model, make_data, options, _ = MODELS[name]
    data = make_data()
    result = dppvi.fit_global_vi(model, split(data, **options), steps=5000, optimizer=optax.adam(1e-2),
                                 rng_key=jax.random.key(0))
    assert result.rounds == 50
    assert gap(flat_loc(result), nuts_reference(name)) <= 1.0


@pytest.mark.slow
def test_pvi_synchronous_damping_1_runs_without_divergence_on_a_non_gaussian_prior():
    """Synchronous rounds with damping 1 (the defaults before issue 15) on the Poisson GLM: every
    round valid, every client contributing."""
    result = dppvi.fit_dppvi(poisson, split(poisson_data()), schedule="synchronous", damping=1.0, rounds=10,
                             rng_key=jax.random.key(1))
    assert result.rounds == 10 and not any(entry.get("failed") for entry in result.history)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in MODELS])
def test_fit_dppvi_defaults_reach_autonormal(name):
    """``fit_dppvi(model, clients)`` with nothing else set (sequential, 20 rounds of 10 ``adam(1e-2)``
    steps: ``METHOD_DEFAULTS["pvi"]``) meets the same criterion as :func:`test_pvi_is_as_close_to_nuts_as_autonormal`.

    Measured (PVI gap / AutoNormal gap, NUTS sds): logistic 0.15 / 0.14, poisson 0.20 / 0.07,
    hierarchical 0.13 / 0.14, glmm_lkj 0.36 / 0.21, mixture_dirichlet 0.26 / 0.09, ar1 0.42 / 0.11,
    hsgp 0.78 / 0.65 (the HSGP still creeps: its ConvergenceWarning says so). The former defaults (synchronous, damping 1, 10 rounds) left
    the GLMM, the AR(1) and the HSGP 2.0, 2.5 and 1.9 sd away; sequential with 10 rounds, the GLMM
    and the HSGP 0.90 and 1.6.
    """
    model, make_data, options, _ = MODELS[name]
    data = make_data()
    result = dppvi.fit_dppvi(model, split(data, **options), rng_key=jax.random.key(0))
    assert result.schedule == "sequential" and result.rounds == 20
    pvi_gap = gap(flat_loc(result), nuts_reference(name))
    autonormal_gap = gap(autonormal_loc(model, data), nuts_reference(name))
    assert pvi_gap <= max(0.5, autonormal_gap + 0.25), (name, pvi_gap, autonormal_gap, result.convergence)


@pytest.mark.parametrize("name", ["poisson", pytest.param("glmm_lkj", marks=pytest.mark.slow)])
@pytest.mark.parametrize("prior", ["same", "split"])
def test_fit_bcm_stays_proper_on_non_gaussian_priors(name, prior):
    """BCM with HalfNormal/LogNormal/LKJ priors (issue 15: stable in fit_bcm as in PVI and global VI):
    every client's local fit from the prior (its Gaussian part times the server's factor) combines into
    a finite, proper q. The same-prior rule may reset coordinates less certain than the prior (measured:
    0 for the Poisson GLM, 3 of 20 for the GLMM), and counts them; the split prior needs none."""
    model, make_data, options, _ = MODELS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dppvi.diagnostics.PosteriorRuleWarning)
        result = dppvi.fit_bcm(model, split(make_data(), **options), prior=prior, local_steps=500,
                               rng_key=jax.random.key(0))
    assert bool(dppvi.factors.is_proper(result.q))
    reset = result.history[0]["reset_to_prior"]
    assert reset == 0 if prior == "split" else 0 <= reset < result.adapter.dim // 2, reset


# --------------------------------------------------------------------------- small clients


@pytest.mark.parametrize("sizes, schedule", [([2, 2, 2, 2], "synchronous"), ([1] * 8, "sequential"),
                                             ([1, 1], "synchronous")])
def test_tiny_clients(sizes, schedule):
    """Issue 15: clients of one or two rows (8 rows in all, or 2) are traced on rows pooled across
    clients, or repeated when fewer than three exist; the fit runs with a server factor
    (HalfNormal, LogNormal priors) and every client contributes."""
    x, y = poisson_data()
    bounds = np.cumsum([0] + sizes)
    clients = [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    result = dppvi.fit_dppvi(poisson, clients, schedule=schedule, rounds=3, local_steps=5, rng_key=jax.random.key(0))
    assert result.rounds == 3 and not any(entry.get("failed") for entry in result.history)
    assert result.adapter.dim == ModelAdapter(poisson, (x, y)).dim == 5
    assert all(np.all(np.isfinite(v["loc"])) for v in result.posterior.values())


# --------------------------------------------------------------------------- the server factor step


@dppvi.model
def lognormal_rate(y):
    base = numpyro.sample("base", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(base), obs=y)


@dppvi.model
def halfcauchy_scale(y):
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(0.0, tau), obs=y)


def server_step(model, steps=50):
    from numpyro_dppvi.pvi.local import ServerFactorStep

    adapter = ModelAdapter(model, (np.ones(3, np.float32),))
    return ServerFactorStep(adapter.server_log_density, tuple(bool(b) for b in np.asarray(adapter.server_mask)),
                            optax.adam(1e-2), steps, 10)


def test_server_factor_is_exact_under_a_sharp_data_factor():
    """The cause of issue 15's divergences. A LogNormal(0, 1) prior is N(0, 1) on ``u = log(base)``,
    so ``t_0`` must be ``eta2 = -0.5``, ``eta1 = 0``, while the data factor has precision 500 (as
    in the Poisson GLM, ``n = 200``). The former rule (Adam on ``q``'s ``(mu, log s)``, ``t_0 = q /
    cavity``) got ``eta2`` wrong by about ``lr * 500`` (measured over these 5 calls: ``eta2`` = +0.51,
    +0.57, +0.07, +0.93, -4.98, ``eta1`` up to 6.0); the natural-gradient step is exact in ``eta2``
    (a quadratic log density has a constant Hessian) and ``eta1`` carries only the Monte Carlo
    error of ``E[u]`` (``0.045 / sqrt(10)`` per iteration, averaged over 25 iterates; measured
    below 0.0023: tolerance 0.02)."""
    step = server_step(lognormal_rate)
    update = jax.jit(step.update)
    cavity = dppvi.factors.from_loc_scale(jnp.array([0.65]), jnp.array([500.0 ** -0.5]))
    q = dppvi.factors.multiply(cavity, dppvi.factors.Gaussian(jnp.zeros(1), jnp.full(1, -0.5)))
    for round_ in range(5):  # a few rounds, as the server runs it
        q = update(q, cavity, jax.random.key(round_))
        t0 = dppvi.factors.divide(q, cavity)
        np.testing.assert_allclose(t0.eta2, [-0.5], atol=1e-3)
        np.testing.assert_allclose(t0.eta1, [0.0], atol=0.02)


def test_server_step_fixed_point_is_the_vi_optimum():
    """``t_0``'s fixed point is the maximiser of ``E_q[log p(T(u)) + log|J|] + E_q[log cavity] + H[q]``
    (so every fixed point of PVI is one of global VI): a HalfCauchy(1) prior on ``u = log(tau)``
    (heavy-tailed, not Gaussian in ``u``) with a cavity N(0.5, 0.7^2), against the optimum by
    60-point Gauss-Hermite quadrature (float64, BFGS). Tolerance 0.02 in the mean and 2 % in the
    sd: the Monte Carlo error of 200 averaged iterates of 10 draws (measured over 4 keys: at most
    0.0043 and 0.12 %)."""
    from scipy.optimize import minimize

    nodes, weights = np.polynomial.hermite_e.hermegauss(60)
    weights = weights / weights.sum()
    log_prior = lambda u: np.log(2 / np.pi) - np.log1p(np.exp(2 * u)) + u  # HalfCauchy(1) at e^u, times e^u
    cav_loc, cav_sd = 0.5, 0.7

    def negative_objective(p):
        mu, sd = p[0], np.exp(p[1])
        u = mu + sd * nodes
        expected = np.sum(weights * (log_prior(u) - 0.5 * ((u - cav_loc) / cav_sd) ** 2))
        return -(expected + np.log(sd))

    best = minimize(negative_objective, np.zeros(2), method="BFGS", options={"gtol": 1e-10})
    step = server_step(halfcauchy_scale, steps=400)
    cavity = dppvi.factors.from_loc_scale(jnp.array([cav_loc]), jnp.array([cav_sd]))
    q = dppvi.factors.multiply(cavity, dppvi.factors.Gaussian(jnp.zeros(1), jnp.full(1, -0.5)))
    loc, sd = dppvi.factors.to_loc_scale(step.update(q, cavity, jax.random.key(0)))
    np.testing.assert_allclose(loc, [best.x[0]], atol=0.02)
    np.testing.assert_allclose(sd, [np.exp(best.x[1])], rtol=0.02)


# --------------------------------------------------------------------------- compiled model traces


@dppvi.model
def bounded(x, y=None):
    """A Uniform prior whose bounds are arrays made inside the model: its support (and so the site's
    transform) must hold concrete arrays, never values of the compiled trace."""
    lower, upper = jnp.zeros(x.shape[1]), 3.0 * jnp.ones(x.shape[1])
    w = numpyro.sample("w", dist.Uniform(lower, upper).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ (w - 1.5)), obs=y)


TRACED = {**{name: (model, make_data) for name, (model, make_data, _, _) in MODELS.items()},
          "bounded": (bounded, logistic_data)}


def adapter_layout(a: ModelAdapter) -> dict:
    return dict(plate=a.plate, observed=a.observed, bernoulli=a.bernoulli_observed,
                has_server_factor=a.has_server_factor,
                sites=[(s.name, s.shape, s.unconstrained_shape, s.offset, s.size, type(s.transform), s.gaussian_prior)
                       for s in a.sites],
                rows=[(r.shape, r.dtype) for r in a.example_row])


@pytest.mark.parametrize("name", list(TRACED))
def test_the_compiled_model_trace_gives_the_eager_traces_adapter(name, monkeypatch):
    """With a persistent compilation cache ``ModelAdapter`` traces the model in one compiled program
    (``compiled_traces``) instead of running it eagerly (dozens of small programs). The adapter must
    be the same, bit for bit: layout, prior, server mask, transforms and per-example log-likelihood."""
    model_module = importlib.import_module("numpyro_dppvi.model")  # the module, not dppvi.model
    model, make_data = TRACED[name]
    data = make_data()
    rows = tuple(np.asarray(a)[:3] for a in data)
    monkeypatch.setattr(model_module, "programs_persist", lambda: True)
    used = []
    original = model_module.compiled_traces
    monkeypatch.setattr(model_module, "compiled_traces", lambda *a: used.append(1) or original(*a))
    compiled = ModelAdapter(model, rows)
    assert used == [1]

    def refuse(*args):
        raise RuntimeError("trace eagerly")

    monkeypatch.setattr(model_module, "compiled_traces", refuse)
    eager = ModelAdapter(model, rows)
    assert adapter_layout(compiled) == adapter_layout(eager)
    for a, b in [(compiled.prior.eta1, eager.prior.eta1), (compiled.prior.eta2, eager.prior.eta2),
                 (compiled.server_mask, eager.server_mask)]:
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)
    u = jax.random.normal(jax.random.key(3), (compiled.dim,))
    for site, value in compiled.constrain(u).items():
        np.testing.assert_array_equal(value, eager.constrain(u)[site])
    np.testing.assert_array_equal(jax.jit(compiled.log_lik_rows)(u, rows), jax.jit(eager.log_lik_rows)(u, rows))


def test_a_model_the_compiler_cannot_trace_is_traced_eagerly(monkeypatch):
    """Python control flow on data values cannot be compiled; the adapter then runs the model eagerly
    (the same adapter as before the compiled trace existed)."""
    monkeypatch.setattr(importlib.import_module("numpyro_dppvi.model"), "programs_persist", lambda: True)

    @dppvi.model
    def checks_its_data(x, y=None):
        if float(jnp.max(jnp.abs(x))) > 1e6:
            raise ValueError("implausible inputs")
        return logistic(x, y)

    data = logistic_data()
    adapter = ModelAdapter(checks_its_data, data)
    assert [s.name for s in adapter.sites] == ["w", "b"] and adapter.plate == "data"


def test_a_fit_with_array_bounds_made_inside_the_model_runs(monkeypatch):
    monkeypatch.setattr(importlib.import_module("numpyro_dppvi.model"), "programs_persist", lambda: True)
    result = dppvi.fit_dppvi(bounded, split(logistic_data()), rounds=2, local_steps=5, num_samples=2)
    w = np.asarray(result.sample(200, jax.random.key(0))["w"])
    assert np.all((w > 0) & (w < 3))
