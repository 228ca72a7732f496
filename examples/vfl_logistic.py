"""Bayesian VFL logistic regression (Hassan et al., §5.1, Tables 1-2, Figures 2-3).

Synthetic data: ``x ~ N(0, I)`` (n x p), ``logit p_i = b + x_i^T beta + e_i`` with standard Gaussian
noise ``e_i`` added to the linear predictor, split column-wise over ``J`` clients. For every
``rho`` the script fits

* NUTS on the true, augmented-variable and power-likelihood models;
* SFVI (mean-field and amortised) on the augmented and power models, and mean-field VI
  (NumPyro SVI) on the true model,

and prints final ELBOs (mean of the last 10% of iterations) and the posterior mean and sd of one
coefficient per method; with matplotlib it saves marginal density plots.

Default: n = 500, p = 20, J = 2, rho in {0.5, 1, 2}, short runs. ``--full`` runs J in {2, 10}
with longer chains and more iterations, as in the paper.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

from numpyro_dppvi.vfl import (VFLClient, augmented_model, centralised_model, fit_vfl,
                               power_likelihood_model)


def linear(x):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    return x @ beta


def bernoulli_logit(eta, y):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", eta.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b + eta), obs=y)


def simulate(n, p, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p)).astype(np.float32)
    beta = rng.normal(size=p)
    logits = 0.5 + x @ beta + rng.normal(size=n)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return x, y, beta


def split(x, num_clients):
    blocks = np.array_split(np.arange(x.shape[1]), num_clients)
    return [VFLClient(f"c{j}", x[:, cols], linear) for j, cols in enumerate(blocks)]


def nuts(model, y, warmup, samples, seed=0):
    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, progress_bar=False)
    mcmc.run(jax.random.key(seed), y=y)
    return mcmc.get_samples()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="full", action="store_false", default=False,
                      help="small size (the default), a minute or two on 2 CPU cores: "
                           "n = 500, p = 20, J = 2, short runs")
    size.add_argument("--full", dest="full", action="store_true", default=False,
                      help="paper size: J in {2, 10}, long runs")
    parser.add_argument("--plot", default="vfl_logistic.png", help="figure file ('' for none)")
    parser.add_argument("--smoke", action="store_true", help="tiny run for tests")
    args = parser.parse_args(argv)
    n, p = (60, 4) if args.smoke else (500, 20)
    client_counts = (2, 10) if args.full else (2,)
    warmup, samples = (1000, 1000) if args.full else ((30, 30) if args.smoke else (300, 300))
    steps = 20_000 if args.full else (100 if args.smoke else 3_000)
    rhos = (1.0,) if args.smoke else (0.5, 1.0, 2.0)
    x, y, beta = simulate(n, p, seed=0)
    rows, draws = [], {}
    for J in client_counts:
        clients = split(x, J)
        site = "c0/beta"  # first coefficient of client 0 is the plotted parameter
        t = time.time()
        true_post = nuts(centralised_model(clients, bernoulli_logit), y, warmup, samples)
        draws[J, "true", "MCMC"] = np.asarray(true_post[site][:, 0])
        svi = SVI(centralised_model(clients, bernoulli_logit),
                  AutoNormal(centralised_model(clients, bernoulli_logit)),
                  numpyro.optim.Adam(1e-2), Trace_ELBO())
        fit = svi.run(jax.random.key(0), steps, y=y, progress_bar=False)
        elbo_true = -float(np.mean(fit.losses[-steps // 10:]))
        loc, scale = fit.params[f"{site}_auto_loc"][0], fit.params[f"{site}_auto_scale"][0]
        noise = np.random.default_rng(0).normal(size=2000)
        draws[J, "true", "MFVI"] = np.asarray(loc + scale * noise)
        rows.append((J, "-", "true", "MFVI", elbo_true, float(loc), float(scale)))
        print(f"J={J}: true model NUTS + MFVI in {time.time() - t:.0f}s", flush=True)
        for rho in rhos:
            for name, build, formulation in (("augmented", augmented_model, "augmented"),
                                             ("power", power_likelihood_model, "power")):
                t = time.time()
                post = nuts(build(clients, bernoulli_logit, rho), y, warmup, samples)
                draws[J, name, "MCMC", rho] = np.asarray(post[site][:, 0])
                for guide in ("mean_field", "amortised"):
                    result = fit_vfl(clients, y, bernoulli_logit, formulation=formulation,
                                     guide=guide, rho=rho, steps=steps,
                                     optimizer=optax.adam(1e-2), rng_key=jax.random.key(1))
                    s = result.sample_posterior(jax.random.key(2), 2000)[site][:, 0]
                    draws[J, name, guide, rho] = s
                    rows.append((J, rho, name, guide, float(np.mean(result.elbo[-steps // 10:])),
                                 float(s.mean()), float(s.std())))
                print(f"J={J} rho={rho} {name}: {time.time() - t:.0f}s", flush=True)
    print(f"\ntrue value of {site}[0]: {beta[0]:.3f}")
    print(f"{'J':>3} {'rho':>4} {'model':>10} {'method':>11} {'ELBO':>9} {'mean':>7} {'sd':>6}")
    for J, rho, model, method, elbo, mean, sd in rows:
        print(f"{J:>3} {rho!s:>4} {model:>10} {method:>11} {elbo:9.2f} {mean:7.3f} {sd:6.3f}")
    for key, value in draws.items():
        if key[2] == "MCMC":
            print(f"NUTS {key}: mean {value.mean():.3f} sd {value.std():.3f}")
    if args.plot:
        _plot(draws, client_counts, rhos, beta[0], args.plot)
    return rows


def _plot(draws, client_counts, rhos, truth, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure")
        return
    fig, axes = plt.subplots(2 * len(client_counts), len(rhos),
                             figsize=(4 * len(rhos), 6 * len(client_counts)),
                             squeeze=False)
    for a, J in enumerate(client_counts):
        for b, rho in enumerate(rhos):
            for row, methods in enumerate((("MCMC",), ("mean_field", "amortised"))):
                ax = axes[2 * a + row, b]
                ref = draws[J, "true", "MCMC" if row == 0 else "MFVI"]
                ax.hist(ref, bins=40, density=True, histtype="step", color="k", label="true")
                for model in ("augmented", "power"):
                    for m in methods:
                        ax.hist(draws[J, model, m, rho], bins=40, density=True, histtype="step",
                                label=f"{model} {m}")
                ax.axvline(truth, color="tab:blue", lw=2)
                ax.set_title(f"J={J}, rho={rho}, {'MCMC' if row == 0 else 'VI'}")
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure saved to {path}")


if __name__ == "__main__":
    main()
