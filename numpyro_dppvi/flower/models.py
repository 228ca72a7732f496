"""Models a node can name in its node config (``model="numpyro_dppvi.flower.models:..."``).

A node fits only the model its data holder names, imported from the node's own installed code: the
server sends the name, never code. Any importable ``"package.module:function"`` works the same way;
these are the ones the package ships (used by ``dppvi deploy demo`` and the tests).
"""

from __future__ import annotations

import numpyro
import numpyro.distributions as dist

from ..model import model


@model
def logistic_regression(x, y=None):
    """Bayesian logistic regression: ``w ~ N(0, I)``, ``b ~ N(0, 1)``, ``y_i ~ Bernoulli(sigmoid(x_i w + b))``."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)
