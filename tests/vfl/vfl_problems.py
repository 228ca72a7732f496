"""Small vertical problems shared by the VFL tests (sub-models, likelihoods, splits)."""

import numpy as np
import numpyro
import numpyro.distributions as dist

from numpyro_dppvi.vfl import VFLClient


def linear_submodel(x):
    """``g_j = x_j beta_j`` with ``beta_j ~ N(0, 1)``."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    return x @ beta


def logistic_likelihood(eta, y):
    """``y ~ Bernoulli(logit = b + eta)``, ``b ~ N(0, 1)``."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", eta.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b + eta), obs=y)


def gaussian_likelihood(eta, y):
    """``y ~ N(b + eta, sigma)``, ``b ~ N(0, 1)``, ``sigma ~ HalfNormal(1)``."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", eta.shape[0]):
        numpyro.sample("y", dist.Normal(b + eta, sigma), obs=y)


def make_split(x, sizes, submodel=linear_submodel):
    """Clients ``c0, c1, ...`` holding consecutive blocks of ``sizes`` columns."""
    edges = np.cumsum([0, *sizes])
    return [VFLClient(f"c{j}", x[:, a:b], submodel)
            for j, (a, b) in enumerate(zip(edges[:-1], edges[1:]))]


