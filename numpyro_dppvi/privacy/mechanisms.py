"""Gaussian mechanisms on pytrees: clipping, noise, Analyze-Gauss symmetric noise, PSD projection
and trusted-aggregator noise shares.

All functions are pure and ``jit``/``vmap`` friendly. Each states the sensitivity that the caller
must put (through :func:`~numpyro_dppvi.privacy.events.sensitivity`) into the event it records.
Noise comes from the float64 sampler of :mod:`~numpyro_dppvi.privacy.noise`, never from
``jax.random.normal``.

Non-finite inputs: a per-example term (or a whole update) with a NaN or inf entry is zeroed before
it is clipped. It then contributes nothing, which is within the sensitivity bound, so one record
can never make a release non-finite and thereby decide an unnoised bit (e.g. "this client's
update was dropped").
"""

from __future__ import annotations

import functools
import math
from numbers import Real

import jax
import jax.numpy as jnp

from . import noise
from .noise import add_gaussian_noise  # noqa: F401  (re-exported: the release primitive)


def _check_positive(name, value):
    """Validate Python numbers eagerly; traced values (adaptive clipping) pass through."""
    if isinstance(value, Real) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value}.")


def _check_nonnegative(name, value):
    if isinstance(value, Real) and not isinstance(value, bool):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}.")


def _check_leading_axis(tree):
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        raise ValueError("the pytree has no leaves.")
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "every leaf needs the same leading example axis; got leading sizes "
            f"{sorted(str(s) for s in sizes)}."
        )
    return leaves


def _expand(flags, leaf):
    return jnp.reshape(flags, (-1,) + (1,) * (leaf.ndim - 1))


def finite_rows(tree) -> jax.Array:
    """``[B]`` bool: every entry of example ``i``, in every leaf, is finite."""
    leaves = _check_leading_axis(tree)
    return functools.reduce(
        jnp.logical_and,
        [jnp.all(jnp.isfinite(jnp.reshape(leaf, (leaf.shape[0], -1))), axis=1) for leaf in leaves],
    )


#: Relative margin below ``C`` of a clipped term: ``C (1 - 2^-22)``. The norm is computed in float64
#: (exact to ~1e-16 for the float32 entries); scaling a float32 entry rounds it by at most 2^-24
#: (relative), and so does rounding the scale factor to float32, so a clipped term's norm is at most
#: ``C (1 - 2^-22) (1 + 2^-24)^2 < C`` in float32, as the sensitivity argument assumes. Issue 24: with
#: norms and factors in float32, 31% of clipped norms were above ``C`` (by up to 1.6e-7, relative).
CLIP_MARGIN = 2.0**-22


def _norms_and_factors(tree, clip):
    """``(norms, factors)``, both ``[B]`` in the leaves' dtype: the joint L2 norm of each example
    (``inf`` for a row with a non-finite entry) and its clipping factor: 1 when the float64 norm is at
    most ``C``, else ``C (1 - CLIP_MARGIN) / ||g_i||`` (0 for a non-finite row, which is zeroed)."""
    leaves = _check_leading_axis(tree)
    finite = finite_rows(tree)
    dtype = jnp.result_type(*leaves)
    with noise._x64():
        squares = sum(
            jnp.sum(jnp.reshape(jnp.where(_expand(finite, leaf), leaf, 0.0).astype(jnp.float64),
                                (leaf.shape[0], -1)) ** 2, axis=1)
            for leaf in leaves
        )
        norm = _safe_sqrt(squares)
        factor = _scale_factor(norm, jnp.asarray(clip).astype(jnp.float64))
        factor = jnp.where(finite, factor, 0.0).astype(dtype)
        norm = jnp.where(finite, norm, jnp.inf).astype(dtype)
    return norm, factor


def per_example_norms(tree) -> jax.Array:
    """Joint L2 norm per example, ``||g_i|| = sqrt(sum_leaves sum_j g_{i,leaf,j}^2)``, for a
    pytree whose leaves share a leading example axis; ``inf`` for a row with a non-finite entry
    (computed in float64, returned in the leaves' dtype).

    Args:
      tree: a pytree whose leaves share a leading example axis ``[B, ...]``.
    """
    return _norms_and_factors(tree, 1.0)[0]


def _safe_sqrt(squares):
    # sqrt with a zero (not NaN) gradient at 0, so clipping stays differentiable everywhere
    positive = squares > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, squares, 1.0)), 0.0)


def _scale_factor(norm, clip):
    # 1 when ||g|| <= C, else C (1 - CLIP_MARGIN) / ||g|| (float64 in and out; see CLIP_MARGIN); a zero norm
    # gives factor 1 and no NaN gradient; an infinite norm gives 0
    shrink = clip * (1.0 - CLIP_MARGIN) / jnp.maximum(norm, jnp.finfo(jnp.result_type(norm)).tiny)
    return jnp.where(norm <= clip, 1.0, shrink)


def clip_per_example(tree, clip):
    """Clip each example's pytree slice jointly to L2 norm ``clip``:
    ``g_i <- g_i * min(1, C / ||g_i||)`` (``C`` less :data:`CLIP_MARGIN`, so that the float32 result
    has norm ``<= C``); a row with a non-finite entry becomes zero.

    Sensitivity: every clipped term has norm ``<= C`` (a zeroed row has norm 0), so
    ``sum_i clip(g_i)`` moves by at most ``C`` when one record is added or removed and ``2C`` when
    one is replaced (``sensitivity(C, relation, "sum_of_records")``). Masked (padding) examples must
    be zeroed by the caller before summing.

    Args:
      tree: a pytree whose leaves share a leading example axis ``[B, ...]``.
      clip: the clip norm ``C > 0`` (a number, or a traced scalar under adaptive clipping).

    Returns:
      ``(clipped_tree, norms)`` with ``norms`` the pre-clipping per-example norms ``[B]``
      (``inf`` for a non-finite row).
    """
    _check_positive("clip", clip)
    norms, factor = _norms_and_factors(tree, clip)
    keep = jnp.isfinite(norms)

    def scale(leaf):
        return jnp.where(_expand(keep, leaf), leaf, 0.0) * _expand(factor, leaf).astype(leaf.dtype)

    return jax.tree_util.tree_map(scale, tree), norms


def clipped_sum(tree, clip, mask=None):
    """``sum_{i: mask_i} g_i * min(1, C / ||g_i||)``: the clipped per-example sum, pre-noise.

    The same query as summing :func:`clip_per_example` over the rows the ``mask`` keeps, written
    as one weighted sum ``w^T g`` per leaf with ``w_i = mask_i min(1, C / ||g_i||)`` (a dot
    product instead of materialising the clipped rows; 2x faster in the DP step).

    Sensitivity: every kept term has norm ``<= C``; a row outside the mask, or with a non-finite
    entry, contributes nothing (it is zeroed before the sum, so it cannot make the sum NaN).
    Adding or removing one record therefore moves the sum by at most ``C`` and replacing one by
    at most ``2C`` (``sensitivity(C, relation, "sum_of_records")``).

    Args:
      tree: a pytree whose leaves share a leading example axis ``[B, ...]``.
      clip: the clip norm ``C > 0``.
      mask: ``[B]`` bool: the rows to sum (e.g. the real rows of a padded batch). Default None: every row.

    Returns:
      ``(summed_tree, norms)`` with ``norms`` the pre-clipping per-example norms ``[B]``
      (``inf`` for a non-finite row).
    """
    _check_positive("clip", clip)
    norms, factor = _norms_and_factors(tree, clip)
    keep = jnp.isfinite(norms) if mask is None else (jnp.isfinite(norms) & mask)
    weight = jnp.where(keep, factor, 0.0)

    def weighted_sum(leaf):
        leaf = jnp.where(_expand(keep, leaf), leaf, 0.0)
        return jnp.tensordot(weight.astype(leaf.dtype), leaf, axes=1)

    return jax.tree_util.tree_map(weighted_sum, tree), norms


def tree_norm(tree) -> jax.Array:
    """L2 norm of a whole pytree, ``sqrt(sum_leaves ||leaf||_F^2)``.

    Args:
      tree: a pytree of arrays.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    return _safe_sqrt(sum(jnp.sum(leaf**2) for leaf in leaves))


def clip_update(tree, clip):
    """Clip a whole update (e.g. a change of natural parameters) jointly to L2 norm ``clip``; an
    update with a non-finite entry becomes zero.

    Sensitivity: a clipped update has norm ``<= C`` whatever its input; the relation and the shard
    layout it is released under give the sensitivity of the released sum
    (``sensitivity(C, relation, kind)``; see :mod:`numpyro_dppvi.pvi.update_perturbation`).

    Args:
      tree: the update, a pytree of arrays (clipped as one vector).
      clip: the clip norm ``C > 0``.

    Returns:
      ``(clipped_tree, norm)`` with the pre-clipping norm (``inf`` if non-finite).
    """
    _check_positive("clip", clip)
    leaves = jax.tree_util.tree_leaves(tree)
    finite = functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(leaf)) for leaf in leaves])
    zeroed = jax.tree_util.tree_map(lambda leaf: jnp.where(finite, leaf, 0.0), tree)
    dtype = jnp.result_type(*leaves)
    with noise._x64():  # the norm and factor in float64, as in per-example clipping (CLIP_MARGIN)
        norm = _safe_sqrt(sum(jnp.sum(jnp.asarray(leaf).astype(jnp.float64) ** 2)
                              for leaf in jax.tree_util.tree_leaves(zeroed)))
        factor = jnp.where(finite, _scale_factor(norm, jnp.asarray(clip).astype(jnp.float64)), 0.0).astype(dtype)
        norm = norm.astype(dtype)
    clipped = jax.tree_util.tree_map(lambda leaf: leaf * factor.astype(leaf.dtype), zeroed)
    return clipped, jnp.where(finite, norm, jnp.inf)


def gaussian_noise_like(key, tree, std):
    """Independent ``N(0, std^2)`` noise shaped like ``tree`` (one draw laid out over the leaves), from the
    float64 sampler of :mod:`~numpyro_dppvi.privacy.noise`, rounded to each leaf's dtype.

    A release should use :func:`add_gaussian_noise`, which adds the noise before rounding. Adding
    noise of std ``std`` to a sum with L2 sensitivity ``Delta`` is the Gaussian mechanism with
    noise multiplier ``std / Delta`` (the ``noise_multiplier`` of the event to record).

    Args:
      key: a ``jax.random`` key.
      tree: a pytree of arrays giving the noise's shapes and dtypes.
      std: the noise std, ``>= 0``.
    """
    _check_nonnegative("std", std)
    return noise.gaussian_like(key, tree, std)


def add_symmetric_noise(key, matrix, std):
    """Release ``A + E`` for a symmetric statistic ``A = sum_i x_i x_i^T`` (VIPS second moments):
    ``E`` has its upper triangle (with the diagonal) iid ``N(0, std^2)`` and is mirrored (Analyze
    Gauss, Dwork, Talwar, Thakurta, Zhang 2014); the noisy upper triangle is formed in float64 and
    rounded once (:mod:`~numpyro_dppvi.privacy.noise`). ``matrix`` is ``[..., d, d]``; leading
    axes get independent noise.

    Sensitivity: the independent entries are the upper triangle, whose L2 norm is at most the
    Frobenius norm of the change. With ``||x_i|| <= B`` a record changes ``A`` by ``x x^T``
    (add/remove: ``||x x^T||_F = ||x||^2 <= B^2``) or ``x x^T - y y^T`` (substitute:
    ``||.||_F^2 = ||x||^4 + ||y||^4 - 2 (x.y)^2 <= 2 B^4``, so ``<= sqrt(2) B^2``). The noise
    multiplier is ``std`` over that bound; each matrix has ``d (d + 1) / 2`` noise coordinates.

    Args:
      key: a ``jax.random`` key.
      matrix: the symmetric statistic, ``[..., d, d]``.
      std: the noise std of each upper-triangle entry, ``>= 0``.
    """
    matrix = jnp.asarray(matrix)
    if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2] or matrix.shape[-1] < 1:
        raise ValueError(f"add_symmetric_noise needs square matrices, got shape {matrix.shape}.")
    _check_nonnegative("std", std)
    noisy_upper = jnp.triu(add_gaussian_noise(key, jnp.triu(matrix), std))
    return noisy_upper + jnp.swapaxes(jnp.triu(noisy_upper, k=1), -1, -2)


def add_frobenius_symmetric_noise(key, matrix, std):
    """Release a symmetric matrix ``A`` whose change is bounded in the **Frobenius** norm (a change of a
    full-rank factor's ``eta2``, clipped with its ``eta1``): the Gaussian mechanism of std ``std`` on the
    coordinates

        phi(A) = (A_ii for every i;  sqrt(2) A_ij for i < j),        ||phi(A)||_2 = ||A||_F,

    mapped back. ``phi`` is a linear isometry of the symmetric matrices onto ``R^{d (d + 1) / 2}``, so a
    change of Frobenius norm ``<= Delta`` moves ``phi(A)`` by ``<= Delta`` in L2 and ``phi(A) + N(0, std^2 I)``
    is exactly the Gaussian mechanism of noise multiplier ``std / Delta``; undoing ``phi`` (halving the
    off-diagonal entries by ``sqrt(2)`` and mirroring them) is post-processing. The result: diagonal noise of
    std ``std``, off-diagonal noise of std ``std / sqrt(2)``, symmetric. (:func:`add_symmetric_noise` puts
    ``std`` on every entry of the upper triangle, the mechanism for a bound on the upper triangle's own
    norm; for a Frobenius bound it is valid but adds twice the variance off the diagonal.) The noise
    coordinates are ``d (d + 1) / 2`` per matrix; ``phi``, the noise and the inverse are computed in float64
    and the result rounded once. ``matrix`` is ``[..., d, d]`` (leading axes: independent noise); only its
    upper triangle is read.

    Args:
      key: a ``jax.random`` key.
      matrix: the symmetric matrix to release, ``[..., d, d]``.
      std: the std of the mechanism on ``phi(A)``, ``>= 0``: the noise std of the diagonal.
    """
    matrix = jnp.asarray(matrix)
    if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2] or matrix.shape[-1] < 1:
        raise ValueError(f"add_frobenius_symmetric_noise needs square matrices, got shape {matrix.shape}.")
    _check_nonnegative("std", std)
    d = matrix.shape[-1]
    diagonal = jnp.eye(d, dtype=bool)
    upper = jnp.triu(jnp.ones((d, d), bool), k=1)
    with noise._x64():
        root2 = jnp.sqrt(jnp.float64(2.0))
        a = matrix.astype(jnp.float64)
        coordinates = jnp.where(diagonal, a, jnp.where(upper, root2 * a, 0.0))
        noisy = coordinates + jnp.asarray(std).astype(jnp.float64) * noise.standard_normal(key, matrix.shape)
        back = jnp.where(diagonal, noisy, jnp.where(upper, noisy / root2, 0.0))
        symmetric = back + jnp.swapaxes(jnp.where(upper, back, 0.0), -1, -2)
        return symmetric.astype(matrix.dtype)


def symmetric_gaussian_noise(key, dim: int, std, dtype=jnp.float32):
    """Symmetric ``dim x dim`` noise alone (upper triangle iid ``N(0, std^2)``, mirrored); a
    release should use :func:`add_symmetric_noise`.

    Args:
      key: a ``jax.random`` key.
      dim: ``d``, a positive int.
      std: the noise std, ``>= 0``.
      dtype: the result's dtype. Default float32.
    """
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}.")
    return add_symmetric_noise(key, jnp.zeros((dim, dim), dtype), std)


def project_psd(matrix, floor):
    """Nearest-in-spectrum symmetric matrix with eigenvalues ``>= floor``:
    ``V diag(max(lambda, floor)) V^T`` for ``(M + M^T)/2 = V diag(lambda) V^T``.

    Post-processing of a noisy release (no privacy cost) — of the complete release: with a trusted
    aggregator it must be applied to the aggregated sum, never to a single under-noised share.
    ``floor = 0`` gives the Frobenius projection onto the PSD cone; a small positive floor keeps
    the matrix invertible (VIPS sets negative eigenvalues of the noisy second moment to a small
    positive value).

    Args:
      matrix: a square matrix ``[..., d, d]`` (symmetrised first).
      floor: the smallest eigenvalue kept, ``>= 0``.
    """
    _check_nonnegative("floor", floor)
    matrix = jnp.asarray(matrix)
    if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2]:
        raise ValueError(f"project_psd needs square matrices, got shape {matrix.shape}.")
    sym = 0.5 * (matrix + jnp.swapaxes(matrix, -1, -2))
    eigenvalues, vectors = jnp.linalg.eigh(sym)
    clamped = jnp.maximum(eigenvalues, floor)
    return (vectors * clamped[..., None, :]) @ jnp.swapaxes(vectors, -1, -2)


def aggregator_noise_share(std, num_clients: int):
    """Per-client noise std ``std / sqrt(M)`` for a trusted aggregator: the sum of ``M``
    independent shares has std ``std`` (DP-PVI Theorems A.10, A.13).

    Sensitivity: unchanged, the aggregated sum carries noise ``std`` and is accounted as one
    release of noise multiplier ``std / Delta``; a single share alone gives no such guarantee, so
    every decision (invalid-update rules, projections) must be taken on the aggregate, and a
    client's share must never be dropped after it was drawn.

    Args:
      std: the noise std the aggregated sum must carry, ``>= 0``.
      num_clients: ``M``, the number of clients adding a share, a positive int.
    """
    if not isinstance(num_clients, int) or isinstance(num_clients, bool) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive int, got {num_clients!r}.")
    _check_nonnegative("std", std)
    return std / math.sqrt(num_clients)


def aggregator_noise_shares(key, tree, std, num_clients: int):
    """``num_clients`` independent noise shares shaped like ``tree`` (leading client axis), each
    with std ``std / sqrt(M)``, drawn with one independent key per client.

    Args:
      key: a ``jax.random`` key (split into one per client).
      tree: a pytree of arrays giving one share's shapes and dtypes.
      std: the noise std of the aggregated sum, ``>= 0``.
      num_clients: ``M``, a positive int.
    """
    share = aggregator_noise_share(std, num_clients)
    keys = jax.random.split(key, num_clients)
    return jax.vmap(lambda k: gaussian_noise_like(k, tree, share))(keys)
