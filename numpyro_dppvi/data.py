"""Client data: splitting a data set over federated clients, validation and padding.

A client's data is a tuple of NumPy arrays whose leading axis is the individual, e.g.
``(x_m, y_m)``. All functions here work on host NumPy arrays (they run once, before a fit);
:func:`pad_clients` produces the static-shape stacked form that ``vmap`` over clients needs.

The unbalanced split is the scheme of Sharma et al. (2019), Appendix C, eqs. (12)-(13), also
used by Heikkila et al. (TMLR 2023), Appendix B. See :func:`partition`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "PaddedClients",
    "pad_clients",
    "partition",
    "partition_by",
    "partition_indices",
    "validate_clients",
]


class PaddedClients(NamedTuple):
    """Clients stacked to one static shape (a pytree, so it can go through ``vmap``/``jit``).

    Attributes:
        arrays: tuple with one array per data array of a client, each ``[M, n_max, ...]``;
            rows past a client's size are zeros.
        mask: ``[M, n_max]`` bool, True on real rows.
        sizes: ``[M]`` int32, the number of real rows of each client.
    """

    arrays: tuple
    mask: np.ndarray
    sizes: np.ndarray


# --------------------------------------------------------------------------- validation


def _as_array_tuple(data, what: str, finite: bool = True) -> tuple[np.ndarray, ...]:
    """Convert one client (a tuple/list of arrays) to a tuple of NumPy arrays."""
    if isinstance(data, (np.ndarray, np.generic)) or hasattr(data, "__array__"):
        raise TypeError(
            f"{what} must be a tuple of arrays such as (x, y), got a single array; pass the model's arguments "
            "as a tuple, features and labels apart, e.g. (df[features].to_numpy(), df[label].to_numpy()), or (x,) "
            "for a model of x alone."
        )
    if not isinstance(data, (tuple, list)):
        raise TypeError(
            f"{what} must be a tuple of arrays such as (x, y), got {type(data).__name__}."
        )
    if len(data) == 0:
        raise ValueError(f"{what} is an empty tuple; give at least one array, e.g. (x, y).")
    arrays = []
    for j, a in enumerate(data):
        try:
            arr = np.asarray(a)
        except Exception as err:  # ragged lists and the like
            raise TypeError(
                f"array {j} of {what} cannot be converted to a NumPy array ({err}); "
                "pass rectangular numeric arrays."
            ) from err
        if arr.dtype == object or arr.dtype.kind in "USV":
            raise TypeError(
                f"array {j} of {what} has dtype {arr.dtype}; convert it to a numeric dtype "
                "(e.g. one-hot encode categorical columns)."
            )
        if arr.ndim == 0:
            raise ValueError(
                f"array {j} of {what} is a scalar; every array needs a leading axis over "
                "individuals (reshape it to shape [n, ...])."
            )
        arrays.append(arr)
    lead = {a.shape[0] for a in arrays}
    if len(lead) > 1:
        shapes = ", ".join(str(a.shape) for a in arrays)
        raise ValueError(
            f"the arrays of {what} disagree on their leading dimension (shapes {shapes}); "
            "every array must have one row per individual."
        )
    for j, arr in enumerate(arrays if finite else ()):
        if arr.dtype.kind in "fc" and not np.all(np.isfinite(arr)):
            bad = np.flatnonzero(~np.all(np.isfinite(arr.reshape(len(arr), -1)), axis=1)) if arr.ndim else [0]
            rows = ", ".join(str(int(i)) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
            raise ValueError(
                f"array {j} of {what} contains NaN or inf in {len(bad)} row(s) ({rows}); impute or drop "
                "those rows first."
            )
    return tuple(arrays)


def validate_clients(clients, finite: bool = True) -> list[tuple[np.ndarray, ...]]:
    """Check a list of clients and return it as ``list[tuple[np.ndarray, ...]]``.

    Checks, each failing with a ``TypeError``/``ValueError`` that names the fix: ``clients`` is
    a non-empty list (or tuple) of clients; every client is a tuple of arrays, all clients with
    the same number of arrays; the arrays of a client agree on their leading dimension; array
    ``j`` has the same trailing shape and dtype in every client; float arrays hold no NaN/inf;
    no client is empty.

    Args:
      clients: a list (or tuple) of clients, each a tuple of arrays with one row per individual, e.g.
        ``[(x_1, y_1), (x_2, y_2)]``.
      finite: check that float arrays hold no NaN/inf (default). ``False`` leaves NaN/inf alone (a Flower
        node: see :func:`numpyro_dppvi.flower.local_update.load_data`).

    Returns:
      the clients as a list of tuples of NumPy arrays.
    """
    if isinstance(clients, (np.ndarray, np.generic)) or not isinstance(clients, (list, tuple)):
        raise TypeError(
            "clients must be a list of per-client tuples of arrays, e.g. [(x1, y1), (x2, y2)]; "
            f"got {type(clients).__name__}."
        )
    if len(clients) == 0:
        raise ValueError("clients is empty; give at least one client, e.g. [(x, y)].")
    out = []
    for m, client in enumerate(clients):
        if isinstance(client, (np.ndarray, np.generic)) or hasattr(client, "__array__"):
            raise TypeError(
                f"client {m} is a single array, not a tuple of arrays; if you passed one "
                "client's (x, y), wrap it in a list: [(x, y)]; otherwise make each client a "
                "tuple such as (x_m, y_m)."
            )
        out.append(_as_array_tuple(client, f"client {m}", finite))
    first = out[0]
    for m, client in enumerate(out):
        if len(client) != len(first):
            raise ValueError(
                f"client {m} has {len(client)} arrays but client 0 has {len(first)}; every "
                "client must hold the same arrays, e.g. (x_m, y_m)."
            )
        for j, (a, a0) in enumerate(zip(client, first)):
            if a.shape[1:] != a0.shape[1:]:
                raise ValueError(
                    f"array {j} of client {m} has per-row shape {a.shape[1:]} but client 0 "
                    f"has {a0.shape[1:]}; all clients need the same columns."
                )
            if a.dtype != a0.dtype:
                raise ValueError(
                    f"array {j} of client {m} has dtype {a.dtype} but client 0 has "
                    f"{a0.dtype}; cast all clients to one dtype (e.g. .astype(np.float32))."
                )
        if client[0].shape[0] == 0:
            raise ValueError(
                f"client {m} is empty (0 rows); drop it or give it data (for partition: use "
                "fewer clients or a smaller rho)."
            )
    return out


# --------------------------------------------------------------------------- partitioning


def _check_num_clients(num_clients, n: int) -> int:
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
        raise TypeError(
            f"num_clients must be an int, got {type(num_clients).__name__}."
        )
    num_clients = int(num_clients)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
    if num_clients > n:
        raise ValueError(
            f"num_clients={num_clients} is more than the {n} rows of data; every client "
            f"needs at least one row: use num_clients <= {n}."
        )
    return num_clients


def _check_labels(labels, n: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.shape[0] != n:
        raise ValueError(
            f"labels must be a 1-D array with one label per row ({n}), got shape "
            f"{labels.shape}; pass e.g. labels=y (flattened)."
        )
    if labels.dtype == object or labels.dtype.kind in "USV":
        raise ValueError(
            f"labels must be binary 0/1, got dtype {labels.dtype}; map them, e.g. "
            "labels=(y == positive_class)."
        )
    values = np.unique(labels)
    if not np.all(np.isin(values, [0, 1])):
        shown = values[:5].tolist()
        raise ValueError(
            f"labels must be binary 0/1 for the rho/kappa split, got values {shown}"
            f"{'...' if values.size > 5 else ''}; map them, e.g. labels=(y == positive_class)."
        )
    return labels.astype(bool)


def _split_evenly(indices: np.ndarray, parts: int) -> list[np.ndarray]:
    return [np.asarray(p) for p in np.array_split(indices, parts)]


def partition_indices(
    n: int,
    num_clients: int,
    rho: float = 0.0,
    kappa: float = 0.0,
    labels=None,
    seed=0,
) -> list[np.ndarray]:
    """Row indices of each client under the small/large client scheme of :func:`partition`.

    Returns one int array per client; together they hold every row of ``range(n)`` exactly
    once. Same arguments and rules as :func:`partition`.
    """
    num_clients = _check_num_clients(num_clients, n)
    try:
        rho = float(rho)
        kappa = float(kappa)
    except (TypeError, ValueError) as err:
        raise TypeError(f"rho and kappa must be numbers ({err}).") from err
    if not (0.0 <= rho < 1.0):
        raise ValueError(
            f"rho={rho} is outside [0, 1): rho=0 gives equal client sizes and rho -> 1 "
            "leaves the small clients empty; choose rho in [0, 1)."
        )
    if not math.isfinite(kappa):
        raise ValueError(f"kappa must be finite, got {kappa}.")
    if labels is not None:
        labels = _check_labels(labels, n)
    elif kappa != 0.0:
        raise ValueError(
            f"kappa={kappa} controls the class balance of the small clients and needs the "
            "class labels: pass labels=y (binary 0/1), or set kappa=0."
        )
    rng = np.random.default_rng(seed)

    if rho == 0.0 and kappa == 0.0:
        return _split_evenly(rng.permutation(n), num_clients)

    if num_clients < 2:
        raise ValueError(
            "rho/kappa splits need at least 2 clients (half small, half large); use "
            "num_clients >= 2 or set rho=0 and kappa=0."
        )
    num_small = num_clients // 2
    num_large = num_clients - num_small
    n_small = math.floor(n / num_clients * (1.0 - rho))
    if n_small < 1:
        raise ValueError(
            f"with rho={rho}, {num_clients} clients and {n} rows the small clients get "
            f"floor(n/M (1 - rho)) = {n_small} rows; lower rho or use fewer clients."
        )

    if labels is None:
        perm = rng.permutation(n)
        small_rows = perm[: num_small * n_small]
        smalls = [small_rows[k * n_small : (k + 1) * n_small] for k in range(num_small)]
        rest = perm[num_small * n_small :]
    else:
        ones = int(labels.sum())
        majority_is_one = ones > n - ones  # a tie counts 0 as the majority class
        is_majority = labels if majority_is_one else ~labels
        majority = np.flatnonzero(is_majority)
        minority = np.flatnonzero(~is_majority)
        lam = majority.size / n
        target = lam + (1.0 - lam) * kappa  # Sharma et al. (2019) eq. (13)
        if not (-1e-12 <= target <= 1.0 + 1e-12):
            low = -lam / (1.0 - lam) if lam < 1.0 else -math.inf
            raise ValueError(
                f"kappa={kappa} gives the small clients a majority-class fraction "
                f"lambda + (1 - lambda) kappa = {target:.4f} (lambda = {lam:.4f}), outside "
                f"[0, 1]; choose kappa in [{low:.4f}, 1]."
            )
        target = min(max(target, 0.0), 1.0)
        maj_per_small = math.floor(target * n_small + 0.5)
        min_per_small = n_small - maj_per_small
        # Majority rows never run short: the small clients hold at most n/2 rows in total and
        # the majority class has at least n/2. Only the minority class can.
        if num_small * min_per_small > minority.size:
            raise ValueError(
                f"rho={rho}, kappa={kappa}: the {num_small} small clients need "
                f"{num_small * min_per_small} minority-class rows but only {minority.size} "
                "exist; raise kappa (towards 1) or raise rho (smaller small clients)."
            )
        majority = rng.permutation(majority)
        minority = rng.permutation(minority)
        smalls = []
        for k in range(num_small):
            rows = np.concatenate(
                [
                    majority[k * maj_per_small : (k + 1) * maj_per_small],
                    minority[k * min_per_small : (k + 1) * min_per_small],
                ]
            )
            smalls.append(rng.permutation(rows))
        rest = np.concatenate(
            [majority[num_small * maj_per_small :], minority[num_small * min_per_small :]]
        )
        rest = rng.permutation(rest)

    if rest.size < num_large:
        raise ValueError(
            f"rho={rho}: after the small clients only {rest.size} rows remain for "
            f"{num_large} large clients; use fewer clients."
        )
    return smalls + _split_evenly(rest, num_large)


def partition(
    arrays,
    num_clients: int,
    rho: float = 0.0,
    kappa: float = 0.0,
    labels=None,
    seed=0,
) -> list[tuple[np.ndarray, ...]]:
    """Split a data set over ``num_clients`` clients, balanced or with small/large clients.

    Scheme of Sharma et al. (2019), Appendix C, and Heikkila et al. (2023), Appendix B. With
    ``n`` rows and ``M`` clients, the first ``floor(M/2)`` clients are *small* and the others
    *large*:

    - size, eq. (12): each small client holds ``n_small = floor(n/M (1 - rho))`` rows; the large
      clients share all remaining rows as evenly as possible (so, for even ``M``, about
      ``floor(n/M (1 + rho))`` each, plus the rows the floors left over). ``rho`` is in ``[0, 1)``.
    - class balance, eq. (13): with ``lambda`` the fraction of the overall majority class, each
      small client's fraction of that class is
      ``lambda_small = lambda + (1 - lambda) * kappa`` (rounded to whole rows), which must lie in
      ``[0, 1]``, i.e. ``kappa in [-lambda/(1 - lambda), 1]``. ``kappa = 0`` keeps the overall
      balance, ``0 < kappa <= 1`` gives the small clients more of the majority class (``kappa = 1``:
      only the majority class), ``kappa < 0`` gives them less, and below
      ``kappa = -(2 lambda - 1)/(2 (1 - lambda))`` the overall *minority* class becomes their
      majority (Adult, ``lambda = 0.76``: ``kappa = -3`` gives ``lambda_small = 0.04``, i.e. 96%
      ">50K"; ``kappa = -lambda/(1 - lambda)``: only the minority class). The large clients'
      rows are drawn at random from what is left.

    ``rho = kappa = 0`` is a balanced random split (sizes differ by at most one row). Without
    ``labels`` only ``rho`` applies (random class mix); ``kappa != 0`` needs ``labels``.

    Args:
        arrays: tuple of arrays with a common leading axis over individuals, e.g. ``(x, y)``.
        num_clients: ``M``, at least 1 and at most the number of rows (at least 2 when
            ``rho`` or ``kappa`` is non-zero).
        rho: size imbalance in ``[0, 1)``.
        kappa: class imbalance of the small clients (see above).
        labels: binary 0/1 labels, one per row (e.g. ``y``); needed when ``kappa != 0``.
        seed: seed or ``numpy.random.Generator``; the split is a deterministic function of it.

    Returns:
        ``list`` of ``M`` tuples ``(a_1[idx_m], a_2[idx_m], ...)``, rows in random order within a
        client; every row is in exactly one client.

    Raises:
        ValueError: impossible settings (``rho`` outside ``[0, 1)``, a ``kappa`` that needs more
            rows of a class than exist or a fraction outside ``[0, 1]``, more clients than rows,
            non-binary labels, empty small clients), with the setting to change.
    """
    arrays = _as_array_tuple(arrays, "arrays")
    n = arrays[0].shape[0]
    idx = partition_indices(n, num_clients, rho=rho, kappa=kappa, labels=labels, seed=seed)
    return [tuple(a[i] for a in arrays) for i in idx]


def partition_by(arrays, groups) -> list[tuple[np.ndarray, ...]]:
    """One client per distinct value of ``groups`` (in sorted order of the values).

    Rows keep their original order within a client.

    Args:
      arrays: tuple of arrays with a common leading axis over individuals, e.g. ``(x, y)``.
      groups: a 1-D array with one value per row (e.g. a hospital or brood id), of one sortable type,
        without NaN or inf.

    Returns:
      a list of tuples ``(a_1[rows_g], a_2[rows_g], ...)``, one per group.
    """
    arrays = _as_array_tuple(arrays, "arrays")
    n = arrays[0].shape[0]
    groups = np.asarray(groups)
    if groups.ndim != 1 or groups.shape[0] != n:
        raise ValueError(
            f"groups must be a 1-D array with one group value per row ({n}), got shape "
            f"{groups.shape}."
        )
    if groups.dtype.kind in "fc" and not np.all(np.isfinite(groups)):
        raise ValueError("groups contains NaN or inf; give every row a group value.")
    try:
        values, inverse = np.unique(groups, return_inverse=True)
    except TypeError as err:
        raise TypeError(
            f"groups values cannot be sorted ({err}); use one type, e.g. groups.astype(str)."
        ) from err
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=values.size))[:-1]
    return [tuple(a[i] for a in arrays) for i in np.split(order, bounds)]


def pad_clients(clients, size: int | None = None) -> PaddedClients:
    """Stack clients to ``[M, n_max, ...]`` with zero padding, a mask and the sizes.

    Clients are validated first (:func:`validate_clients`).

    Args:
      clients: a list of clients, each a tuple of arrays such as ``(x_m, y_m)``.
      size: ``n_max``, the padded number of rows, at least the largest client's; None (the default): the
        largest client size. Fixing ``size`` keeps shapes static across calls, so jitted code does not
        recompile.

    Returns:
      a :class:`~numpyro_dppvi.data.PaddedClients`.
    """
    clients = validate_clients(clients)
    sizes = np.array([c[0].shape[0] for c in clients], dtype=np.int32)
    n_max = int(sizes.max())
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise TypeError(f"size must be an int, got {type(size).__name__}.")
        if size < n_max:
            raise ValueError(
                f"size={size} is smaller than the largest client ({n_max} rows); use "
                f"size >= {n_max} or size=None."
            )
        n_max = int(size)
    num_clients = len(clients)
    stacked = []
    for j, a0 in enumerate(clients[0]):
        out = np.zeros((num_clients, n_max) + a0.shape[1:], dtype=a0.dtype)
        for m, client in enumerate(clients):
            out[m, : sizes[m]] = client[j]
        stacked.append(out)
    mask = np.arange(n_max)[None, :] < sizes[:, None]
    return PaddedClients(arrays=tuple(stacked), mask=mask, sizes=sizes)
