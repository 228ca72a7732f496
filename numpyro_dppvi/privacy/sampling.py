"""Batch samplers that match their accounting, with static shapes for ``jit`` and ``vmap``.

Both samplers return ``(indices, mask)`` of a static length: ``indices`` index rows of a (padded)
client array, ``mask`` marks the rows that are really in the batch. Padding rows of a client are
never selected. Batches are drawn afresh at every step, exactly as the accountant assumes (no
shuffled epochs).

Poisson sampling (:func:`poisson_batch`, accounted as ``GaussianEvent(sampling="poisson")``)
-----------------------------------------------------------------------------------------------
Each valid row is included independently with probability ``q' = q (1 - 2^-30) <= q``; privacy
of the subsampled Gaussian only improves as the rate decreases. The work is proportional to the
pad ``max_batch``, not to the client's size: the draw walks over the rows by geometric skips.

*Why skips are Poisson sampling.* In a sequence of independent Bernoulli(``q'``) trials the
numbers of failures before each success, ``G_1, G_2, ...``, are iid Geometric(``q'``)
(``P(G = g) = (1 - q')^g q'``), and conversely. So with ``G_j`` iid Geometric the positions
``p_j = s + sum_{i <= j} (G_i + 1) - 1`` (cyclically, over the ``n`` valid rows, from a uniformly
random start ``s`` independent of them) hit every row independently with probability ``q'``:
exactly Poisson sampling. ``G = floor(log(U) / log(1 - q'))`` with ``U`` uniform on ``(0, 1]`` is
Geometric(``q'``): ``P(G >= g) = P(U <= (1 - q')^g) = (1 - q')^g``. The random start only decides
which rows are kept when the pad overflows (below); it makes every row equally likely to be kept.

*Deviation, charged.* Everything is float64. (i) ``log1p(-q')`` is off by at most 129 ulps
(measured for XLA on CPU; tested below 2^-40 relative), which moves the effective rate by less
than ``2^-40`` relative: the factor ``1 - 2^-30`` keeps it below ``q``. (ii) ``U`` has 53 significant
bits at every magnitude (:func:`_uniform_from_bits`) and ``log(U)`` is within 1 ulp (tested), so the
computed ``x = log(U) / log(1 - q')`` is within ``2^-51`` relative of ``log(U*) / log(1 - q')`` for an
exactly uniform ``U*`` coupled with ``U``, plus ``2^-52`` in ``log U``. A gap differs from the exact
one only if an integer lies that close to ``x``: probability
``<= sum_g q e^{-q g} (2^-50 g + 2^-51 / q) <= 2^-49 / q`` per gap. The plan charges
``GAP_DEVIATION / q = 2^-48 / q`` per gap (twice that), ``max_batch`` gaps per step, with the overflow
below (:func:`poisson_overflow_probability`).

The valid rows must be the first ``n`` of the client's array (as :func:`~numpyro_dppvi.data.pad_clients`
and the shard layout lay them out); ``n`` may be traced (``vmap`` over clients of different sizes).

**Overflow rule**: if more than ``max_batch`` rows were drawn, the first ``max_batch`` after the
random start are kept.

*Claim.* If the untruncated Poisson mechanism ``M`` is ``(epsilon, delta)``-DP and at step ``t``
the draw overflows (or deviates, above) with probability at most ``p_t`` on every dataset of size
``<= n + 1``, the sampled mechanism ``M'`` is ``(epsilon, delta + (1 + e^epsilon) sum_t p_t)``-DP.

*Proof.* Run ``M`` and ``M'`` on the same random draws; their outputs differ only if some step
overflowed or deviated, so for every dataset ``D`` and output set ``S``,
``|P[M'(D) in S] - P[M(D) in S]| <= P = sum_t p_t``. For neighbours ``D, D'`` (sizes ``<= n+1``
when the client holds ``n`` rows):
``P[M'(D) in S] <= P[M(D) in S] + P <= e^eps P[M(D') in S] + delta + P
<= e^eps (P[M'(D') in S] + P) + delta + P``. ∎

:func:`poisson_overflow_probability` gives ``p_t = P[Binomial(n + 1, q) > max_batch]`` (the
neighbour may hold one more row) plus the deviation bound; :func:`poisson_pad_size` chooses the
smallest pad with ``steps * P[Binomial(n + 1, q) > pad] <= overflow_tolerance``. Record ``p_t`` in
the event's ``overflow_probability``; the ledger adds ``(1 + e^epsilon) sum_t p_t`` to the delta.

**Row by row** (:func:`row_fold`): each valid row on its own 32 random bits, included iff they are below
``inclusion_threshold(q)`` (probability ``t / 2^32 <= q``): exactly Poisson sampling at a rate at most the
accounted one, with no float in the decision and nothing to charge; ``n`` random words a step. The plan
uses it where the walk's charge would cost the budget's delta
(:func:`~numpyro_dppvi.pvi.privacy_plan.walk_costs_delta`).

Sampling without replacement (:func:`without_replacement_batch`)
-----------------------------------------------------------------
A uniformly random subset of exactly ``batch`` valid rows: the rows sorted by 64 fresh random
bits each (one O(n log n) sort, ~3 ms for n = 4000 on CPU, unlike the much slower
``jax.random.choice(replace=False)``). The order is exactly uniform unless two rows draw equal
64-bit keys at the batch boundary, probability at most ``n 2^-64`` (< 1e-14 for n < 10^5)
per step. Accounted as
``GaussianEvent(sampling="without_replacement", rate=batch / n)`` under the substitute relation.
"""

from __future__ import annotations

import math
from numbers import Integral

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from scipy import stats

from . import noise

_TWO_32 = 4294967296.0
_RATE_SAFETY = 1.0 - 2.0**-20
#: Rate factor of the geometric-skip sampler (absorbs the float64 rounding of the rate).
_SKIP_RATE_SAFETY = 1.0 - 2.0**-30
#: Charged deviation of one geometric gap, times 1 / rate (module docstring).
GAP_DEVIATION = 2.0**-48


def _static_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a Python int (a static size), got {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return int(value)


def _validity(size_mask_or_n):
    """``(valid mask [n_rows], n_rows)`` from a Python int ``n`` or a boolean mask."""
    if isinstance(size_mask_or_n, Integral) and not isinstance(size_mask_or_n, bool):
        n = _static_int("n", size_mask_or_n)
        return jnp.ones((n,), dtype=bool), n
    valid = jnp.asarray(size_mask_or_n)
    if valid.ndim != 1 or valid.dtype != jnp.bool_:
        raise TypeError(
            "pass the number of rows n (a static Python int: mark it static under jit) or a 1-d "
            "boolean validity mask; got an "
            f"array of dtype {valid.dtype} and shape {valid.shape} (vmap over clients for 2-d)."
        )
    return valid, valid.shape[0]


def _check_rate(rate):
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        if not (0.0 < float(rate) <= 1.0):
            raise ValueError(f"rate must lie in (0, 1], got {rate}.")


def accounted_rate(batch: int, n: int, bits: int = 9) -> float:
    """The Poisson rate of a client with ``n`` rows and expected batch ``batch``: ``batch / n``
    rounded **up** to ``bits`` significant binary digits (relative increase < ``2^-(bits-1)``,
    0.4% by default).

    Clients of nearly equal size then share one rate, hence one accounted mechanism: one noise
    calibration and one accountant evaluation instead of one per client (a balanced split of
    39,073 rows gives sizes 3,907 and 3,908). The sampler draws at exactly this rate, so the
    accounting matches the sampler; the expected batch is at most 0.4% above ``batch``.
    """
    rate = float(batch) / float(n)
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"batch / n must lie in (0, 1], got {batch} / {n}.")
    step = 2.0 ** (math.floor(math.log2(rate)) - bits + 1)
    return min(math.ceil(rate / step) * step, 1.0)


def inclusion_threshold(rate) -> jax.Array:
    """uint32 ``t`` with ``t / 2^32 <= rate``: a row is included iff its 32 random bits ``< t``.

    In float32, ``rate`` may be rounded up by ``2^-24`` relative and the product once more; the
    factor ``1 - 2^-20`` absorbs both, so the inclusion probability never exceeds ``rate``.

    Args:
      rate: the sampling probability in (0, 1] (may be traced).
    """
    rate = jnp.asarray(rate, dtype=jnp.float32)
    return jnp.floor(rate * jnp.float32(_RATE_SAFETY) * jnp.float32(_TWO_32)).astype(jnp.uint32)


def poisson_batch(key, size_mask_or_n, rate, max_batch: int):
    """Poisson-subsampled batch in a pad of ``max_batch`` slots, by geometric skips (module docstring).

    Args:
      key: a JAX PRNG key (use a fresh one per step).
      size_mask_or_n: the number of valid rows ``n`` (a Python int, or a traced integer scalar) or
        a boolean validity mask ``[n_rows]`` whose ``True`` entries come first.
      rate: sampling probability ``q`` in (0, 1] (may be a traced scalar, e.g. under ``vmap``).
      max_batch: static pad size, e.g. from :func:`poisson_pad_size`.

    Returns:
      ``indices`` int32 ``[max_batch]`` (padding slots point at row 0) and ``mask`` bool
      ``[max_batch]`` (True for rows in the batch); no row appears twice.
    """
    n = _valid_count(size_mask_or_n)
    max_batch = _static_int("max_batch", max_batch)
    _check_rate(rate)
    k_start, k_gaps = jax.random.split(key)
    start_bits = jax.random.bits(k_start, (), dtype=jnp.uint32)
    words = jax.random.bits(k_gaps, (_UNIFORM_WORDS, max_batch), dtype=jnp.uint32)
    with noise._x64():
        n64 = jnp.asarray(n).astype(jnp.float64)
        q = jnp.asarray(rate).astype(jnp.float64) * _SKIP_RATE_SAFETY
        log_keep = jnp.log1p(-q)  # -inf at q = 1: every gap is 0
        gaps = jnp.floor(jnp.log(_uniform_from_bits(words)) / log_keep)
        gaps = jnp.clip(jnp.where(jnp.isnan(gaps), 0.0, gaps), 0.0, n64)
        offsets = jnp.cumsum(gaps + 1.0) - 1.0  # position of the j-th drawn row after the start
        mask = offsets < n64
        start = jnp.floor(start_bits.astype(jnp.float64) / _TWO_32 * n64)
        position = jnp.mod(start + jnp.where(mask, offsets, 0.0), jnp.maximum(n64, 1.0))
        indices = jnp.where(mask, position, 0.0).astype(jnp.int32)
    return indices, mask


_UNIFORM_WORDS = 4


def poisson_fold(key, size_mask_or_n, rate, chunk: int, body, init):
    """Fold ``body`` over the rows of one Poisson sample, ``chunk`` rows at a time, with no pad.

    ``carry = body(carry, indices [chunk] int32, mask [chunk] bool)`` for successive chunks of the
    sample (the geometric skips of :func:`poisson_batch`, ``chunk`` gaps per chunk, each chunk with
    its own key), until the walk has passed the last valid row; returns the final carry. The work
    is ``ceil((K + 1) / chunk)`` chunks for a sample of ``K`` rows (a ``lax.while_loop``; under
    ``vmap`` the most chunks any client needs), so it grows with the batch and wastes fewer than
    ``chunk`` rows, instead of a pad sized for the sample's extreme tail. No row is ever cut: the
    sample is exactly Poisson but for the charged gap deviation (module docstring), whose total
    probability per sample is at most :func:`poisson_fold_deviation`.
    """
    n = _valid_count(size_mask_or_n)
    chunk = _static_int("chunk", chunk)
    _check_rate(rate)
    k_start, k_gaps = jax.random.split(key)
    start_bits = jax.random.bits(k_start, (), dtype=jnp.uint32)
    with noise._x64():
        n64 = jnp.asarray(n).astype(jnp.float64)
        start = jnp.floor(start_bits.astype(jnp.float64) / _TWO_32 * n64)
        log_keep = jnp.log1p(-jnp.asarray(rate).astype(jnp.float64) * _SKIP_RATE_SAFETY)

    def unfinished(state):
        _, last, _ = state
        return last + 1.0 < n64.astype(jnp.float32)

    def next_chunk(state):
        i, last, carry = state
        words = jax.random.bits(jax.random.fold_in(k_gaps, i), (_UNIFORM_WORDS, chunk), dtype=jnp.uint32)
        with noise._x64():
            gaps = jnp.floor(jnp.log(_uniform_from_bits(words)) / log_keep)
            gaps = jnp.clip(jnp.where(jnp.isnan(gaps), 0.0, gaps), 0.0, n64)
            offsets = last.astype(jnp.float64) + jnp.cumsum(gaps + 1.0)
            mask = offsets < n64
            position = jnp.mod(start + jnp.where(mask, offsets, 0.0), jnp.maximum(n64, 1.0))
            indices = jnp.where(mask, position, 0.0).astype(jnp.int32)
            last = jnp.minimum(offsets[-1], n64).astype(jnp.float32)
        return i + 1, last, body(carry, indices, mask)

    return lax.while_loop(unfinished, next_chunk, (jnp.int32(0), jnp.float32(-1.0), init))[2]


def row_fold(key, mask, rate, chunk: int, body, init):
    """:func:`poisson_fold` with no deviation to charge: each valid row is included on its own 32 random bits,
    ``bits < t`` with ``t = inclusion_threshold(rate)`` (probability ``t / 2^32 <= rate``: exactly Poisson
    sampling at that rate, accounted at ``rate``, as the subsampled Gaussian's privacy only improves as the rate
    decreases), and the sample is folded over ``chunk`` rows at a time in row order. ``mask``: the boolean
    validity mask ``[rows]`` (static length). The cost is ``rows`` random words a step, against the walk's
    ``~ q n``: the plan takes it where the walk's charge would cost the accountant delta
    (:func:`~numpyro_dppvi.pvi.privacy_plan.dp_sgd_plan`)."""
    mask = jnp.asarray(mask)
    if mask.ndim != 1 or mask.dtype != jnp.bool_:
        raise TypeError(f"row_fold takes the boolean validity mask [rows], got dtype {mask.dtype} shape {mask.shape}")
    chunk = _static_int("chunk", chunk)
    _check_rate(rate)
    rows = mask.shape[0]
    take = (jax.random.bits(key, (rows,), dtype=jnp.uint32) < inclusion_threshold(rate)) & mask
    position = jnp.cumsum(take.astype(jnp.int32)) - 1
    count = jnp.sum(take.astype(jnp.int32))
    order = jnp.zeros(rows + chunk, jnp.int32).at[jnp.where(take, position, rows + chunk)].set(
        jnp.arange(rows, dtype=jnp.int32), mode="drop")

    def unfinished(state):
        return state[0] * chunk < count

    def next_chunk(state):
        i, carry = state
        indices = lax.dynamic_slice(order, (i * chunk,), (chunk,))
        return i + 1, body(carry, indices, i * chunk + jnp.arange(chunk) < count)

    return lax.while_loop(unfinished, next_chunk, (jnp.int32(0), init))[1]


def poisson_fold_deviation(n: int, rate: float, chunk: int) -> float:
    """Per-sample bound on the probability that :func:`poisson_fold` departs from exact Poisson
    sampling: ``E[gaps drawn] * GAP_DEVIATION / rate <= (rate (n + 1) + chunk) GAP_DEVIATION / rate``
    (a gap's own uniform is independent of whether it is drawn, so the union bound runs over the
    expected number drawn; the neighbour may hold ``n + 1`` rows)."""
    n = _static_int("n", n)
    _check_rate(rate)
    return (float(rate) * (n + 1) + _static_int("chunk", chunk)) * GAP_DEVIATION / float(rate)


def fold_chunk(batch: int) -> int:
    """Chunk size of :func:`poisson_fold` for an expected batch: a quarter of it as a power of two,
    between 8 and 256 rows (about five chunks per batch: few loop iterations, little waste)."""
    return int(min(max(2 ** math.ceil(math.log2(max(batch / 4, 1))), 8), 256))


def _uniform_from_bits(words):
    """Uniform on ``(0, 1]`` in float64 with 53 significant bits at every magnitude, from four uint32
    words: the binade from the leading zeros of 64 bits (``P = 2^-(k+1)`` for ``[2^-(k+1), 2^-k)``),
    52 bits within it (call inside the float64 context)."""
    mantissa = (words[0] & jnp.uint32(0xFFFFF)).astype(jnp.float64) * _TWO_32 + words[1].astype(jnp.float64)
    z2, z3 = lax.clz(words[2]).astype(jnp.int32), lax.clz(words[3]).astype(jnp.int32)
    leading_zeros = z2 + jnp.where(words[2] == 0, z3, 0)
    return (1.0 + (mantissa + 1.0) / 4503599627370496.0) * noise.power_of_two(-(leading_zeros + 1))  # = ldexp, exactly


def _valid_count(size_mask_or_n):
    """The number of valid rows from an int, a traced integer, or a prefix validity mask."""
    if isinstance(size_mask_or_n, Integral) and not isinstance(size_mask_or_n, bool):
        return _static_int("n", size_mask_or_n)
    value = jnp.asarray(size_mask_or_n)
    if value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.integer) or value.ndim == 0 and jnp.issubdtype(
            value.dtype, jnp.floating):
        return value
    if value.ndim != 1 or value.dtype != jnp.bool_:
        raise TypeError(
            "pass the number of rows n (an int or an integer scalar) or a 1-d boolean validity mask "
            f"whose True entries come first; got an array of dtype {value.dtype} and shape {value.shape} "
            "(vmap over clients for 2-d)."
        )
    return jnp.sum(value)


def poisson_overflow_probability(n: int, rate: float, max_batch: int) -> float:
    """Per-step bound on the probability that :func:`poisson_batch` departs from exact Poisson
    sampling for a client with ``n`` rows (its neighbour may hold ``n + 1``):
    ``P[Binomial(n + 1, rate) > max_batch] + max_batch * GAP_DEVIATION / rate`` (module docstring).

    Args:
      n: the client's number of rows, a Python int.
      rate: the sampling probability in (0, 1].
      max_batch: the pad size of the batch, a Python int.
    """
    n = _static_int("n", n)
    max_batch = _static_int("max_batch", max_batch)
    _check_rate(rate)
    return float(stats.binom.sf(max_batch, n + 1, float(rate))) + max_batch * GAP_DEVIATION / float(rate)


def poisson_pad_size(n: int, rate: float, steps: int = 1, overflow_tolerance: float = 1e-12) -> int:
    """Smallest ``max_batch`` with ``steps * P[Binomial(n + 1, rate) > max_batch] <=
    overflow_tolerance``.

    The ledger then adds at most ``(1 + e^epsilon) * overflow_tolerance`` to delta (module
    docstring): with the default ``1e-12`` and ``epsilon <= 10`` that is below ``2.3e-8``.
    The result is at most ``n + 1`` (no overflow is then possible).

    Args:
      n: the client's number of rows, a Python int.
      rate: the sampling probability in (0, 1].
      steps: the number of batches drawn, over which the tolerance holds. Default 1.
      overflow_tolerance: the bound, in (0, 1), on the probability that any of the ``steps`` batches
        overflows.
    """
    n = _static_int("n", n)
    steps = _static_int("steps", steps)
    _check_rate(rate)
    if not (0.0 < overflow_tolerance < 1.0):
        raise ValueError(f"overflow_tolerance must lie in (0, 1), got {overflow_tolerance}.")
    sizes = np.arange(0, n + 2)
    log_tail = stats.binom.logsf(sizes, n + 1, float(rate))
    ok = np.nonzero(log_tail + math.log(steps) <= math.log(overflow_tolerance))[0]
    return max(int(sizes[ok[0]]), 1)


def without_replacement_batch(key, size_mask_or_n, batch: int):
    """Uniformly random subset of exactly ``batch`` valid rows (fixed size, fresh each step).

    Args:
      key: a JAX PRNG key (use a fresh one per step).
      size_mask_or_n: the number of rows ``n`` (Python int) or a boolean validity mask
        ``[n_rows]``. The caller must ensure ``batch <= n_valid`` (checked when ``n`` is given):
        the accounted rate is ``batch / n_valid``; slots beyond ``n_valid`` come back masked.
      batch: static batch size.

    Returns:
      ``indices`` int32 ``[batch]`` and ``mask`` bool ``[batch]``.
    """
    valid, n_rows = _validity(size_mask_or_n)
    batch = _static_int("batch", batch)
    if batch > n_rows:
        raise ValueError(
            f"batch={batch} exceeds the {n_rows} rows of the client; use a smaller batch or "
            "Poisson sampling."
        )
    # sort rows by (invalid, 64 random bits): valid rows first, in uniformly random order
    bits = jax.random.bits(key, (2, n_rows), dtype=jnp.uint32)
    invalid = jnp.where(valid, 0, 1).astype(jnp.uint32)
    row = jnp.arange(n_rows, dtype=jnp.int32)
    *_, order = lax.sort((invalid, bits[0], bits[1], row), num_keys=3)
    indices = order[:batch]
    return indices, valid[indices]
