"""Multilevel Poisson regression in the VFL setting (Hassan et al., §5.2, Figure 4).

1. Synthetic SA2-like data: ``N`` areas, two clients with two standard-Gaussian covariates each,
   population ``pop_i ~ U{250..350}`` (public: the server's offset), remoteness ``r_i`` uniform on
   five levels (public: every client holds a copy). True model::

       y_i ~ Poisson(lambda_i),  log lambda_i = b + log pop_i + sum_j x_ij^T beta_j[r_i]
       beta_j[r] ~ N(mu_j, sigma_j),  mu_j ~ N(0, 1),  sigma_j ~ HalfNormal(1),  b ~ N(0, 1)

   The augmented-variable model (rho in {1, 2}) is fit by SFVI with the amortised guide and by
   NUTS, and compared with NUTS on the true model (mu_1[0] and beta_1[level 0, 0]).
2. Real data: ``grouseticks`` (tick counts on 403 grouse chicks) from the data home. Client
   "survey" holds altitude and year; client "sites" holds the location and brood of each chick
   and models them with random intercepts. The server holds the counts.

Default N = 500 and short runs; ``--full`` uses N = 2000 and longer runs.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from numpyro.infer import MCMC, NUTS

from numpyro_dppvi.vfl import VFLClient, augmented_model, centralised_model, fit_vfl

LEVELS = 5


def varying_slopes(data):
    """Client sub-model: slopes per remoteness level around client-wide means."""
    x, level = data
    p = x.shape[1]
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([p]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0).expand([p]).to_event(1))
    beta = numpyro.sample("beta", dist.Normal(mu, sigma).expand([LEVELS, p]).to_event(2))
    return jnp.sum(x * beta[level], axis=-1)


def poisson_with_offset(eta, data):
    """Server likelihood; ``data = (counts, log_pop)`` are the server's row arrays."""
    counts, log_pop = data
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("areas", eta.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b + log_pop + eta)), obs=counts)


def simulate_sa2(n, seed=0):
    rng = np.random.default_rng(seed)
    level = rng.integers(0, LEVELS, size=n)
    pop = rng.integers(250, 351, size=n)
    xs, eta = [], np.zeros(n)
    truth = {}
    for j in range(2):
        x = rng.normal(size=(n, 2)).astype(np.float32)
        mu = rng.normal(scale=0.3, size=2)
        sigma = np.abs(rng.normal(scale=0.1, size=2))
        beta = mu + sigma * rng.normal(size=(LEVELS, 2))
        eta += np.sum(x * beta[level], axis=1)
        xs.append(x)
        truth[f"c{j}/mu"], truth[f"c{j}/beta"] = mu, beta
    b = -5.0
    counts = rng.poisson(np.exp(b + np.log(pop) + eta)).astype(np.float32)
    return xs, level.astype(np.int32), np.log(pop).astype(np.float32), counts, truth


def nuts(model, y, warmup, samples):
    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, progress_bar=False)
    mcmc.run(jax.random.key(0), y=y)
    return mcmc.get_samples()


def synthetic(args):
    n = 2000 if args.full else (80 if args.smoke else 500)
    steps = 20_000 if args.full else (100 if args.smoke else 4_000)
    warmup, samples = (1000, 1000) if args.full else ((30, 30) if args.smoke else (300, 300))
    xs, level, log_pop, counts, truth = simulate_sa2(n)
    clients = [VFLClient(f"c{j}", (x, level), varying_slopes) for j, x in enumerate(xs)]
    y = (counts, log_pop)
    t = time.time()
    ref = nuts(centralised_model(clients, poisson_with_offset), y, warmup, samples)
    print(f"NUTS on the true model: {time.time() - t:.0f}s")
    print(f"{'fit':>28} {'mu_1[0]':>16} {'beta_1[0,0]':>16}")

    def show(label, s):
        mu, beta = np.asarray(s["c0/mu"][:, 0]), np.asarray(s["c0/beta"][:, 0, 0])
        print(f"{label:>28} {mu.mean():7.3f} ({mu.std():.3f}) "
              f"{beta.mean():7.3f} ({beta.std():.3f})")

    print(f"{'truth':>28} {truth['c0/mu'][0]:7.3f}         {truth['c0/beta'][0, 0]:7.3f}")
    show("true model, NUTS", ref)
    for rho in (1.0, 2.0):
        show(f"augmented rho={rho}, NUTS",
             nuts(augmented_model(clients, poisson_with_offset, rho), y, warmup, samples))
        result = fit_vfl(clients, y, poisson_with_offset, formulation="augmented",
                         guide="amortised", rho=rho, steps=steps, optimizer=optax.adam(1e-2),
                         rng_key=jax.random.key(1), batch_size=min(n, 256))
        show(f"augmented rho={rho}, SFVI", result.sample_posterior(jax.random.key(2), 2000))
        print(f"{'':>28} final ELBO {np.mean(result.elbo[-steps // 10:]):.1f}, "
              f"{result.communication['num_scalars']:,} scalars exchanged")


def random_intercepts(data):
    """Client "sites": random intercepts of location and brood."""
    location, brood, num_locations, num_broods = data[0], data[1], 63, 118
    s_loc = numpyro.sample("sd_location", dist.HalfNormal(1.0))
    s_brood = numpyro.sample("sd_brood", dist.HalfNormal(1.0))
    a_loc = numpyro.sample("location", dist.Normal(0.0, 1.0).expand([num_locations]).to_event(1))
    a_brood = numpyro.sample("brood", dist.Normal(0.0, 1.0).expand([num_broods]).to_event(1))
    return s_loc * a_loc[location] + s_brood * a_brood[brood]


def altitude_year(x):
    """Client "survey": altitude slope and year effects."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    return x @ beta


def poisson_log(eta, counts):
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("chicks", eta.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b + eta)), obs=counts)


def grouseticks(args):
    from numpyro_dppvi.datasets import DatasetNotFoundError, load_grouseticks

    try:
        frame = load_grouseticks()
    except DatasetNotFoundError as err:
        print(f"grouseticks skipped: {err}")
        return
    counts = frame["TICKS"].to_numpy(np.float32)
    height = frame["cHEIGHT"].to_numpy(np.float32)
    year = frame["YEAR"].astype(str)
    survey_x = np.column_stack([height / height.std(), (year == "96").to_numpy(),
                                (year == "97").to_numpy()]).astype(np.float32)
    location = frame["LOCATION"].astype("category").cat.codes.to_numpy().astype(np.int32)
    brood = frame["BROOD"].astype("category").cat.codes.to_numpy().astype(np.int32)
    clients = [VFLClient("survey", survey_x, altitude_year),
               VFLClient("sites", (location, brood), random_intercepts)]
    steps = 20_000 if args.full else (100 if args.smoke else 4_000)
    t = time.time()
    warmup = 30 if args.smoke else 500
    ref = nuts(centralised_model(clients, poisson_log), counts, warmup, warmup)
    print(f"\ngrouseticks: NUTS on the true model {time.time() - t:.0f}s")
    fits = {"true model, NUTS": ref}
    for rho in (0.5, 1.0):
        result = fit_vfl(clients, counts, poisson_log, formulation="augmented", guide="amortised",
                         rho=rho, steps=steps, optimizer=optax.adam(1e-2),
                         rng_key=jax.random.key(0))
        fits[f"augmented rho={rho}, SFVI"] = result.sample_posterior(jax.random.key(1), 2000)
    names = ["survey/beta", "sites/sd_location", "sites/sd_brood", "b"]
    print(f"{'fit':>28} " + " ".join(f"{n:>22}" for n in names))
    for label, s in fits.items():
        cells = []
        for name in names:
            v = np.asarray(s[name])
            v = v[:, 0] if v.ndim == 2 else v
            cells.append(f"{v.mean():10.3f} ({v.std():.3f})")
        print(f"{label:>28} " + " ".join(f"{c:>22}" for c in cells))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="full", action="store_false", default=False,
                      help="small size (the default), a minute or two on 2 CPU cores: N = 500, short runs")
    size.add_argument("--full", dest="full", action="store_true", default=False,
                      help="paper size: N = 2000, long runs")
    parser.add_argument("--smoke", action="store_true", help="tiny run for tests")
    args = parser.parse_args(argv)
    synthetic(args)
    grouseticks(args)


if __name__ == "__main__":
    main()
