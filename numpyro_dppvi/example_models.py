"""Ready-made NumPyro models shared by the command line, the benchmarks and Flower nodes.

Any NumPyro model works with every ``fit_*``; these are the ones the package itself runs (the demo's
logistic regression on UCI Adult, the DP-PVI paper's model).
"""

from __future__ import annotations

import numpyro
import numpyro.distributions as dist

from .model_adapter import model


@model
def logistic_regression(x, y=None):
    """Bayesian logistic regression: ``w ~ N(0, I)``, ``b ~ N(0, 1)``, ``y_i ~ Bernoulli(sigmoid(x_i w + b))``."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)
