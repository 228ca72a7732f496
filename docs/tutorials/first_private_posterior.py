# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A first private posterior from a NumPyro model
#
# Five hospitals each hold rows they may not pool. This tutorial writes an ordinary NumPyro model, fits it
# across the five without privacy and then at epsilon 1, reads the privacy ledger, and checks, on data sets
# simulated from known weights, that the private posterior's credible intervals cover what they claim.
#
# The source is a plain Python file in jupytext's percent format (`docs/tutorials/`): it runs as a script
# (`python docs/tutorials/first_private_posterior.py`), and the documentation build executes it as a notebook.

# %% tags=["remove-cell"]
# Hidden in the documentation: a warning is shown as "Category: message", without the notebook's temporary file path.
import warnings

warnings.formatwarning = lambda message, category, *args, **kwargs: f"{category.__name__}: {message}\n"

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook bars want ipywidgets

import jax
import matplotlib.pyplot as plt
import numpy as np
import numpyro
import numpyro.distributions as dist

import numpyro_dppvi as dppvi
from numpyro_dppvi import plots
from numpyro_dppvi.privacy import Privacy

# %% [markdown]
# ## The model and the clients
#
# Any NumPyro model with a plate over the rows works; `@dppvi.model` only marks it. The weights get a
# standard normal prior, and the data are simulated from weights drawn from that prior, so we know the truth.

# %%
@dppvi.model
def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def simulate(seed, rows=1000, covariates=3):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=covariates)
    x = rng.normal(size=(rows, covariates)).astype(np.float32)
    y = (rng.random(rows) < 1.0 / (1.0 + np.exp(-x @ w))).astype(np.float32)
    return x, y, w


x, y, w_true = simulate(0)
clients = dppvi.partition((x, y), num_clients=5, seed=0)
print([len(c[0]) for c in clients], "rows per client; true weights", np.round(w_true, 2))

# %% [markdown]
# ## Without privacy
#
# Partitioned variational inference: each client keeps a factor of the posterior and refines it against the
# others' (its *cavity*). Non-private fits run until `q` has converged.

# %%
public = dppvi.fit_dppvi(logistic, clients, rng_key=jax.random.key(1))
print(public.summary())

# %% [markdown]
# ## At epsilon 1
#
# `method="dp_optimisation"` clips each record's gradient and adds Gaussian noise (DP-SGD in the local steps).
# `Privacy(epsilon=..., delta=...)` calibrates the noise to the planned rounds; `public_sizes` declares an
# upper bound of each client's rows, so that the published settings do not disclose the real sizes. Leave
# `rng_key` out in real use: the noise must come from a secret seed (it is fixed here so the page is the same
# on every build).

# %%
privacy = Privacy(epsilon=1.0, delta=1e-5, public_sizes=[250] * 5)
private = dppvi.fit_dppvi(logistic, clients, method="dp_optimisation", privacy=privacy, batch_size=50,
                          rng_key=jax.random.key(2))
print(private.summary())
print(private.privacy.report())

# %% [markdown]
# The fit says what it found: with 200 rows a client at epsilon 1 the calibrated noise is large against one
# release's signal, and the noise, not the data, carries most of the posterior's width. Both warnings name what
# would narrow the intervals (larger batches, a larger budget, fewer clients with more rows each). The epsilon
# spent is exactly the budget, per client, at the stated delta.
#
# The posterior is *noise-aware*: the noise the mechanism added moves the fit, and `result.q` accounts for it
# (`result.q_fitted` is the fit as it ended). The noise-aware sds are wider:

# %%
fitted = private.q_fitted
print("fitted sd     ", np.round(1.0 / np.sqrt(-2.0 * np.asarray(fitted.eta2)), 3))
print("noise-aware sd", np.round(1.0 / np.sqrt(-2.0 * np.asarray(private.q.eta2)), 3))

# %% [markdown]
# Each client's epsilon over the rounds, recomputed from the public ledger and history:

# %%
ax = plots.plot_epsilon(private)
plt.show()

# %% [markdown]
# ## Is my private posterior calibrated?
#
# One data set says little about calibration. `dppvi.calibration_check` runs the same private fit (the result's
# own settings) on data sets simulated from parameters drawn from the prior, at covariates we may use freely (here
# the simulated `x`, split as the clients' rows are), and counts how often the central credible intervals contain
# the truth: a calibrated posterior covers about 90% at 90% and 50% at 50%, within the Monte Carlo standard
# errors. The covariates are synthetic, so the check costs no privacy. `benchmarks/coverage.py` and
# `benchmarks/calibration_zoo.py` run the same check with more data sets and model classes.

# %%
covariates = [(c[0],) for c in clients]
report = dppvi.calibration_check(logistic, covariates, private, num_datasets=8, rng_key=jax.random.key(0))
print(report)
ax = report.plot()
plt.show()

# %% [markdown]
# ## A hierarchical model, and a recalibrated posterior
#
# Intervals that cover on one model need not cover on another. A random-intercept logistic regression over 20
# groups (hospitals' wards, say) has 23 latents, and at epsilon 2 with 400 rows a client the noise of each release
# swamps what it says about one group. Check it before reading its intervals:

# %%
GROUPS = 20


def hierarchical(x, g, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    a = numpyro.sample("a", dist.Normal(mu, tau).expand([GROUPS]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=a[g] + b * x), obs=y)


rng = np.random.default_rng(1)
ward_covariates = [(rng.normal(size=400).astype(np.float32), rng.integers(0, GROUPS, 400).astype(np.int32))
                   for _ in range(5)]
settings = {"method": "dp_optimisation", "batch_size": 100,
            "privacy": Privacy(epsilon=2.0, delta=1e-5, public_sizes=[400] * 5)}
ward_report = dppvi.calibration_check(hierarchical, ward_covariates, settings, num_datasets=10,
                                      rng_key=jax.random.key(1))
print(ward_report)
ward_report.summary()[["cover50", "cover90", "widening"]].round(2)

# %% [markdown]
# The intervals are far too narrow (`calibrated=False`): their errors are about three times their sds for the
# group intercepts and `tau`. `ward_report.recalibrate(result)` widens a fit's sds by the factor the check measured
# per site, keeping its means (post-processing: no privacy cost). Is that the right width? Check the recalibrated
# fits on ten *other* simulated data sets:

# %%
recalibrated_fit = lambda clients, **options: ward_report.recalibrate(dppvi.fit_dppvi(hierarchical, clients, **options))
held_out = dppvi.calibration_check(hierarchical, ward_covariates, settings, num_datasets=10,
                                   rng_key=jax.random.key(2), fit=recalibrated_fit)
print(held_out)
