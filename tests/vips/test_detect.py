"""Conjugacy detection: one test per supported pattern and one per rejection message."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from numpyro_dppvi.vips import fit_vips
from numpyro_dppvi.vips.detect import detect_conjugate


def _fit(model, *data):
    return fit_vips(model, data, iterations=1, kappa=0.0, rng_key=jax.random.key(0))


# ----------------------------------------------------------------------------- patterns

def linreg(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(1.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b + 0.5, 0.3), obs=y)


def test_normal_linear_pattern_gives_the_exact_posterior():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(60, 2))
        y = x @ np.array([1.0, -1.0]) + 0.2 + 0.3 * rng.normal(size=60)
        det = detect_conjugate(linreg, x, y)
        assert det.pattern == "normal_linear" and det.latent_sites == ("w", "b")
        result = _fit(linreg, x, y)
        design = np.column_stack([x, np.ones(60)])
        prec0 = np.diag([0.25, 0.25, 1.0])
        precision = prec0 + design.T @ design / 0.09
        mean = np.linalg.solve(precision, prec0 @ np.array([0.0, 0.0, 1.0]) + design.T @ (y - 0.5) / 0.09)
        q = result.model.posterior_distribution(result.params)
        np.testing.assert_allclose(q.loc, mean, rtol=1e-6)
        np.testing.assert_allclose(q.precision_matrix, precision, rtol=1e-6)
        samples = result.posterior_samples(50)
        assert samples["w"].shape == (50, 2) and samples["b"].shape == (50,)


def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def test_logistic_pattern_and_predictive():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 3))
    y = (rng.random(400) < 1 / (1 + np.exp(-x @ np.array([2.0, -1.0, 0.0])))).astype(np.float32)
    det = detect_conjugate(logistic, x, y)
    assert det.pattern == "logistic"
    result = fit_vips(logistic, (x, y), iterations=30, kappa=0.0, rng_key=jax.random.key(0))
    mean = result.posterior_samples(2000)["w"].mean(0)
    # 400 rows: posterior sd of each weight is about 0.15; 4 sd = 0.6.
    np.testing.assert_allclose(mean, [2.0, -1.0, 0.0], atol=0.6)
    pred = result.predict(x[:5], num_samples=100)
    assert pred["y"].shape == (100, 5)


def beta_bernoulli(y=None):
    p = numpyro.sample("p", dist.Beta(2.0, 3.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)


def beta_binomial(y=None):
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Binomial(4, probs=p), obs=y)


def test_beta_bernoulli_and_binomial_patterns():
    y = np.array([1, 0, 1, 1, 0, 1.0])
    result = _fit(beta_bernoulli, y)
    assert result.params["alpha"] == pytest.approx(2.0 + 4) and result.params["beta"] == pytest.approx(3.0 + 2)
    y4 = np.array([0, 4, 2, 3.0])
    result = _fit(beta_binomial, y4)
    assert result.params["alpha"] == pytest.approx(1 + 9) and result.params["beta"] == pytest.approx(1 + 7)
    assert result.to_arviz(12).posterior["p"].shape == (4, 3)


def dirichlet_categorical(y=None):
    p = numpyro.sample("p", dist.Dirichlet(np.ones(3)))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Categorical(probs=p), obs=y)


def test_dirichlet_categorical_pattern():
    y = np.array([0, 2, 2, 1, 2])
    result = _fit(dirichlet_categorical, y)
    np.testing.assert_allclose(result.params["concentration"], [2.0, 2.0, 4.0])


def gamma_poisson(y=None):
    lam = numpyro.sample("lam", dist.Gamma(2.0, 1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(lam), obs=y)


def test_gamma_poisson_pattern():
    y = np.array([3, 0, 5, 2.0])
    result = _fit(gamma_poisson, y)
    assert result.params["concentration"] == pytest.approx(12.0) and result.params["rate"] == pytest.approx(5.0)


# ----------------------------------------------------------------------------- rejections

def unknown_scale(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.Normal(1.0, 0.1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, sigma), obs=y)


def nonlinear_mean(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(jax.numpy.exp(x @ w), 1.0), obs=y)


def halfnormal_prior(x, y=None):
    w = numpyro.sample("w", dist.HalfNormal(1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def logit_offset(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + 1.0), obs=y)


def beta_poisson(y=None):
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(p), obs=y)


def scaled_rate(y=None):
    lam = numpyro.sample("lam", dist.Gamma(1.0, 1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(2.0 * lam), obs=y)


def student_t(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.StudentT(3.0, x @ w, 1.0), obs=y)


def local_latent(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(x @ w + z, 1.0), obs=y)


def two_betas(y=None):
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    q = numpyro.sample("q", dist.Beta(1.0, 1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p * q), obs=y)


def categorical_logits(y=None):
    p = numpyro.sample("p", dist.Dirichlet(np.ones(3)))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=p), obs=y)


def no_plate(y=None):
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    numpyro.sample("y", dist.Bernoulli(probs=p).expand([y.shape[0]]).to_event(1), obs=y)


X = np.random.default_rng(2).normal(size=(12, 2))
Y_REAL = np.random.default_rng(3).normal(size=12)
Y_BIN = (Y_REAL > 0).astype(float)
Y_COUNT = np.arange(12.0) % 4


@pytest.mark.parametrize("model,data,message", [
    (unknown_scale, (X, Y_REAL), r"site 'y': the Normal scale depends on a latent site"),
    (nonlinear_mean, (X, Y_REAL), r"site 'y': the Normal mean is not linear in the latent sites \['w'\]"),
    (halfnormal_prior, (X, Y_REAL), r"site 'w': prior HalfNormal is not conjugate to the Normal"),
    (logit_offset, (X, Y_BIN), r"site 'y': the logits have a constant part"),
    (beta_poisson, (Y_COUNT,), r"site 'p': prior Beta is not conjugate to the Poisson likelihood of site 'y'"),
    (scaled_rate, (Y_COUNT,), r"site 'y': the Poisson rate must be the Gamma site 'lam' itself"),
    (student_t, (X, Y_REAL), r"site 'y': likelihood StudentT has no supported conjugate pattern"),
    (local_latent, (X, Y_REAL), r"site 'z' is a latent variable inside the privacy plate 'data'"),
    (two_betas, (Y_BIN,), r"site 'y': a BernoulliProbs likelihood is conjugate to one Beta site"),
    (categorical_logits, (Y_COUNT % 3,), r"site 'y': CategoricalLogits is not conjugate"),
    (no_plate, (Y_BIN,), r"cannot tell which plate holds the individuals"),
])
def test_rejections_name_the_site_and_reason(model, data, message):
    with pytest.raises(ValueError, match=message):
        detect_conjugate(model, *data)


def test_privacy_plate_marker_is_honoured():
    def model(y=None):
        p = numpyro.sample("p", dist.Beta(1.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)

    model._dppvi_privacy_plate = "individuals"
    with pytest.raises(ValueError, match="privacy plate 'individuals' was requested"):
        detect_conjugate(model, Y_BIN)


# ----------------------------------------------------------------------------- offset tolerance

def logistic_plus(offset):
    """``logits = x @ w + offset`` with ``offset`` a constant (not a latent site)."""
    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w + offset), obs=y)
    return model


def logistic_plus_data_offset(x, offset, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + offset), obs=y)


def test_wide_float32_design_of_varied_magnitude_is_accepted():
    # 200 features whose scales span 1e-2 .. 1e2: the float32 rounding error of x @ w reaches ~2e-4,
    # far above the old fixed atol of 1e-6, and must not be mistaken for an offset.
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(300, 200)) * 10.0 ** rng.uniform(-2, 2, size=200)).astype(np.float32)
    y = (rng.random(300) < 0.5).astype(np.float32)
    det = detect_conjugate(logistic, x, y)
    assert det.pattern == "logistic" and det.data[0].shape == (300, 200)
    np.testing.assert_array_equal(np.asarray(det.data[0]), x)  # the design is the data, unchanged


def test_uci_adult_is_accepted():
    from numpyro_dppvi.datasets import load_adult

    x, y, _, _ = load_adult(split="train_test")
    det = detect_conjugate(logistic, x, y)
    assert det.pattern == "logistic" and det.data[0].shape == x.shape


@pytest.mark.parametrize("offset", [3.0, 1e-3, -1e-3])
def test_constant_offsets_are_still_rejected(offset):
    # logits of magnitude ~1 (3 features of sd 0.5, w ~ N(0, 1)); the rounding bound is ~1e-7 here
    rng = np.random.default_rng(5)
    x = (0.5 * rng.normal(size=(200, 3))).astype(np.float32)
    y = (rng.random(200) < 0.5).astype(np.float32)
    with pytest.raises(ValueError, match=r"site 'y': the logits have a constant part not multiplied by a latent"):
        detect_conjugate(logistic_plus(offset), x, y)


def test_per_row_offset_passed_as_data_is_rejected():
    rng = np.random.default_rng(6)
    x = (0.5 * rng.normal(size=(200, 3))).astype(np.float32)
    b = np.zeros(200, np.float32)
    b[17] = 1e-3  # one row only
    y = (rng.random(200) < 0.5).astype(np.float32)
    with pytest.raises(ValueError, match=r"site 'y': the logits have a constant part"):
        detect_conjugate(logistic_plus_data_offset, x, b, y)
    detect_conjugate(logistic_plus_data_offset, x, np.zeros(200, np.float32), y)  # no offset: accepted
