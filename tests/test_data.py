"""Tests for numpyro_dppvi.data: partitioning, validation and padding of client data."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numpyro_dppvi.data import (
    PaddedClients,
    pad_clients,
    partition,
    partition_by,
    partition_indices,
    validate_clients,
)


def _labelled(n=10_000, lam=0.76, seed=0):
    """Rows with an id column and binary labels whose majority class (0) has fraction lam."""
    rng = np.random.default_rng(seed)
    y = np.ones(n, dtype=np.float32)
    y[: round(lam * n)] = 0.0
    y = rng.permutation(y)
    ids = np.arange(n)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return ids, x, y


def _assert_exact_cover(clients, n):
    ids = np.concatenate([c[0] for c in clients])
    assert ids.size == n
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))


# --------------------------------------------------------------------------- partition


def test_balanced_split_sizes_cover_and_alignment():
    ids, x, y = _labelled(1003)
    clients = partition((ids, x, y), num_clients=10, seed=0)
    assert len(clients) == 10
    sizes = [len(c[0]) for c in clients]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1003
    _assert_exact_cover(clients, 1003)
    for cid, cx, cy in clients:  # rows stay aligned across arrays
        np.testing.assert_array_equal(cx, x[cid])
        np.testing.assert_array_equal(cy, y[cid])
        assert isinstance(cx, np.ndarray) and cx.dtype == np.float32


def test_balanced_split_with_labels_is_the_same_random_split():
    ids, x, y = _labelled(500)
    a = partition((ids,), 5, labels=y, seed=3)
    b = partition((ids,), 5, seed=3)
    for ca, cb in zip(a, b):
        np.testing.assert_array_equal(ca[0], cb[0])


def test_partition_is_deterministic_given_seed():
    ids, x, y = _labelled(2000)
    a = partition((ids, y), 10, rho=0.7, kappa=-3.0, labels=y, seed=7)
    b = partition((ids, y), 10, rho=0.7, kappa=-3.0, labels=y, seed=7)
    c = partition((ids, y), 10, rho=0.7, kappa=-3.0, labels=y, seed=8)
    for ca, cb in zip(a, b):
        np.testing.assert_array_equal(ca[0], cb[0])
    assert any(not np.array_equal(ca[0], cc[0]) for ca, cc in zip(a, c))
    g = partition((ids,), 4, seed=np.random.default_rng(1))
    h = partition((ids,), 4, seed=np.random.default_rng(1))
    np.testing.assert_array_equal(g[0][0], h[0][0])


@pytest.mark.parametrize("rho,kappa", [(0.75, 0.95), (0.7, -3.0), (0.0, 0.5), (0.5, 0.0)])
def test_unbalanced_split_matches_formulas(rho, kappa):
    n, M = 10_000, 10
    ids, x, y = _labelled(n, lam=0.76)
    clients = partition((ids, y), M, rho=rho, kappa=kappa, labels=y, seed=0)
    _assert_exact_cover(clients, n)
    n_small = math.floor(n / M * (1 - rho))  # eq. (12)
    lam = 0.76
    target = lam + (1 - lam) * kappa  # eq. (13)
    maj_small = math.floor(target * n_small + 0.5)
    for _, cy in clients[: M // 2]:
        assert len(cy) == n_small
        assert int(np.sum(cy == 0)) == maj_small  # class 0 is the majority class here
    rest = n - (M // 2) * n_small
    large = [len(c[0]) for c in clients[M // 2 :]]
    assert sum(large) == rest and max(large) - min(large) <= 1
    assert min(large) >= math.floor(n / M * (1 + rho))
    # the large clients hold every row of each class the small ones did not take
    maj_large = sum(int(np.sum(cy == 0)) for _, cy in clients[M // 2 :])
    assert maj_large == round(lam * n) - (M // 2) * maj_small


def test_kappa_extremes_give_single_class_small_clients():
    n, M, lam = 10_000, 10, 0.76
    ids, x, y = _labelled(n, lam=lam)
    only_major = partition((y,), M, rho=0.5, kappa=1.0, labels=y, seed=0)
    assert all(np.all(c[0] == 0) for c in only_major[: M // 2])
    only_minor = partition((y,), M, rho=0.6, kappa=-lam / (1 - lam), labels=y, seed=0)
    assert all(np.all(c[0] == 1) for c in only_minor[: M // 2])


def test_majority_class_may_be_label_one():
    n, M = 4000, 4
    ids, x, y = _labelled(n, lam=0.7)
    y = 1.0 - y  # now label 1 is the majority class
    clients = partition((y,), M, rho=0.5, kappa=1.0, labels=y, seed=0)
    assert all(np.all(c[0] == 1) for c in clients[: M // 2])


def test_rho_without_labels_sets_sizes_only():
    n, M, rho = 1000, 4, 0.5
    clients = partition((np.arange(n),), M, rho=rho, seed=0)
    assert [len(c[0]) for c in clients[:2]] == [125, 125]
    assert [len(c[0]) for c in clients[2:]] == [375, 375]
    _assert_exact_cover(clients, n)


def test_odd_number_of_clients_gives_the_rest_to_the_large_ones():
    clients = partition((np.arange(1000),), 5, rho=0.5, seed=0)
    sizes = [len(c[0]) for c in clients]
    assert sizes[:2] == [100, 100] and sum(sizes[2:]) == 800
    _assert_exact_cover(clients, 1000)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(20, 400),
    num_clients=st.integers(2, 12),
    rho=st.floats(0.0, 0.6),
    kappa=st.floats(-0.3, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_row_assigned_exactly_once(n, num_clients, rho, kappa, seed):
    labels = (np.arange(n) % 3 == 0).astype(int)  # lambda about 2/3
    try:
        clients = partition((np.arange(n),), num_clients, rho, kappa, labels=labels, seed=seed)
    except ValueError as err:  # only the documented impossible settings may fail
        assert "rho" in str(err) or "kappa" in str(err) or "clients" in str(err)
        return
    assert len(clients) == num_clients
    assert all(len(c[0]) > 0 for c in clients)
    _assert_exact_cover(clients, n)


def test_partition_accepts_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    clients = partition((jnp.arange(10.0), jnp.ones((10, 2))), 2, seed=0)
    assert all(isinstance(a, np.ndarray) for c in clients for a in c)


def test_partition_indices_matches_partition():
    ids, x, y = _labelled(300)
    idx = partition_indices(300, 3, rho=0.3, kappa=0.5, labels=y, seed=2)
    clients = partition((ids,), 3, rho=0.3, kappa=0.5, labels=y, seed=2)
    for i, c in zip(idx, clients):
        np.testing.assert_array_equal(i, c[0])


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(num_clients=10, rho=1.0), ValueError, r"rho=1.0 is outside \[0, 1\)"),
        (dict(num_clients=10, rho=-0.1), ValueError, r"choose rho in \[0, 1\)"),
        (dict(num_clients=10, kappa=2.0, use_labels=True), ValueError, r"choose kappa in \["),
        (dict(num_clients=10, kappa=-10.0, use_labels=True), ValueError, r"outside \[0, 1\]"),
        # rho = 0, kappa = -3: five small clients of 1000 rows need 4800 minority rows > 2400
        (dict(num_clients=10, kappa=-3.0, use_labels=True), ValueError,
         r"minority-class rows but only 2400 exist; raise kappa .* or raise rho"),
        (dict(num_clients=10_001), ValueError, r"more than the 10000 rows.*num_clients <= 10000"),
        (dict(num_clients=0), ValueError, r"num_clients must be >= 1"),
        (dict(num_clients=2.0), TypeError, r"num_clients must be an int"),
        (dict(num_clients=1, rho=0.5), ValueError, r"at least 2 clients"),
        (dict(num_clients=10, kappa=0.5), ValueError, r"needs the class labels: pass labels=y"),
        (dict(num_clients=10, kappa=float("nan")), ValueError, r"kappa must be finite"),
        (dict(num_clients=10, rho="a lot"), TypeError, r"rho and kappa must be numbers"),
    ],
)
def test_partition_errors_name_the_setting(kwargs, exc, match):
    ids, x, y = _labelled(10_000)
    use_labels = kwargs.pop("use_labels", False)
    with pytest.raises(exc, match=match):
        partition((ids, y), labels=y if use_labels else None, **kwargs)


def test_partition_error_when_small_clients_would_be_empty():
    with pytest.raises(ValueError, match=r"small clients get floor\(n/M \(1 - rho\)\) = 0 rows"):
        partition((np.arange(10),), 10, rho=0.5)


@pytest.mark.parametrize(
    "labels,match",
    [
        (np.arange(100) % 3, r"labels must be binary 0/1.*labels=\(y == positive_class\)"),
        (np.where(np.arange(100) % 2, "yes", "no"), r"labels must be binary 0/1, got dtype"),
        (np.zeros(99), r"one label per row \(100\)"),
        (np.zeros((100, 1)), r"1-D array"),
    ],
)
def test_partition_rejects_bad_labels(labels, match):
    with pytest.raises(ValueError, match=match):
        partition((np.arange(100),), 4, rho=0.5, labels=labels)


def test_partition_rejects_bad_arrays():
    with pytest.raises(TypeError, match=r"got a single array; pass the model's arguments as a tuple, features and labels apart"):
        partition(np.zeros((10, 2)), 2)
    with pytest.raises(ValueError, match="disagree on their leading dimension"):
        partition((np.zeros((10, 2)), np.zeros(9)), 2)
    with pytest.raises(ValueError, match="contains NaN or inf"):
        partition((np.array([1.0, np.nan, 2.0]),), 2)


# --------------------------------------------------------------------------- partition_by


def test_partition_by_one_client_per_sorted_group_in_row_order():
    x = np.arange(8.0)
    groups = np.array(["b", "a", "c", "a", "b", "c", "c", "a"])
    clients = partition_by((x, groups.astype("S1").view(np.uint8)), groups)
    assert len(clients) == 3
    np.testing.assert_array_equal(clients[0][0], [1.0, 3.0, 7.0])  # group "a"
    np.testing.assert_array_equal(clients[1][0], [0.0, 4.0])  # group "b"
    np.testing.assert_array_equal(clients[2][0], [2.0, 5.0, 6.0])  # group "c"
    numeric = partition_by((x,), np.array([3, 1, 3, 2, 1, 1, 2, 3]))
    np.testing.assert_array_equal(numeric[0][0], [1.0, 4.0, 5.0])


def test_partition_by_errors():
    with pytest.raises(ValueError, match=r"one group value per row \(4\)"):
        partition_by((np.zeros(4),), np.zeros(3))
    with pytest.raises(ValueError, match="groups contains NaN"):
        partition_by((np.zeros(3),), np.array([0.0, np.nan, 1.0]))
    with pytest.raises(TypeError, match="cannot be sorted"):
        partition_by((np.zeros(3),), np.array([1, "a", 2.0], dtype=object))


# --------------------------------------------------------------------------- validate_clients


def test_validate_clients_converts_to_numpy_tuples():
    out = validate_clients([[np.zeros((2, 3)), [1, 2]], (np.ones((1, 3)), np.array([3]))])
    assert isinstance(out, list) and all(isinstance(c, tuple) for c in out)
    assert all(isinstance(a, np.ndarray) for c in out for a in c)


@pytest.mark.parametrize(
    "clients,exc,match",
    [
        (np.zeros((2, 3)), TypeError, r"clients must be a list of per-client tuples"),
        ({"a": 1}, TypeError, r"clients must be a list"),
        ([], ValueError, r"clients is empty"),
        ((np.zeros((3, 2)), np.zeros(3)), TypeError, r"client 0 is a single array.*\[\(x, y\)\]"),
        ([5], TypeError, r"client 0 must be a tuple of arrays"),
        ([()], ValueError, r"client 0 is an empty tuple"),
        ([(np.zeros(3),), (np.zeros(3), np.zeros(3))], ValueError,
         r"client 1 has 2 arrays but client 0 has 1"),
        ([(np.zeros((3, 2)), np.zeros(4))], ValueError, r"client 0 disagree on their leading"),
        ([(np.zeros((3, 2)),), (np.zeros((3, 4)),)], ValueError,
         r"array 0 of client 1 has per-row shape \(4,\) but client 0 has \(2,\)"),
        ([(np.zeros(3, np.float32),), (np.zeros(3, np.float64),)], ValueError,
         r"cast all clients to one dtype"),
        ([(np.zeros(3),), (np.array([0.0, np.inf]),)], ValueError,
         r"array 0 of client 1 contains NaN or inf"),
        ([(np.zeros(3),), (np.zeros(0),)], ValueError, r"client 1 is empty \(0 rows\)"),
        ([(np.float64(1.0),)], ValueError, r"is a scalar; every array needs a leading axis"),
        ([(np.array(["a", "b"]),)], TypeError, r"convert it to a numeric dtype"),
        ([([[1, 2], [3]],)], TypeError, r"cannot be converted to a NumPy array"),
    ],
)
def test_validate_clients_errors(clients, exc, match):
    with pytest.raises(exc, match=match):
        validate_clients(clients)


# --------------------------------------------------------------------------- pad_clients


def test_pad_clients_shapes_mask_and_values():
    clients = [
        (np.ones((3, 2), np.float32), np.array([1, 2, 3], np.int32)),
        (2 * np.ones((1, 2), np.float32), np.array([4], np.int32)),
    ]
    padded = pad_clients(clients)
    assert isinstance(padded, PaddedClients)
    x, y = padded.arrays
    assert x.shape == (2, 3, 2) and x.dtype == np.float32
    assert y.shape == (2, 3) and y.dtype == np.int32
    np.testing.assert_array_equal(padded.sizes, [3, 1])
    assert padded.sizes.dtype == np.int32
    np.testing.assert_array_equal(padded.mask, [[True, True, True], [True, False, False]])
    np.testing.assert_array_equal(x[1], [[2, 2], [0, 0], [0, 0]])
    np.testing.assert_array_equal(y[0], [1, 2, 3])
    assert not padded.mask[~padded.mask].any() and np.all(x[~padded.mask] == 0)


def test_pad_clients_fixed_size_and_pytree():
    jax = pytest.importorskip("jax")
    padded = pad_clients([(np.zeros(2),), (np.zeros(4),)], size=6)
    assert padded.arrays[0].shape == (2, 6) and padded.mask.sum() == 6
    leaves = jax.tree_util.tree_leaves(padded)
    assert len(leaves) == 3
    with pytest.raises(ValueError, match=r"size=3 is smaller than the largest client \(4 rows\)"):
        pad_clients([(np.zeros(2),), (np.zeros(4),)], size=3)
    with pytest.raises(TypeError, match="size must be an int"):
        pad_clients([(np.zeros(2),)], size=2.5)


def test_pad_clients_validates():
    with pytest.raises(ValueError, match="client 1 is empty"):
        pad_clients([(np.zeros(2),), (np.zeros(0),)])
