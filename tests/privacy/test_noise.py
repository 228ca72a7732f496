"""The float64 Gaussian sampler of every privacy release (issue 11, finding 4).

``jax.random.normal`` in float32 cannot draw beyond +5.2 / -5.4 sd: a release whose noise never
exceeds that is distinguishable from the Gaussian the accountant assumed with probability ~1e-5 per
release at noise multiplier 1. These tests measure the new sampler's tail support through its
bits-to-value map (no gap before 10 sd), its accuracy against SciPy's quantile function, its
distribution on a million draws, and the tail mass the ledger charges for it.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

from numpyro_dppvi import program_cache
from numpyro_dppvi.privacy import GaussianEvent, PrivacyLedger, add_gaussian_noise, add_symmetric_noise
from numpyro_dppvi.privacy import noise


def bits_for(u: float, negative: bool = False) -> np.ndarray:
    """The five uint32 words that the sampler maps to ``u`` in (0, 1/2) (up to its 2^-52 grid)."""
    lz = int(math.floor(-math.log2(u))) - 1  # u in [2^-(lz+2), 2^-(lz+1))
    mantissa = int(round((u * 2.0 ** (lz + 2) - 1.0) * 2.0**52 - 0.5))
    mantissa = min(max(mantissa, 0), 2**52 - 1)
    binade = (1 << (95 - lz)) if lz < 96 else 0  # 96 bits whose leading zeros count lz
    words = [((1 << 31) if negative else 0) | (mantissa >> 32), mantissa & 0xFFFFFFFF,
             (binade >> 64) & 0xFFFFFFFF, (binade >> 32) & 0xFFFFFFFF, binade & 0xFFFFFFFF]
    return np.array(words, dtype=np.uint32)


def values(words, how: str = "op_by_op") -> np.ndarray:
    """The sampler's values for ``words``, run op by op or compiled as the package compiles its programs (one fused
    program, ``program_cache.jit`` with its XLA options: rounding may differ in the last bit)."""
    with noise._x64():
        fn = program_cache.jit(noise.normal_from_bits) if how == "package_jit" else noise.normal_from_bits
        return np.asarray(fn(jnp.asarray(words, jnp.uint32)))


COMPILED = pytest.mark.parametrize("how", ["op_by_op", "package_jit"])


def test_float32_normal_has_the_gap_that_motivated_the_sampler():
    """The attack premise, measured: the float32 sampler's largest attainable value is below 5.5 sd."""
    draws = np.asarray(jax.random.normal(jax.random.key(0), (4_000_000,), jnp.float32))
    assert np.max(np.abs(draws)) < 5.5


@COMPILED
def test_no_gap_in_the_tail_support_before_10_sd(how):
    """For every target t in [0, 10.5] on a 0.01 grid, both signs, some bit pattern maps to within
    1e-9 sd of t: the support has no gap wider than the grid's resolution up to 10.5 sd."""
    targets = np.arange(0.0, 10.5, 0.01) + 0.005
    for negative in (False, True):
        words = np.stack([bits_for(float(stats.norm.sf(t)), negative) for t in targets], axis=1)
        got = values(words, how)
        expected = -targets if negative else targets
        np.testing.assert_allclose(got, expected, atol=1e-9)


def test_extreme_tail_and_spacing_at_10_sd():
    """The all-zero binade bits give the largest magnitude, ~11.4 sd. Next to 10 sd, 4096 consecutive
    mantissas cover their stretch of the line with gaps of at most 2 float64 ulps (no hole an attacker
    could aim at: the spacing of the quantile grid is below float64 resolution there)."""
    extreme = values(np.zeros((5, 1), np.uint32))[0]
    assert 11.3 < extreme < 11.5
    w = bits_for(float(stats.norm.sf(10.0)))
    words = np.repeat(w[:, None], 4096, axis=1)
    words[1] = w[1] + np.arange(4096, dtype=np.uint32)
    got = np.unique(values(words))
    assert got.size > 10 and np.max(np.diff(got)) <= 2 * np.spacing(10.0)


@COMPILED
def test_bits_map_matches_scipy_quantiles(how):
    """Random bit patterns: the value is -ndtri(u) of the reconstructed u to float64 accuracy, op by op and in the
    program the package compiles (its XLA options)."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(5, 20000), dtype=np.uint64).astype(np.uint32)
    got = values(words, how)
    mantissa = (words[0] & 0xFFFFF).astype(np.float64) * 2.0**32 + words[1].astype(np.float64)
    bits96 = [int(a) << 64 | int(b) << 32 | int(c) for a, b, c in zip(words[2], words[3], words[4])]
    lz = np.array([96 - x.bit_length() for x in bits96])
    u = np.ldexp(1.0 + (mantissa + 0.5) / 2.0**52, -(lz + 2))
    expected = -special.ndtri(u) * np.where(words[0] >> 31 == 1, -1.0, 1.0)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-13)


def test_a_million_draws_are_standard_normal():
    """Kolmogorov-Smirnov on 10^6 draws (the statistic's 1% critical value is 1.63 / sqrt(n) = 1.6e-3),
    and the two-sided tail beyond 4 sd (expected 63.3 draws, Poisson sd 8: 4 sd is +-32)."""
    z = np.asarray(jax.jit(lambda k: add_gaussian_noise(k, jnp.zeros(1_000_000), 1.0))(jax.random.key(1)))
    assert stats.kstest(z, "norm").statistic < 1.63 / math.sqrt(z.size)
    assert abs(np.sum(np.abs(z) > 4.0) - 2 * stats.norm.sf(4.0) * z.size) < 32


def test_noise_is_added_before_rounding_and_respects_dtype():
    """The release rounds ``f + sigma z`` once: adding noise of std 0 returns the input exactly, the
    dtype is kept, and a traced std works under jit and vmap."""
    x = jnp.asarray([1e-8, 1.0, -3.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(add_gaussian_noise(jax.random.key(0), x, 0.0)), np.asarray(x))
    assert add_gaussian_noise(jax.random.key(0), x, 1.0).dtype == jnp.float32
    out = jax.jit(jax.vmap(lambda k, s: add_gaussian_noise(k, x, s)))(jax.random.split(jax.random.key(0), 2),
                                                                       jnp.array([0.0, 2.0]))
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(x))
    assert np.all(np.asarray(out[1]) != np.asarray(x))


def test_symmetric_noise_is_symmetric_with_the_right_spread():
    noisy = np.asarray(add_symmetric_noise(jax.random.key(0), jnp.zeros((200, 200)), 2.0))
    np.testing.assert_array_equal(noisy, noisy.T)
    upper = noisy[np.triu_indices(200)]
    assert abs(upper.std() / 2.0 - 1) < 0.02  # 20100 values: relative se 0.5%


def test_ledger_charges_the_tail_mass_per_noise_coordinate():
    """delta_total = delta + (1 + e^eps) * count * dimension * 2^-96: recorded exactly (it is far below
    float64 resolution next to delta, so the test reads the charged mass itself)."""
    ledger = PrivacyLedger(1, delta=1e-5)
    ledger.record(0, GaussianEvent(2.0, "none", 1.0, count=7, dimension=300))
    assert ledger._extra_mass(0) == 7 * 300 * noise.TAIL_MASS
    assert noise.TAIL_MASS == 2.0**-96
    assert ledger.delta_total >= ledger.delta


@pytest.mark.parametrize("dimension", [0, -1, 1.5])
def test_events_need_a_positive_integer_dimension(dimension):
    with pytest.raises(ValueError, match="dimension"):
        GaussianEvent(1.0, dimension=dimension)


def test_the_binade_scale_is_ldexp_bit_for_bit():
    """``power_of_two(e)`` is ``2.0 ** e`` over the whole normal range, and the sampler's uniform built with it equals
    the one ``jnp.ldexp`` builds, for random words and for every binade (0 to 96 leading zeros): the change of
    issue 25 moves no value."""
    with noise._x64():
        exponents = jnp.arange(-1022, 1024)
        np.testing.assert_array_equal(np.asarray(noise.power_of_two(exponents)), np.ldexp(1.0, np.arange(-1022, 1024)))
        words = np.random.default_rng(0).integers(0, 2**32, size=(5, 4096), dtype=np.uint64).astype(np.uint32)
        for k in range(97):  # column k: exactly k leading zeros in the 96 binade bits
            binade = 1 << (95 - k) if k < 96 else 0
            words[2:, k] = [(binade >> 64) & 0xFFFFFFFF, (binade >> 32) & 0xFFFFFFFF, binade & 0xFFFFFFFF]
        w = jnp.asarray(words)
        mantissa = (w[0] & jnp.uint32(0xFFFFF)).astype(jnp.float64) * 2.0**32 + w[1].astype(jnp.float64)
        lz = sum(jnp.where(jnp.all(w[2:j] == 0, axis=0), jax.lax.clz(w[j]).astype(jnp.int32), 0) for j in (2, 3, 4))
        u = jnp.ldexp(1.0 + (mantissa + 0.5) / 2.0**52, -(lz + 2))
        expected = np.where(np.asarray(w[0] >> 31) == 1, 1.0, -1.0) * np.asarray(jax.scipy.special.ndtri(u))
        np.testing.assert_array_equal(values(words), expected)


def test_a_release_of_many_leaves_is_one_draw_laid_out_in_order():
    """Every leaf's noise comes from one draw of the sampler, laid out over the leaves in order, so a tree's
    noise equals that of its leaves concatenated, a one-leaf tree keeps the noise of ``standard_normal`` on
    ``split(key, 1)[0]``, and a program holds one copy of the sampler (3 ``clz`` per copy; one per leaf before)."""
    key = jax.random.key(4)
    tree = {"a": jnp.zeros((3, 2)), "b": jnp.zeros(4), "c": jnp.zeros(())}
    flat = np.asarray(add_gaussian_noise(key, jnp.zeros(11), 1.5))
    noisy = add_gaussian_noise(key, tree, 1.5)
    np.testing.assert_array_equal(np.concatenate([np.ravel(noisy[k]) for k in "abc"]), flat)
    with noise._x64():
        one = np.asarray(noise.standard_normal(jax.random.split(key, 1)[0], (3, 2)).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(add_gaussian_noise(key, jnp.zeros((3, 2)), 1.0)), one)
    program = jax.jit(lambda k: add_gaussian_noise(k, tree, 1.0)).lower(key).as_text()
    assert program.count("count_leading_zeros") == 3


def test_a_std_per_subtree_gives_independent_releases_of_their_own_scale():
    """``std`` as a prefix of the tree (a gradient sum and a count released together, DP-SGD's adaptive clip): each
    part has its own std and the parts are uncorrelated. 200,000 draws: the relative se of a std is 0.16%, of a
    correlation 0.0022; the bounds are about 5 se."""
    keys = jax.random.split(jax.random.key(5), 200_000)
    draw = jax.jit(jax.vmap(lambda k: add_gaussian_noise(k, (jnp.zeros(2), jnp.zeros(())), (3.0, 0.5))))
    grads, count = (np.asarray(v) for v in draw(keys))
    np.testing.assert_allclose(grads.std(axis=0), 3.0, rtol=0.008)
    assert abs(count.std() / 0.5 - 1) < 0.008
    assert abs(np.corrcoef(grads[:, 0], count)[0, 1]) < 0.011
    assert abs(np.corrcoef(grads[:, 0], grads[:, 1])[0, 1]) < 0.011
