import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numpyro_dppvi.privacy import (
    aggregator_noise_share,
    aggregator_noise_shares,
    clip_per_example,
    clipped_sum,
    clip_update,
    gaussian_noise_like,
    per_example_norms,
    project_psd,
    sensitivity,
    symmetric_gaussian_noise,
    add_frobenius_symmetric_noise,
)

CLIP = 1.3
_clipped_sum = jax.jit(lambda tree: jax.tree_util.tree_map(
    lambda leaf: leaf.sum(0), clip_per_example(tree, CLIP)[0]))


def _as_tree(rows):
    """Split rows [n, 5] into a two-leaf pytree with a shared example axis."""
    rows = jnp.asarray(rows, jnp.float32)
    return {"w": rows[:, :3].reshape(-1, 3, 1), "b": rows[:, 3:]}


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(tree["w"])), np.ravel(np.asarray(tree["b"]))])


records = hnp.arrays(np.float64, st.tuples(st.integers(2, 8), st.just(5)),
                     elements=st.floats(-1e3, 1e3, allow_nan=False, width=32))


@settings(max_examples=60, deadline=None)
@given(rows=records, new_row=hnp.arrays(np.float64, 5, elements=st.floats(-1e3, 1e3, width=32)),
       which=st.integers(0, 7))
def test_clipped_sum_sensitivity_on_random_neighbours(rows, new_row, which):
    """Pre-noise clipped sum moves by at most C (one record removed) or 2C (one replaced).
    Tolerance: float32 rounding of sums of <= 8 terms of norm <= C (relative 1e-5)."""
    which = which % rows.shape[0]
    full = _flat(_clipped_sum(_as_tree(rows)))
    removed = _flat(_clipped_sum(_as_tree(np.delete(rows, which, axis=0))))
    replaced_rows = rows.copy()
    replaced_rows[which] = new_row
    replaced = _flat(_clipped_sum(_as_tree(replaced_rows)))
    tol = 1e-5 * CLIP * rows.shape[0]
    assert np.linalg.norm(full - removed) <= sensitivity(CLIP, "add_remove") + tol
    assert np.linalg.norm(full - replaced) <= sensitivity(CLIP, "substitute") + tol


_masked_clipped_sum = jax.jit(lambda tree, mask: clipped_sum(tree, CLIP, mask)[0])


@settings(max_examples=60, deadline=None)
@given(rows=records, new_row=hnp.arrays(np.float64, 5, elements=st.floats(-1e3, 1e3, width=32)),
       which=st.integers(0, 7))
def test_masked_clipped_sum_sensitivity_and_agreement(rows, new_row, which):
    """``clipped_sum`` (the weighted form the DP step uses): removing a record by masking it moves
    the sum by at most C, replacing one by at most 2C, and it equals summing ``clip_per_example``.
    Tolerance: float32 rounding of sums of <= 8 terms of norm <= C (relative 1e-5)."""
    which = which % rows.shape[0]
    mask = np.ones(rows.shape[0], bool)
    full = _flat(_masked_clipped_sum(_as_tree(rows), mask))
    removed_mask = mask.copy()
    removed_mask[which] = False
    removed = _flat(_masked_clipped_sum(_as_tree(rows), removed_mask))
    replaced_rows = rows.copy()
    replaced_rows[which] = new_row
    replaced = _flat(_masked_clipped_sum(_as_tree(replaced_rows), mask))
    tol = 1e-5 * CLIP * rows.shape[0]
    assert np.linalg.norm(full - removed) <= sensitivity(CLIP, "add_remove") + tol
    assert np.linalg.norm(full - replaced) <= sensitivity(CLIP, "substitute") + tol
    np.testing.assert_allclose(full, _flat(_clipped_sum(_as_tree(rows))), rtol=1e-5, atol=tol)
    np.testing.assert_allclose(removed, _flat(_clipped_sum(_as_tree(np.delete(rows, which, axis=0)))),
                               rtol=1e-5, atol=tol)


def test_masked_rows_cannot_reach_the_clipped_sum_even_when_not_finite():
    rows = np.ones((3, 5))
    rows[2] = np.nan
    tree = _as_tree(rows)
    mask = np.array([True, True, False])
    expected = _flat(_clipped_sum(_as_tree(rows[:2])))
    np.testing.assert_allclose(_flat(_masked_clipped_sum(tree, mask)), expected, rtol=1e-6)


def test_worst_case_neighbours_attain_the_sensitivity():
    rows = np.zeros((3, 5))
    rows[0, 0] = 10.0
    swapped = rows.copy()
    swapped[0, 0] = -10.0
    a, b = _flat(_clipped_sum(_as_tree(rows))), _flat(_clipped_sum(_as_tree(swapped)))
    assert np.linalg.norm(a - b) == pytest.approx(2 * CLIP, rel=1e-6)


def test_clip_per_example_is_joint_over_leaves():
    tree = {"a": jnp.array([[3.0], [0.3], [0.0]]), "b": jnp.array([[4.0, 0.0], [0.4, 0.0],
                                                                      [0.0, 0.0]])}
    clipped, norms = clip_per_example(tree, 1.0)
    np.testing.assert_allclose(norms, [5.0, 0.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(per_example_norms(clipped), [1.0, 0.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(clipped["a"][:, 0], [0.6, 0.3, 0.0], rtol=1e-6)
    grads = jax.grad(lambda t: sum(jnp.sum(leaf) for leaf in
                                   jax.tree_util.tree_leaves(clip_per_example(t, 1.0)[0])))(tree)
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))


def test_clip_update_is_joint_over_the_tree():
    tree = {"eta1": jnp.array([3.0, 0.0]), "eta2": jnp.array([[4.0]])}
    clipped, norm = clip_update(tree, 2.5)
    assert float(norm) == pytest.approx(5.0)
    np.testing.assert_allclose(clipped["eta1"], [1.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(clipped["eta2"], [[2.0]], rtol=1e-6)
    same, _ = clip_update(tree, 10.0)
    np.testing.assert_allclose(same["eta1"], tree["eta1"])


def test_gaussian_noise_like_has_the_requested_std_and_independent_leaves():
    tree = {"a": jnp.zeros((200, 250)), "b": jnp.zeros((200, 250), jnp.float32)}
    noise = gaussian_noise_like(jax.random.key(0), tree, 2.0)
    a, b = np.asarray(noise["a"]).ravel(), np.asarray(noise["b"]).ravel()
    # sample std of 5e4 normals: standard error 2 / sqrt(2 * 5e4) ~ 0.0063; allow 5 se
    assert abs(a.std() - 2.0) < 0.032 and abs(b.std() - 2.0) < 0.032
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(a.size)


def test_symmetric_noise_is_symmetric_with_iid_upper_triangle():
    draws = jax.vmap(lambda k: symmetric_gaussian_noise(k, 4, 0.5))(
        jax.random.split(jax.random.key(1), 20000))
    d = np.asarray(draws)
    np.testing.assert_array_equal(d, np.swapaxes(d, 1, 2))
    # each entry has variance 0.25 (diagonal and off-diagonal): se of a variance ~ 0.25*sqrt(2/n)
    var = d.var(axis=0)
    assert np.all(np.abs(var - 0.25) < 5 * 0.25 * math.sqrt(2 / 20000))
    assert abs(np.corrcoef(d[:, 0, 1], d[:, 0, 2])[0, 1]) < 5 / math.sqrt(20000)


def test_frobenius_symmetric_noise_is_the_gaussian_mechanism_on_isometric_coordinates():
    """Diagonal variance ``std^2``, off-diagonal ``std^2 / 2``, entries uncorrelated, exactly symmetric: then
    ``phi(E) = (E_ii, sqrt(2) E_ij)`` is iid ``N(0, std^2)`` and ``||phi(A)|| = ||A||_F`` (so a Frobenius
    sensitivity is the L2 sensitivity of the coordinates). 20000 draws: the se of a variance is
    ``var sqrt(2 / n)``, of a correlation ``1 / sqrt(n)``; 5 se each."""
    n, std = 20000, 0.5
    signal = jnp.asarray([[1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]], jnp.float32)
    draw = jax.jit(jax.vmap(lambda k: add_frobenius_symmetric_noise(k, signal, std)))  # one program, not op by op
    draws = np.asarray(draw(jax.random.split(jax.random.key(2), n)), np.float64) - np.asarray(signal)
    np.testing.assert_array_equal(draws, np.swapaxes(draws, 1, 2))
    var = draws.var(axis=0)
    expected = np.where(np.eye(3, dtype=bool), std ** 2, std ** 2 / 2)
    assert np.all(np.abs(var - expected) < 5 * expected * math.sqrt(2 / n)), var
    upper = [draws[:, i, j] for i in range(3) for j in range(i, 3)]
    corr = np.corrcoef(np.stack(upper))
    assert np.max(np.abs(corr - np.eye(len(upper)))) < 5 / math.sqrt(n)
    a = np.asarray(signal, np.float64)
    phi = np.concatenate([np.diag(a), math.sqrt(2) * a[np.triu_indices(3, 1)]])
    assert abs(np.linalg.norm(phi) - np.linalg.norm(a)) < 1e-12
    with pytest.raises(ValueError, match="square"):
        add_frobenius_symmetric_noise(jax.random.key(0), jnp.ones((2, 3)), 1.0)


def test_project_psd_floors_eigenvalues_and_keeps_valid_matrices():
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    m = (q * np.array([-2.0, -0.1, 0.5, 3.0])) @ q.T
    projected = np.asarray(project_psd(jnp.asarray(m, jnp.float32), 0.01))
    eig = np.linalg.eigvalsh(projected)
    np.testing.assert_allclose(np.sort(eig), [0.01, 0.01, 0.5, 3.0], atol=1e-5)
    good = (q * np.array([0.2, 0.5, 1.0, 3.0])) @ q.T
    np.testing.assert_allclose(project_psd(jnp.asarray(good, jnp.float32), 0.01), good, atol=1e-5)
    with pytest.raises(ValueError, match="square"):
        project_psd(jnp.ones((2, 3)), 0.0)


def test_aggregator_shares_sum_to_the_full_noise():
    assert aggregator_noise_share(3.0, 9) == pytest.approx(1.0)
    shares = aggregator_noise_shares(jax.random.key(2), {"x": jnp.zeros(20000)}, 2.0, 4)
    x = np.asarray(shares["x"])
    assert x.shape == (4, 20000)
    assert abs(x.sum(0).std() - 2.0) < 5 * 2.0 / math.sqrt(2 * 20000)
    assert abs(x[0].std() - 1.0) < 5 / math.sqrt(2 * 20000)
    assert abs(np.corrcoef(x[0], x[1])[0, 1]) < 5 / math.sqrt(20000)  # independent keys


@pytest.mark.parametrize("call,match", [
    (lambda: clip_per_example({"a": jnp.ones((2, 3))}, 0.0), "clip"),
    (lambda: clip_per_example({"a": jnp.ones((2, 3)), "b": jnp.ones((3, 1))}, 1.0), "leading"),
    (lambda: clip_update({"a": jnp.ones(3)}, -1.0), "clip"),
    (lambda: gaussian_noise_like(jax.random.key(0), jnp.ones(3), -1.0), "std"),
    (lambda: symmetric_gaussian_noise(jax.random.key(0), 0, 1.0), "dim"),
    (lambda: aggregator_noise_share(1.0, 0), "num_clients"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
