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
# # Deploying on Flower
#
# `fit_dppvi` simulates every client in one process. On real sites each data holder (a hospital, say) runs
# a Flower **SuperNode** with this package's **ClientApp**, and a coordinator runs a **SuperLink** with its
# **ServerApp**. This tutorial prepares three hospitals as they would prepare themselves (a data file and a
# node config each, written by the hospital alone), runs the fit through the package's ClientApp and ServerApp
# over Flower's message API in this one process, and reads each hospital's privacy ledger from its own folder.
# The last section gives the commands that run the same fit across machines.
#
# It needs the `flower` extra: `pip install "numpyro_dppvi[flower]"`.

# %% tags=["remove-cell"]
# Hidden in the documentation: a warning is shown as "Category: message", without the notebook's temporary file path.
import warnings

warnings.formatwarning = lambda message, category, *args, **kwargs: f"{category.__name__}: {message}\n"

# %%
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook bars want ipywidgets

import numpy as np

import numpyro_dppvi as dppvi
from numpyro_dppvi.flower import client_store
from numpyro_dppvi.flower.inprocess import run_inprocess
from numpyro_dppvi.flower.models import logistic_regression
from numpyro_dppvi.flower.settings import NodeSettings

# %% [markdown]
# ## Three hospitals, each with its own folder
#
# A logistic regression with three covariates, simulated from known weights. A node only ever sees its own
# rows; the server never sees a row, a node config or a node's folder.

# %%
rng = np.random.default_rng(0)
w_true = np.array([1.0, -1.0, 0.5])
work = Path(tempfile.mkdtemp(prefix="dppvi-flower-tutorial-"))


def hospital_rows(n):
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-x @ w_true))).astype(np.float32)
    return x, y


hospitals = {"st-elsewhere": 600, "county-general": 800, "mercy-west": 1000}
x_test, y_test = hospital_rows(2000)

# %% [markdown]
# Each hospital writes its data (`.npz`, one array per model argument) and its **node config**. The config is
# the hospital's, not the server's: it fixes the model it agrees to fit (an importable function), its total
# budget over every fit on these rows, the neighbouring relation and accountant, and a public upper bound on
# its number of rows (so that no published setting depends on the true size). Its state folder will hold the
# noise seed (drawn once from the operating system, never sent) and its ledger.

# %%
node_configs = []
for name, rows in hospitals.items():
    folder = work / name
    folder.mkdir(mode=0o700)
    x, y = hospital_rows(rows)
    np.savez(folder / "data.npz", x=x, y=y)
    (folder / "data.npz").chmod(0o600)
    node_configs.append({
        "client-id": name,                      # stable across restarts
        "state-dir": str(folder / "state"),     # private state: noise seed, ledger, the fit's own factor
        "data-file": str(folder / "data.npz"),
        "data-arrays": "x,y",
        "model": "numpyro_dppvi.flower.models:logistic_regression",
        "epsilon": 1.0, "delta": 1e-5,          # this data's budget, over every fit
        "public-size": 1200,                    # a public upper bound on the rows
    })
print(node_configs[0])

# %% [markdown]
# ## The coordinator's run config
#
# The server chooses the method, schedule and optimisation settings, nothing about any node's privacy: DP
# optimisation (privatised gradients in each local step), synchronous rounds, batches of expected size 100,
# and private Newton steps (`fit_dppvi`'s default local step for a small model), whose released curvatures
# make the answer noise-aware: q's sds include the uncertainty the DP noise adds. Each node calibrates its own
# noise to its own budget from these public settings.

# %%
run_config = {"model": "numpyro_dppvi.flower.models:logistic_regression", "method": "dp_optimisation",
              "schedule": "synchronous", "rounds": 4, "local-steps": 20, "batch-size": 100, "num-samples": 10,
              "optimizer": "private_newton", "learning-rate": 0.5, "tail-average": 0.5, "damping": 0.5,
              "clip": 2.0, "poll-interval": 0.01}

# %% [markdown]
# ## The fit
#
# `run_inprocess` runs the package's ServerApp body over an in-process Flower `Grid`: each instruction is
# checked and wire-encoded as a SuperLink would, and handed to the ClientApp of the node it is addressed to,
# with that node's config and state; replies travel back the same way. It is the deployed code path without
# processes or network (and, with a test-only key option, it reproduces `fit_dppvi` to float tolerance:
# `tests/flower/test_equivalence.py`).

# %%
result = run_inprocess(run_config, node_configs, report=print)
print(result.summary(num_samples=2000))
print("true weights", w_true)
print("held-out", {k: round(float(v), 3) for k, v in result.evaluate(x_test, y_test).items()})

# %% [markdown]
# The result is the same `DPPVIResult` a simulated fit returns (`summary`, `sample`, `to_arviz`, `save`), and the
# posterior is noise-aware (the `noise_aware` column). Each true weight lies within about two of its posterior sds.

# %% [markdown]
# ## Whose ledger counts
#
# The server keeps a mirror of the ledgers (what it can compute from the public settings), for information.
# The authority is each hospital's own ledger, in its own state folder, over every fit on its rows: a second
# fit that would overspend it is refused by the node, whatever the server asks.

# %%
print(result.privacy.report())
for config in node_configs:
    ledger = client_store.load(NodeSettings.from_node_config(config)).ledger
    print(f"{config['client-id']}: epsilon {ledger.epsilon:.4f} of 1.0 (delta {ledger.delta:.1e})")

# %% [markdown]
# ## Across machines
#
# The same fit, with each hospital on its own machine:
#
# ```bash
# pip install "numpyro_dppvi[flower]"                       # server and every node, the same version
# flower-superlink                                          # the coordinator (TLS: docs/deploy.md)
# flower-supernode --superlink coordinator.example.org:9092 \
#     --node-config /srv/dppvi/node.toml                    # each hospital, its config as above, in TOML
# flwr run <app folder> <federation> --run-config run.toml  # the coordinator starts the ServerApp
# ```
#
# `dppvi deploy demo` starts a SuperLink and two SuperNodes on loopback ports and runs this on the bundled
# Adult data; the deployment chapter (docs/deploy.md) covers the node's state file, what travels over the
# wire, what the server can and cannot learn, restarts and drop-outs.

# %%
import shutil

shutil.rmtree(work, ignore_errors=True)
