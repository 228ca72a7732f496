import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from numpyro_dppvi.privacy import (
    inclusion_threshold,
    poisson_batch,
    poisson_overflow_probability,
    poisson_pad_size,
    without_replacement_batch,
)

RUNS = 4000


def _inclusion_counts(indices, mask, n_rows):
    """How often each row was in the batch, over runs ([runs, slots] arrays)."""
    counts = np.zeros(n_rows, dtype=np.int64)
    np.add.at(counts, np.asarray(indices)[np.asarray(mask)], 1)
    return counts


def _assert_rate(counts, trials_per_row, rate):
    """Pooled inclusion rate within 5 binomial standard errors of ``rate`` (two-sided false
    alarm probability 6e-7 for an exact sampler, fixed seeds), and every row within a
    Bonferroni-corrected 1e-4 binomial interval."""
    total = counts.sum()
    trials = trials_per_row * counts.size
    se = math.sqrt(rate * (1 - rate) / trials)
    assert abs(total / trials - rate) <= 5 * se
    lo, hi = stats.binom.interval(1 - 1e-4 / counts.size, trials_per_row, rate)
    assert counts.min() >= lo and counts.max() <= hi


def test_poisson_inclusion_rate_matches_q_and_skips_padding():
    n_rows, n_valid, rate = 60, 45, 0.1
    valid = jnp.arange(n_rows) < n_valid
    keys = jax.random.split(jax.random.key(0), RUNS)
    sample = jax.jit(jax.vmap(lambda k: poisson_batch(k, valid, rate, 20)))
    indices, mask = sample(keys)
    assert indices.shape == (RUNS, 20) and mask.dtype == jnp.bool_
    counts = _inclusion_counts(indices, mask, n_rows)
    assert counts[n_valid:].sum() == 0
    # the pad of 20 overflows with probability P[Bin(45, 0.1) > 20] ~ 1e-8: rate is exact
    _assert_rate(counts[:n_valid], RUNS, rate)
    # no row twice in a batch
    for row_indices, row_mask in zip(np.asarray(indices[:200]), np.asarray(mask[:200])):
        chosen = row_indices[row_mask]
        assert len(set(chosen.tolist())) == chosen.size


def test_inclusion_probability_never_exceeds_the_accounted_rate():
    rates = np.concatenate([[1.0, 0.5, 1 / 3, 0.1, 0.01, 1e-4, 1 - 1e-9],
                            np.random.default_rng(0).uniform(1e-6, 1.0, 200)])
    thresholds = np.asarray(jax.vmap(inclusion_threshold)(jnp.asarray(rates, jnp.float32)))
    realised = thresholds.astype(np.float64) / 2.0**32
    assert np.all(realised <= rates)
    assert np.all(realised >= rates * (1 - 1e-6) - 2e-7)  # float32 rate rounding


def test_poisson_overflow_keeps_a_random_subset_of_the_pad_size():
    indices, mask = jax.jit(lambda k: poisson_batch(k, 30, 0.9, 5))(jax.random.key(1))
    assert bool(mask.all())
    assert len(set(np.asarray(indices).tolist())) == 5
    # overflow rule: uniformly random subset -> each row kept about equally often
    keys = jax.random.split(jax.random.key(2), RUNS)
    idx, msk = jax.jit(jax.vmap(lambda k: poisson_batch(k, 10, 1.0, 3)))(keys)
    counts = _inclusion_counts(idx, msk, 10)
    _assert_rate(counts, RUNS, 0.3 * (1 - 2.0**-20))


def test_pad_larger_than_the_client_is_masked():
    indices, mask = poisson_batch(jax.random.key(3), 4, 1.0, 7)
    assert indices.shape == (7,) and int(mask.sum()) == 4
    assert set(np.asarray(indices)[np.asarray(mask)].tolist()) == {0, 1, 2, 3}
    assert np.all(np.asarray(indices) < 4)


def test_pad_size_meets_the_overflow_tolerance_and_is_smallest():
    for n, rate, steps in [(1000, 0.01, 1000), (40000, 0.01, 100), (50, 0.5, 10)]:
        pad = poisson_pad_size(n, rate, steps, overflow_tolerance=1e-12)
        assert steps * poisson_overflow_probability(n, rate, pad) <= 1e-12
        assert steps * poisson_overflow_probability(n, rate, pad - 1) > 1e-12
        assert poisson_overflow_probability(n, rate, pad) == pytest.approx(
            stats.binom.sf(pad, n + 1, rate), rel=1e-12)  # the neighbour may hold n + 1 rows
    assert poisson_pad_size(3, 0.9, 1, 1e-12) == 4
    assert poisson_overflow_probability(3, 0.9, 4) == 0.0


def test_without_replacement_is_fixed_size_uniform_and_skips_padding():
    n_rows, n_valid, batch = 40, 25, 5
    valid = jnp.arange(n_rows) < n_valid
    keys = jax.random.split(jax.random.key(4), RUNS)
    indices, mask = jax.jit(jax.vmap(lambda k: without_replacement_batch(k, valid, batch)))(keys)
    assert bool(mask.all())
    ids = np.asarray(indices)
    assert ids.max() < n_valid
    assert all(len(set(row.tolist())) == batch for row in ids[:500])
    counts = _inclusion_counts(indices, mask, n_rows)
    _assert_rate(counts[:n_valid], RUNS, batch / n_valid)
    # pairs appear with the uniform-subset probability b(b-1) / (n(n-1)) (spot check)
    both = np.mean([(0 in row) and (1 in row) for row in ids.tolist()])
    p_pair = batch * (batch - 1) / (n_valid * (n_valid - 1))
    assert abs(both - p_pair) <= 5 * math.sqrt(p_pair * (1 - p_pair) / RUNS)


def test_samplers_vmap_over_clients_with_different_sizes_and_rates():
    masks = jnp.arange(50)[None, :] < jnp.array([[20], [50], [35]])
    keys = jax.random.split(jax.random.key(5), 3)
    rates = jnp.array([0.2, 0.1, 0.3])
    idx, msk = jax.jit(jax.vmap(lambda k, m, r: poisson_batch(k, m, r, 30)))(keys, masks, rates)
    for c, n in enumerate([20, 50, 35]):
        assert np.all(np.asarray(idx[c])[np.asarray(msk[c])] < n)
    idx, msk = jax.jit(jax.vmap(lambda k, m: without_replacement_batch(k, m, 10)))(keys, masks)
    assert bool(msk.all())
    for c, n in enumerate([20, 50, 35]):
        assert np.asarray(idx[c]).max() < n


def test_fresh_keys_give_fresh_batches():
    a, _ = without_replacement_batch(jax.random.key(6), 1000, 10)
    b, _ = without_replacement_batch(jax.random.key(7), 1000, 10)
    assert set(np.asarray(a).tolist()) != set(np.asarray(b).tolist())


@pytest.mark.parametrize("call,error,match", [
    (lambda: poisson_batch(jax.random.key(0), 10, 1.5, 3), ValueError, "rate"),
    (lambda: poisson_batch(jax.random.key(0), 10, 0.1, 0), ValueError, "max_batch"),
    (lambda: poisson_batch(jax.random.key(0), 10, 0.1, 2.0), TypeError, "max_batch"),
    (lambda: poisson_batch(jax.random.key(0), jnp.ones(5), 0.1, 2), TypeError, "boolean"),
    (lambda: without_replacement_batch(jax.random.key(0), 4, 5), ValueError, "exceeds"),
    (lambda: poisson_pad_size(10, 0.1, 1, 0.0), ValueError, "overflow_tolerance"),
])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()
