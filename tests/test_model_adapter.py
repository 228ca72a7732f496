import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax.scipy.stats import norm

import numpyro_dppvi as dppvi
from numpyro_dppvi.model_adapter import ModelAdapter


@dppvi.model
def regression(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([x.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, sigma), obs=y)


def data(n=6, d=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=n).astype(np.float32)


def test_sites_layout_and_prior_classification():
    a = ModelAdapter(regression, data())
    assert a.plate == "data"
    assert [s.name for s in a.sites] == ["w", "sigma"]
    assert a.dim == 4 and a.observed == ("y",)
    np.testing.assert_allclose(a.prior.eta2, [-0.125, -0.125, -0.125, 0.0])
    np.testing.assert_array_equal(a.server_mask, [False, False, False, True])
    values = a.constrain(jnp.array([0.1, 0.2, 0.3, jnp.log(2.0)]))
    np.testing.assert_allclose(values["sigma"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(a.unconstrain(values), [0.1, 0.2, 0.3, jnp.log(2.0)], rtol=1e-6)


def test_per_example_log_lik_matches_formula_under_jit():
    x, y = data()
    a = ModelAdapter(regression, (x, y))
    u = jnp.array([0.5, -1.0, 0.2, jnp.log(0.7)])
    got = jax.jit(a.log_lik_rows)(u, (x, y))
    want = norm.logpdf(y, x @ u[:3], 0.7)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # no Jacobian and no prior in the likelihood term
    assert got.shape == (x.shape[0],)


def test_server_density_includes_jacobian():
    a = ModelAdapter(regression, data())
    u = jnp.array([0.0, 0.0, 0.0, 0.3])
    want = dist.HalfNormal(1.0).log_prob(jnp.exp(0.3)) + 0.3
    np.testing.assert_allclose(a.server_log_density(u), want, rtol=1e-5)


def test_named_privacy_plate():
    @dppvi.model(privacy_plate="rows")
    def m(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
        with numpyro.plate("rows", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    x, y = data()
    assert ModelAdapter(m, (x, (y > 0).astype(np.float32))).plate == "rows"


def test_error_latent_inside_privacy_plate():
    @dppvi.model
    def m(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Normal(w + z, 1.0), obs=y)

    with pytest.raises(ValueError, match="latent site 'z' is inside the privacy plate"):
        ModelAdapter(m, data(d=1))


def test_error_discrete_latent():
    @dppvi.model
    def m(x, y=None):
        k = numpyro.sample("k", dist.Bernoulli(0.5))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(k * 1.0, 1.0), obs=y)

    with pytest.raises(ValueError, match="latent site 'k' is discrete"):
        ModelAdapter(m, data(d=1))


def test_error_no_observed_site():
    @dppvi.model
    def m(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.deterministic("mu", w * x[:, 0])

    with pytest.raises(ValueError, match="no observed site"):
        ModelAdapter(m, data(d=1))


def test_error_leading_dimensions_disagree():
    x, y = data()
    with pytest.raises(ValueError, match="leading"):
        ModelAdapter(regression, (x, y[:-1]))


def test_error_no_privacy_plate():
    @dppvi.model
    def m(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(w, 1.0).expand([x.shape[0]]).to_event(1), obs=y)

    with pytest.raises(ValueError, match="no privacy plate"):
        ModelAdapter(m, data(d=1))


def test_hierarchical_normal_prior_goes_to_server_factor():
    @dppvi.model
    def m(x, y=None):
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        w = numpyro.sample("w", dist.Normal(0.0, tau))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(w * x[:, 0], 1.0), obs=y)

    a = ModelAdapter(m, data(d=1))
    assert not any(s.gaussian_prior for s in a.sites)  # w's prior depends on tau


@pytest.mark.parametrize("rows", [1, 2])
def test_fewer_than_three_rows_trace_the_same_structure(rows):
    """Issue 15: tiny federated data (a client of 1-2 rows, or 2 rows in all) must trace; the rows
    are repeated up to three, since only their shapes matter to the model's structure."""
    x, y = data()
    full = ModelAdapter(regression, (x, y))
    small = ModelAdapter(regression, (x[:rows], y[:rows]))
    assert small.plate == full.plate and small.dim == full.dim and small.observed == full.observed
    assert [(s.name, s.shape) for s in small.sites] == [(s.name, s.shape) for s in full.sites]
    np.testing.assert_array_equal(small.server_mask, full.server_mask)
    np.testing.assert_allclose(small.prior.eta2, full.prior.eta2)
    u = jnp.array([0.5, -1.0, 0.2, jnp.log(0.7)])
    np.testing.assert_allclose(small.log_lik_rows(u, (x, y)), full.log_lik_rows(u, (x, y)), rtol=1e-6)


def test_error_no_rows():
    x, y = data()
    with pytest.raises(ValueError, match="at least one row"):
        ModelAdapter(regression, (x[:0], y[:0]))


def test_normal_parent_of_a_non_gaussian_site_joins_the_server_mask():
    """Issue 15: ``mu`` has an exact Normal prior but ``log p(a | mu, tau)`` depends on it; that term is
    held by the server factor, so ``mu``'s coordinate must be in the server's mask (before the fix
    ``mu`` kept its prior N(0, 5) whatever the data). ``w``, whose prior no other site uses, stays out."""

    @dppvi.model
    def m(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        a = numpyro.sample("a", dist.Normal(mu, tau).expand([2]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(w * x[:, 0] + a[0], 1.0), obs=y)

    adapter = ModelAdapter(m, data(d=1))
    assert [s.name for s in adapter.sites] == ["w", "mu", "tau", "a"]
    assert [s.gaussian_prior for s in adapter.sites] == [True, True, False, False]
    np.testing.assert_array_equal(adapter.server_mask, [False, True, True, True, True])
    np.testing.assert_allclose(adapter.prior.eta2[:2], [-0.5, -0.5 / 25])  # mu's Normal prior stays exact


@pytest.mark.parametrize("persist", [False, True])
def test_traces_take_latent_values_from_the_host_and_still_tell_dependent_priors(persist, tmp_path, monkeypatch):
    """The adapter's traces give latent sites host-drawn values in their supports (``reference_values``), so the
    traced program holds no random-number generator (compiling one was most of the traces' cost in a new
    process); eager and compiled traces agree, two seeds give two values, and a prior whose parameters are other
    latents' values, or the difference of two sites with the same prior (one constant would cancel it), is still
    told from a constant one."""
    from numpyro_dppvi import model_adapter
    from numpyro_dppvi.model_adapter import _trace, compiled_traces, reference_values

    @dppvi.model
    def differences(x, y=None):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        w = numpyro.sample("w", dist.Normal(a - b, 1.0).expand([x.shape[1]]).to_event(1))
        scale = numpyro.sample("scale", dist.LogNormal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, scale), obs=y)

    x, y = data()
    monkeypatch.setattr(model_adapter, "programs_persist", lambda: persist)
    adapter = ModelAdapter(differences, (x, y))
    assert [s.gaussian_prior for s in adapter.sites] == [True, True, False, False]
    primitives = {e.primitive.name for e in jax.make_jaxpr(lambda x, y: [
        site["value"] for site in _trace(differences, (x, y), 0).values() if site["type"] == "sample"])(x, y).eqns}
    assert not primitives & {"random_bits", "threefry2x32", "random_split", "random_fold_in"}, primitives
    eager = [_trace(differences, (jnp.asarray(x[:3]), jnp.asarray(y[:3])), seed) for seed in (0, 1)]
    compiled = compiled_traces(differences, [((jnp.asarray(x[:3]), jnp.asarray(y[:3])), seed) for seed in (0, 1)])
    for e, c in zip(eager, compiled):
        for name in ("a", "b", "w", "scale"):
            np.testing.assert_allclose(np.asarray(e[name]["value"]), np.asarray(c[name]["value"]), rtol=1e-6)
    assert float(eager[0]["a"]["value"]) != float(eager[1]["a"]["value"])
    assert float(eager[0]["scale"]["value"]) > 0
    assert reference_values(0)({"type": "sample", "is_observed": True, "fn": dist.Normal(), "name": "y"}) is None
    assert reference_values(0)({"type": "sample", "is_observed": False, "fn": dist.Poisson(1.0), "name": "k",
                                "kwargs": {}}) is None
