"""Gaussian noise for privacy releases, sampled in float64 with a tail the accountant can trust.

Why not ``jax.random.normal``: in float32 it is the inverse error function of a uniform with 23
random bits, so its support ends at about +5.2 / -5.4 standard deviations and the last few
hundredths of a standard deviation before that hold a handful of values. A release whose noise
can never exceed 5.4 sd is distinguishable from the Gaussian the accountant assumed with
probability ~1e-5 per release at noise multiplier 1 (the event "the output lies beyond
``f(D) + 5.4 sd``" has probability 0 on ``D`` and ~``Phi(-4.4)`` on a neighbour one sensitivity
away), which is as large as the whole delta of a typical fit.

Sampler (:func:`standard_normal`): inverse-CDF sampling in float64 from 160 random bits per
coordinate, with a uniform whose resolution follows its magnitude:

* 1 bit chooses the sign; we sample ``u`` uniform on ``(0, 1/2)`` and return ``sign * -ndtri(u)``;
* 96 bits give the binade of ``u``: ``e`` = the number of leading zeros of the 96 bits, so
  ``P(e = k) = 2^-(k+1)`` for ``k < 96``, which is exactly the mass a uniform on ``(0, 1/2)`` puts
  on ``[2^-(k+2), 2^-(k+1))``;
* 52 bits place ``u`` inside its binade: ``u = 2^-(e+2) (1 + (m + 1/2) 2^-52)``.

So, except on the event "all 96 binade bits are zero" (probability ``2^-96`` per coordinate, when
``u`` is put in ``[2^-98, 2^-97)`` instead of ``(0, 2^-97)``), ``u`` is the midpoint of the cell of
relative width ``2^-52`` that contains an exactly uniform ``U``, and the sample is the exact
Gaussian ``Phi^-1(U)`` moved by less than ``1.3 * 2^-52`` sd plus float64 rounding of ``ndtri``
(tested: within 1e-13 sd of SciPy's ``ndtri``). Its support has no gap up to
``|z| = -ndtri(2^-98) ~ 11.4`` sd (tested).

Accounting (the documented bound, :data:`TAIL_MASS`): couple the sampler with an exactly uniform
``U``; they disagree only on the event of probability ``2^-96`` per coordinate. If the
mechanism with the ideal sampler is ``(epsilon, delta)``-DP, the mechanism that draws ``k`` noise
coordinates in all with this sampler is ``(epsilon, delta + (1 + e^epsilon) k 2^-96)``-DP (the
coupling argument of :mod:`numpyro_dppvi.privacy.sampling`). The ledger charges it through
:attr:`GaussianEvent.dimension`. The remaining deviation, the float64 quantisation of ``Phi^-1``
at ~``3e-16`` sd, is not charged: it is many orders of magnitude below the float32 resolution
of the released values (see "Floating point" in ``docs/privacy.md`` for what this does and does
not rule out).

Release arithmetic (:func:`add_gaussian_noise`): the noise is added to the (float32) query in
float64 and the sum is rounded once to the query's dtype, so the released value is a rounding of
``f(D) + sigma z`` (post-processing), never ``f(D) + round(sigma z)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.special import ndtri

#: Random 32-bit words consumed per noise coordinate.
WORDS_PER_COORDINATE = 5
#: Probability per coordinate that the sampler departs from the exact quantile-quantised Gaussian
#: (all 96 binade bits zero); charged to delta per noise coordinate by the ledger.
TAIL_MASS = 2.0**-96
_TWO_32 = 4294967296.0
_TWO_52 = 4503599627370496.0


def _x64():
    """The float64 context manager of this JAX version (``jax.enable_x64``; older: ``jax.experimental``)."""
    manager = getattr(jax, "enable_x64", None)
    if manager is None:  # pragma: no cover - JAX < 0.7
        from jax.experimental import enable_x64 as manager
    return manager(True)


def normal_from_bits(words: jax.Array) -> jax.Array:
    """Standard normal draws (float64) from random uint32 ``words`` of shape ``[5, *shape]``.

    Pure and deterministic: the map from bits to values that :func:`standard_normal` samples
    through (exposed so that tests can drive it with chosen bit patterns, e.g. all binade bits
    zero for the extreme tail). Must be called inside the float64 context (:func:`_x64`).
    """
    words = jnp.asarray(words, jnp.uint32)
    negative = (words[0] >> 31) == 1
    mantissa = (words[0] & jnp.uint32(0xFFFFF)).astype(jnp.float64) * _TWO_32 + words[1].astype(jnp.float64)
    z1, z2, z3 = (lax.clz(w).astype(jnp.int32) for w in (words[2], words[3], words[4]))
    leading_zeros = z1 + jnp.where(words[2] == 0, z2 + jnp.where(words[3] == 0, z3, 0), 0)
    u = (1.0 + (mantissa + 0.5) / _TWO_52) * power_of_two(-(leading_zeros + 2))
    magnitude = -ndtri(u)
    return jnp.where(negative, -magnitude, magnitude)


def power_of_two(exponent: jax.Array) -> jax.Array:
    """``2.0 ** exponent`` in float64, exactly, for integer ``exponent`` in the normal range [-1022, 1023]
    (call inside the float64 context): the exponent field written directly. The sampler's scales are
    ``2^-2 .. 2^-98``, so ``x * power_of_two(e)`` is ``ldexp(x, e)`` bit for bit (a product by a power of two
    is exact without overflow or underflow), without ``jnp.ldexp``'s general code for subnormal and infinite
    results, which made the round's compiled program larger (issue 25)."""
    biased = (jnp.asarray(exponent, jnp.int64) + 1023).astype(jnp.uint64)
    return lax.bitcast_convert_type(biased << jnp.uint64(52), jnp.float64)


def float32_at_least(values) -> np.ndarray:
    """``values`` rounded **up** to float32 (``float32(z C)`` is below ``z C`` for about half of all
    ``z``: a noise std stored in float32 must never be below the calibrated one; issue 24)."""
    exact = np.asarray(values, np.float64)
    rounded = exact.astype(np.float32)
    below = rounded.astype(np.float64) < exact
    return np.where(below, np.nextafter(rounded, np.float32(np.inf)), rounded).astype(np.float32)


def to_float32_up(x) -> jax.Array:
    """A float64 array (inside the float64 context) rounded **up** to float32: :func:`float32_at_least`
    for traced values (e.g. a noise share computed inside the round)."""
    rounded = x.astype(jnp.float32)
    return jnp.where(rounded.astype(jnp.float64) < x, jnp.nextafter(rounded, jnp.float32(jnp.inf)), rounded)


def standard_normal(key, shape) -> jax.Array:
    """Standard normal draws of ``shape`` in float64 (call inside the float64 context)."""
    shape = tuple(shape)
    words = jax.random.bits(key, (WORDS_PER_COORDINATE,) + shape, dtype=jnp.uint32)
    return normal_from_bits(words)


def add_gaussian_noise(key, tree, std):
    """Release ``tree + N(0, std^2 I)``: the noise of every leaf from one draw of :func:`standard_normal`
    (``key`` split once, the draw laid out over the leaves in order), added in float64, each leaf rounded
    once to its own dtype (see the module docstring). ``std`` may be a traced scalar, or a pytree prefix of
    ``tree`` giving each subtree its own std (e.g. ``(grad_sum, count)`` with ``(std, count_std)``: two
    independent Gaussian releases from one draw).

    One draw for the whole tree: the coordinates are i.i.d. standard normal either way, and a single call puts
    one copy of the sampler's float64 code into a compiled program instead of one per leaf (a DP round's
    compilation, issue 25). A one-leaf tree gets the same noise as ``standard_normal(split(key, 1)[0], shape)``.

    Adding it to a sum with L2 sensitivity ``Delta`` is the Gaussian mechanism with noise
    multiplier ``std / Delta``; record ``dimension`` = the number of coordinates of ``tree``
    (:func:`num_coordinates`) in the event so the ledger charges :data:`TAIL_MASS` for each.

    Args:
      key: a ``jax.random`` key.
      tree: the pytree of arrays to release.
      std: the noise std, ``>= 0``: a scalar (possibly traced) or a pytree prefix of ``tree``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    stds = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda s, subtree: jax.tree_util.tree_map(lambda _: s, subtree), std, tree))
    sizes = [math.prod(leaf.shape) for leaf in leaves]
    (draw_key,) = jax.random.split(key, 1)
    out = []
    with _x64():
        z = standard_normal(draw_key, (sum(sizes),))
        offsets = np.cumsum([0] + sizes)
        for leaf, leaf_std, start, size in zip(leaves, stds, offsets, sizes):
            dtype = leaf.dtype if jnp.issubdtype(leaf.dtype, jnp.floating) else jnp.float32
            noise = lax.slice_in_dim(z, int(start), int(start + size)).reshape(leaf.shape)
            out.append((leaf.astype(jnp.float64) + jnp.asarray(leaf_std).astype(jnp.float64) * noise).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def gaussian_like(key, tree, std):
    """``N(0, std^2)`` noise shaped like ``tree`` from the same sampler, rounded to each leaf's dtype.

    For noise that is itself split or combined before the release (trusted-aggregator shares);
    a release should use :func:`add_gaussian_noise`.
    """
    return add_gaussian_noise(key, jax.tree_util.tree_map(jnp.zeros_like, tree), std)


def num_coordinates(tree) -> int:
    """Number of scalar coordinates of a pytree of arrays (static shapes)."""
    return int(sum(math.prod(jnp.shape(leaf)) for leaf in jax.tree_util.tree_leaves(tree)))
