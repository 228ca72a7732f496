"""Sensitivity of every ESS block on neighbouring datasets, against the declared bound.

Two checks per model:
1. the raw per-record statistics of valid records never exceed the declared block bounds
   (the paper's sensitivity derivations, e.g. E[omega] <= 1/4), for records built to be
   extreme and for random states of q;
2. after clipping, adding one record to a batch (add/remove neighbours) changes every block
   sum by at most its bound, and the bound-rescaled joint vector by at most sqrt(B); replacing
   one record (substitution) changes it by at most 2 sqrt(B).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_dppvi.vips import (
    BayesianLinearRegression, BetaBernoulli, DirichletCategorical, GammaPoisson,
    NormalGammaLinearRegression, PolyaGammaLogisticRegression)
from numpyro_dppvi.vips.engine import block_norms, joint_sensitivity
from numpyro_dppvi.vips.lda import LDA
from numpyro_dppvi.vips.sbn import SigmoidBeliefNet

RNG = np.random.default_rng(0)


def _random_params(model, key):
    """A data-independent random q: the model's prior pushed by a random pseudo-update."""
    params = model.init_params(key)
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    # multiply every natural parameter by a random positive factor (keeps precisions PD)
    leaves = [leaf * jnp.exp(0.5 * jax.random.normal(k, ())) for leaf, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, leaves)


def _cases():
    d = 4
    x_big = RNG.normal(size=(16, d)) * 5.0  # far outside the unit ball before projection
    y_big = RNG.normal(size=16) * 10.0
    yield "linear", BayesianLinearRegression(d, 0.5, feature_bound=1.0, target_bound=2.0), (x_big, y_big)
    yield "normal_gamma", NormalGammaLinearRegression(d, feature_bound=1.0, target_bound=2.0), (x_big, y_big)
    yield "logistic", PolyaGammaLogisticRegression(d, hyperprior=(1.0, 1.0), feature_bound=1.0), \
        (x_big, (RNG.random(16) < 0.5).astype(float))
    yield "beta_binomial", BetaBernoulli(1.0, 1.0, total_count=3), (RNG.integers(0, 4, 16).astype(float),)
    yield "dirichlet", DirichletCategorical(np.ones(5)), (RNG.integers(0, 5, 16),)
    yield "gamma_poisson", GammaPoisson(count_bound=5.0), (RNG.poisson(8.0, 16).astype(float),)
    ids = np.tile(np.arange(6), (16, 1))
    counts = np.zeros((16, 6))
    counts[:, 0] = 20.0  # every token the same word: the worst case of Eq. 28
    counts[::2] = RNG.multinomial(20, np.ones(6) / 6, size=8)
    yield "lda", LDA(3, 10, doc_length=20, inner_iterations=5), (ids, counts)
    yield "sbn", SigmoidBeliefNet(12, 3, inner_iterations=2), ((RNG.random((16, 12)) < 0.5).astype(float),)


CASES = list(_cases())
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("name,model,data", CASES, ids=IDS)
def test_raw_statistics_respect_declared_bounds(name, model, data):
    data = model.validate_data(data)
    bounds = model.block_bounds
    statistics = jax.jit(lambda p: jax.vmap(model.example_ess, in_axes=(None, 0))(
        model.expected_natural_params(p), data))
    for seed in range(3):
        per_example = statistics(_random_params(model, jax.random.key(seed)))
        for block, norms in block_norms(per_example).items():
            assert float(jnp.max(norms)) <= bounds[block] * (1 + 1e-5), (name, block)


def _rescaled_joint(ess, bounds):
    return jnp.concatenate([jnp.ravel(ess[b]) / bounds[b] for b in sorted(bounds)])


@pytest.mark.parametrize("name,model,data", CASES, ids=IDS)
@pytest.mark.parametrize("factor", [0.3])  # clipping active; factor 1 is covered by the raw-bound test
def test_neighbouring_batches_move_the_clipped_sum_by_at_most_the_bound(name, model, data, factor):
    data = model.validate_data(data)
    bounds = {b: c * factor for b, c in model.block_bounds.items()}  # Privacy.clip = factor
    enp = model.expected_natural_params(_random_params(model, jax.random.key(1)))
    n = data[0].shape[0]
    full = jnp.ones(n, dtype=bool)

    def ess_sum(arrays, mask):
        return model.clipped_ess_sum(enp, arrays, mask, bounds)[0]

    def removed(i):  # add/remove neighbour: record i left out
        return ess_sum(data, full.at[i].set(False))

    def replaced(i):  # substitution neighbour: record i replaced by record i + 7
        return ess_sum(tuple(a.at[i].set(a[(i + 7) % n]) for a in data), full)

    base = jax.jit(ess_sum)(data, full)
    rows = jnp.arange(n)
    without = jax.jit(jax.vmap(removed))(rows)
    swapped = jax.jit(jax.vmap(replaced))(rows)
    for block in bounds:
        diff = jnp.sqrt(jnp.sum(jnp.reshape(base[block][None] - without[block], (n, -1)) ** 2, axis=1))
        assert float(jnp.max(diff)) <= bounds[block] * (1 + 1e-5), (name, block)

    def joint(ess):
        return jnp.concatenate([jnp.reshape(ess[b], (n, -1)) / bounds[b] for b in sorted(bounds)], axis=1)

    base_joint = jnp.concatenate([jnp.ravel(base[b]) / bounds[b] for b in sorted(bounds)])
    worst_add = float(jnp.max(jnp.linalg.norm(base_joint[None] - joint(without), axis=1)))
    worst_sub = float(jnp.max(jnp.linalg.norm(base_joint[None] - joint(swapped), axis=1)))
    assert worst_add <= joint_sensitivity(bounds) * (1 + 1e-5)
    assert worst_sub <= 2 * joint_sensitivity(bounds) * (1 + 1e-5)


def test_lda_worst_case_document_reaches_the_bound():
    """All N tokens on one word and a hard topic assignment: |s^d| = N (Eq. 28 is tight)."""
    model = LDA(2, 4, doc_length=10, inner_iterations=20)
    lam = jnp.array([[1000.0, 1e-3, 1e-3, 1e-3], [1e-3, 1000.0, 1000.0, 1000.0]])
    enp = model.expected_natural_params({"lam": lam})
    ess = model.example_ess(enp, (jnp.array([0, 1]), jnp.array([10.0, 0.0])))
    assert float(jnp.linalg.norm(ess["topic_word"])) == pytest.approx(10.0, rel=1e-3)


def test_logistic_bound_is_attained_at_zero_second_moment():
    """E[omega] = 1/4 when x^T E[ww^T] x = 0, so |s2| = |x|^2 / 4 reaches B^2/4 (Eq. 59)."""
    model = PolyaGammaLogisticRegression(2, feature_bound=1.0)
    enp = {"mean": jnp.zeros(2), "second_moment": jnp.zeros((2, 2))}
    ess = model.example_ess(enp, (jnp.array([3.0, 4.0]), jnp.array(1.0)))
    assert float(jnp.linalg.norm(ess["s2"])) == pytest.approx(0.25, rel=1e-6)
    assert float(jnp.linalg.norm(ess["s1"])) == pytest.approx(0.5, rel=1e-6)


def test_joint_sensitivity_is_sqrt_of_number_of_blocks():
    assert joint_sensitivity({"a": 3.0, "b": 0.1, "c": 7.0}) == pytest.approx(math.sqrt(3))
