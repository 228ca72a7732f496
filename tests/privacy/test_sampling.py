import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from numpyro_dppvi.privacy import noise
from numpyro_dppvi.privacy.sampling import GAP_DEVIATION, _uniform_from_bits
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
        assert steps * stats.binom.sf(pad, n + 1, rate) <= 1e-12  # the neighbour may hold n + 1 rows
        assert steps * stats.binom.sf(pad - 1, n + 1, rate) > 1e-12
        # the charged per-step probability: the overflow plus the geometric skips' deviation bound
        assert poisson_overflow_probability(n, rate, pad) == pytest.approx(
            stats.binom.sf(pad, n + 1, rate) + pad * GAP_DEVIATION / rate, rel=1e-12)
    assert poisson_pad_size(3, 0.9, 1, 1e-12) == 4
    assert poisson_overflow_probability(3, 0.9, 4) == 4 * GAP_DEVIATION / 0.9  # no overflow: the deviation only


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


def test_skip_sampler_batch_sizes_are_binomial():
    """The number of rows drawn is Binomial(n, q') (chi-square over 20000 draws, bins with expected
    count >= 5 merged; the 1e-3 critical value of the statistic): Poisson sampling, by skips."""
    n, rate, runs = 200, 0.07, 20000
    keys = jax.random.split(jax.random.key(11), runs)
    _, mask = jax.jit(jax.vmap(lambda k: poisson_batch(k, n, rate, 60)))(keys)
    sizes = np.asarray(mask).sum(axis=1)
    observed = np.bincount(sizes, minlength=61)[:61]
    expected = stats.binom.pmf(np.arange(61), n, rate * (1 - 2.0**-30)) * runs
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], runs - expected[keep].sum())
    chi2 = np.sum((obs - exp) ** 2 / exp)
    assert chi2 < stats.chi2.ppf(1 - 1e-3, df=len(obs) - 1)


def test_skip_sampler_pairs_are_independent():
    """Inclusion of rows 0 and 1 (adjacent: one geometric gap apart) is independent: P(both) = q^2
    within 5 binomial standard errors over 40000 draws."""
    n, rate, runs = 30, 0.3, 40000
    keys = jax.random.split(jax.random.key(12), runs)
    idx, mask = jax.jit(jax.vmap(lambda k: poisson_batch(k, n, rate, 30)))(keys)
    idx, mask = np.asarray(idx), np.asarray(mask)
    both = np.mean([(0 in i[m]) and (1 in i[m]) for i, m in zip(idx, mask)])
    assert abs(both - rate**2) <= 5 * math.sqrt(rate**2 * (1 - rate**2) / runs)


def test_the_float64_functions_meet_the_charged_deviation_assumptions():
    """The skip sampler's deviation bound assumes log within 1 ulp and log1p(-q) within 2^-40
    relative (XLA, float64, on this backend); and that the uniform has the stated resolution."""
    rng = np.random.default_rng(0)
    u = np.concatenate([rng.uniform(1e-300, 1.0, 20000), np.exp(-rng.uniform(0, 700, 20000))])
    q = np.concatenate([rng.uniform(0.0, 1.0, 20000), np.exp(-rng.uniform(0, 40, 20000))])
    with noise._x64():
        log_u = np.asarray(jax.jit(jnp.log)(jnp.asarray(u, jnp.float64)))
        log_keep = np.asarray(jax.jit(lambda x: jnp.log1p(-x))(jnp.asarray(q, jnp.float64)))
        words = jnp.asarray(rng.integers(0, 2**32, size=(4, 10000), dtype=np.uint64).astype(np.uint32))
        uniform = np.asarray(_uniform_from_bits(words))
    assert np.max(np.abs(log_u - np.log(u)) / np.spacing(np.abs(np.log(u)))) <= 1.0
    exact = np.log1p(-q)
    ok = exact != 0
    assert np.max(np.abs(log_keep[ok] - exact[ok]) / np.abs(exact[ok])) < 2.0**-40
    assert np.all((uniform > 0) & (uniform <= 1))
    assert abs(np.mean(uniform) - 0.5) < 5 * math.sqrt(1 / 12 / 10000)


@pytest.mark.parametrize("sampler", ["walk", "rows"])
def test_poisson_fold_is_poisson_sampling_without_a_pad(sampler):
    """Folding over chunks draws every valid row with probability q', never a padding row, never a row
    twice, whatever the sample size (no pad, no truncation); batch sizes are Binomial(n, q')
    (chi-square, as above), also when the sample is much larger than one chunk. The same for the row
    sampler (``row_fold``: each row on its own 32 bits, ``q' = t / 2^32`` with ``t = inclusion_threshold(q)``,
    within ``2^-20`` relative of ``q(1 - 2^-30)``, far below what 4000 runs resolve)."""
    from numpyro_dppvi.privacy.sampling import poisson_fold, row_fold

    fold = {"walk": poisson_fold, "rows": row_fold}[sampler]
    n_rows, n_valid, rate, chunk, runs = 64, 50, 0.3, 4, 4000
    valid = jnp.arange(n_rows) < n_valid

    def rows_of(key):
        def add(carry, idx, m):
            counts, seen_twice = carry
            hits = jnp.zeros(n_rows, jnp.int32).at[idx].add(m.astype(jnp.int32))
            return counts + hits, seen_twice | jnp.any(counts + hits > 1)
        return fold(key, valid, rate, chunk, add, (jnp.zeros(n_rows, jnp.int32), jnp.array(False)))

    counts, twice = jax.jit(jax.vmap(rows_of))(jax.random.split(jax.random.key(13), runs))
    counts = np.asarray(counts)
    assert not np.any(np.asarray(twice)) and counts[:, n_valid:].sum() == 0
    _assert_rate(counts[:, :n_valid].sum(axis=0), runs, rate)
    sizes = counts.sum(axis=1)
    observed = np.bincount(sizes, minlength=n_valid + 1)
    expected = stats.binom.pmf(np.arange(n_valid + 1), n_valid, rate * (1 - 2.0**-30)) * runs
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], runs - expected[keep].sum())
    assert np.sum((obs - exp) ** 2 / exp) < stats.chi2.ppf(1 - 1e-3, df=len(obs) - 1)


def test_the_row_sampler_draws_rows_independently():
    """``row_fold``: inclusion of rows 0 and 1 is independent (``P(both) = q^2`` within 5 binomial standard
    errors over 40,000 draws), as the skip sampler's (above)."""
    from numpyro_dppvi.privacy.sampling import row_fold

    n, rate, runs = 30, 0.3, 40000
    valid = jnp.ones(n, bool)

    def first_two(key):
        add = lambda c, idx, m: c + jnp.zeros(n, jnp.int32).at[idx].add(m.astype(jnp.int32))[:2]
        return row_fold(key, valid, rate, 8, add, jnp.zeros(2, jnp.int32))

    hits = np.asarray(jax.jit(jax.vmap(first_two))(jax.random.split(jax.random.key(14), runs)))
    both = np.mean(hits.min(axis=1) == 1)
    assert abs(both - rate**2) <= 5 * math.sqrt(rate**2 * (1 - rate**2) / runs)
