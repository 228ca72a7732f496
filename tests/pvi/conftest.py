import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_dppvi as dppvi


@dppvi.model
def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)


@pytest.fixture(scope="session")
def adult():
    return dppvi.datasets.load_adult(split="train_test")
