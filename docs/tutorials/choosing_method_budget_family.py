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
# # Choosing a method, a budget and a family
#
# Three choices shape a private federated posterior: the **family** of `q` (mean-field or with correlations),
# the **budget** epsilon, and the **method** that spends it. This tutorial measures each on one small problem:
# a logistic regression with strongly correlated covariates over five clients, against NumPyro's NUTS on the
# pooled data (which no client could run: it is the reference only).

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
from numpyro.infer import MCMC, NUTS

import numpyro_dppvi as dppvi
from numpyro_dppvi import plots
from numpyro_dppvi.privacy import Privacy


@dppvi.model
def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


rng = np.random.default_rng(0)
rows, covariates = 1500, 3
shared = rng.normal(size=(rows + 1000, 1))
x_all = (0.9 * shared + np.sqrt(1 - 0.81) * rng.normal(size=(rows + 1000, covariates))).astype(np.float32)
w_true = np.array([1.0, -0.5, 0.5])
y_all = (rng.random(rows + 1000) < 1 / (1 + np.exp(-x_all @ w_true))).astype(np.float32)
x, y, x_test, y_test = x_all[:rows], y_all[:rows], x_all[rows:], y_all[rows:]
clients = dppvi.partition((x, y), num_clients=5, seed=0)
print("covariate correlations:\n", np.round(np.corrcoef(x.T), 2))

# %% [markdown]
# ## The family
#
# A mean-field `q` has independent coordinates (the default of DP optimisation, and of non-private PVI and
# private virtual clients above 32 latents; below, those two take full-rank factors). With correlated covariates
# the posterior of the weights is correlated too, and mean-field VI then *under-states* each marginal sd: it fits
# the narrow conditional widths. `family="full_rank"` keeps a full precision matrix per factor; `family="low_rank",
# rank=r` a diagonal plus rank `r`, for models with many latents.

# %%
mcmc = MCMC(NUTS(logistic), num_warmup=500, num_samples=1000, progress_bar=False)
mcmc.run(jax.random.key(0), x, y)
nuts_sd = np.asarray(mcmc.get_samples()["w"]).std(axis=0)

for family in ("mean_field", "full_rank"):
    fit = dppvi.fit_dppvi(logistic, clients, family=family, rng_key=jax.random.key(1))
    sd = np.asarray(fit.sample(4000, jax.random.key(2))["w"]).std(axis=0)
    print(f"{family:10s} sd / NUTS sd:", np.round(sd / nuts_sd, 2))

# %% [markdown]
# Mean-field reports about 0.6 of the sd NUTS finds; full-rank matches it. Prefer `full_rank` when the latents are
# few (the cost of a factor operation grows as `D^3`) and correlated; `low_rank` in between.
#
# ## The budget
#
# Smaller epsilon, more noise. The privacy/utility curve shows what each budget buys: here the test accuracy of
# DP optimisation (record-level DP-SGD in the clients' local steps) at five budgets. `eval_data` records the
# metrics each round (held-out rows: evaluating costs no privacy).

# %%
budgets = [0.25, 0.5, 1.0, 2.0, 8.0]
sizes = [len(c[0]) for c in clients]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the small budgets warn that their noise dominates: the curve shows it
    by_budget = [
        dppvi.fit_dppvi(logistic, clients, method="dp_optimisation", batch_size=50, eval_data=(x_test, y_test),
                        privacy=Privacy(epsilon=eps, delta=1e-5, public_sizes=sizes), rng_key=jax.random.key(3))
        for eps in budgets
    ]
ax = plots.plot_privacy_utility(by_budget, metric="accuracy", label="DP optimisation")
plt.show()
for eps, fit in zip(budgets, by_budget):
    sd = np.asarray(fit.sample(4000, jax.random.key(2))["w"]).std(axis=0)
    print(f"epsilon {eps:5.2f}: accuracy {fit.history[-1]['accuracy']:.3f}, sd / NUTS sd {np.round(sd / nuts_sd, 1)}")

# %% [markdown]
# Accuracy hardly moves on this problem: the labels are noisy against small weights, and even the pooled
# posterior predicts about 0.67 of the test rows. What the budget buys is the posterior's width: 4 times NUTS's
# sd at epsilon 0.25, 1.2 times at epsilon 8.
#
# ## The method
#
# The same budget can be spent in different ways. `dp_optimisation` noises each local gradient step; global
# DP-VI (`fit_global_vi`) is the single-model baseline, one model trained across all clients' rows; virtual
# clients noise whole factor updates, one record per virtual client. At epsilon 1:

# %%
privacy = Privacy(epsilon=1.0, delta=1e-5, public_sizes=sizes)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # each fit warns how much of its width is noise; compared below instead
    fits = {
        "dp_optimisation": dppvi.fit_dppvi(logistic, clients, method="dp_optimisation", batch_size=50,
                                           privacy=privacy, eval_data=(x_test, y_test), rng_key=jax.random.key(4)),
        "global DP-VI": dppvi.fit_global_vi(logistic, clients, batch_size=50, privacy=privacy,
                                            eval_data=(x_test, y_test), rng_key=jax.random.key(4)),
        "virtual_clients": dppvi.fit_dppvi(logistic, clients, method="virtual_clients", privacy=privacy,
                                           eval_data=(x_test, y_test), rng_key=jax.random.key(4)),
    }
nuts_mean = np.asarray(mcmc.get_samples()["w"]).mean(axis=0)
for name, fit in fits.items():
    draws = np.asarray(fit.sample(4000, jax.random.key(5))["w"])
    print(f"{name:16s} accuracy {fit.history[-1]['accuracy']:.3f}  epsilon {fit.privacy.epsilon:.3f}  "
          f"mean - NUTS (in NUTS sds) {np.round((draws.mean(0) - nuts_mean) / nuts_sd, 1)}  "
          f"sd / NUTS {np.round(draws.std(0) / nuts_sd, 1)}")

# %% [markdown]
# Every fit spends the budget (the ledger is calibrated to it, up to the accountant's rounding). Their posteriors
# are noise-aware, so wider than NUTS's: the width is the price of privacy. Whether the intervals are *right*
# is a separate question, answered over many data sets, not one: `benchmarks/coverage.py` measures each method
# (docs/guide.md §4). There, DP optimisation, global DP-VI and virtual clients cover close to their level. Virtual
# clients do so with full-rank factors, 20 rounds and a clip chosen from the noise, their default for models of up
# to 32 latents like this one (`fit.config` shows it); with mean-field factors (their default for larger models or
# through a trusted aggregator) they stop short of their fixed point and their intervals are too narrow for their
# error. DP optimisation, the default for a private `fit_dppvi`, is the one to start with; look at its warnings,
# and check calibration on simulated data of your own model (`plots.plot_calibration`, the first tutorial).
