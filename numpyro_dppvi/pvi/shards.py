"""Fixed local partitions ("shards") of each client's data (Heikkila et al. 2023, Algorithm 2 step 1).

Update-perturbation methods clip one change per shard, so what one record can move is one shard's
term, **provided no other record changes shard when that record is added, removed or replaced**.
A seeded permutation of ``range(n)`` split into equal parts fails this under add/remove: one more
row reshuffles every shard (issue 12: the noise-free release moved by 5C against 2C accounted).
So a record's shard here depends on that record alone:

* ``shards="rows"``: every record is its own shard ("one row per virtual client"), ``N_m = n_m``.
* ``shards=K`` (an int) or ``shards=f`` (``N_m = f(n_m)``): record ``i`` goes to shard
  ``floor(N_m h_i / 2^64)`` where ``h_i`` is a keyed 64-bit BLAKE2b hash of the record's own bytes
  under a secret derived from the fit's key (:func:`numpyro_dppvi.keys.keyed_row_hashes`). To
  anyone without the key the assignment is iid uniform over shards; shard sizes are random
  (multinomial) and a shard may be empty (it then releases nothing).
* Under ``neighbouring="substitute"`` (``by_position=True``) the hash is of the record's **position**
  in the client's data instead of its bytes: a replaced record keeps its position, hence its shard.
  Hashing the bytes, the replacing record usually hashed to another shard, so two shards' clipped
  changes moved (2.86 C in a random search, up to 4 C) against 2 C charged (issue 24, finding 2).
  Under add/remove the position would not do (removing a row moves every later row), the bytes do.

**Sensitivity of the released sum of clipped shard changes** (the number of shards ``N_m`` is derived
from the client's public size, :mod:`numpyro_dppvi.privacy.sizes`: a declared bound makes it the same for
``D`` and its neighbour under add/remove, empty shards adding nothing; under substitute the sizes are
equal; with undeclared sizes under add/remove the count may differ between neighbours and discloses the
size, which the fit warns about):

* hashed shards, either relation: the other records keep their shards (their hashes do not
  change; under substitute no record changes position), so exactly one shard's rows change; its clipped change moves inside the ball of radius
  ``C``: ``Delta = 2C`` (``sensitivity(C, relation, "shard_update")``);
* one record per shard, add/remove: the record's own shard appears or disappears and no other
  shard changes: ``Delta = C``; substitute: the record's shard changes: ``Delta = 2C``
  (``sensitivity(C, relation, "sum_of_records")``).

Each shard also carries an identity (``ids``) from which its private randomness (Monte Carlo
draws) is keyed: its index for hashed shards, the record's keyed hash for one-record shards. So an
unchanged shard draws the same randomness in both neighbouring data sets, and the empirical
sensitivity tests can compare the noise-free releases of ``D`` and ``D'`` realisation by
realisation, with the shards re-derived as the fit derives them.

For ``vmap`` over clients and shards the rows are laid out as ``[M, K_max, S_max, ...]`` with a
mask, ``K_max = max_m N_m`` and ``S_max`` at least the largest shard: hashed shards pad to
:func:`padded_shard_rows`, a bound from the sizes and shard counts alone (not from where the rows
hashed), so that the layout's shape, and with it the compiled round, does not change with the fit's
key (issue 25: every new key compiled anew).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ..keys import keyed_row_hashes

ROWS = "rows"


class ShardedClients(NamedTuple):
    """Every client's data split into shards, padded for ``vmap`` over clients and shards.

    Fields: ``arrays`` (the data arrays, each ``[M, K_max, S_max, ...]``), ``mask`` (``[M, K_max,
    S_max]`` bool: real rows), ``num_shards`` (``[M]``: the planned ``N_m``, which may exceed the
    non-empty shards), ``sizes`` (``[M]``: the rows ``n_m``) and ``ids`` (``[M, K_max]`` uint32: the
    shard identities that key each shard's randomness).
    """

    arrays: tuple  # each [M, K_max, S_max, ...]
    mask: np.ndarray  # [M, K_max, S_max] bool
    num_shards: np.ndarray  # [M] int: N_m (planned; may exceed the number of non-empty shards)
    sizes: np.ndarray  # [M] int: n_m
    ids: np.ndarray  # [M, K_max] uint32: shard identities keying each shard's randomness


def shard_counts(sizes, shards: int | str | tuple | Callable[[int], int]) -> np.ndarray:
    """``N_m`` per client: ``"rows"`` (``n_m``), a fixed int, ``shards(n_m)`` (e.g. ``lambda n: ceil(n / 100)``), or a
    tuple of one count per client (what a fit's ``config["shards"]`` records, so that ``result.settings`` re-runs it)."""
    sizes = np.asarray(sizes, int)
    if isinstance(shards, tuple) and len(shards) != len(sizes):
        raise ValueError(f"shards={shards!r} gives {len(shards)} counts for {len(sizes)} clients; give one per client")
    counts = []
    for m, n in enumerate(sizes):
        k = int(n) if shards == ROWS else (shards(int(n)) if callable(shards) else
                                           shards[m] if isinstance(shards, tuple) else shards)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"shards must give a positive integer per client, got {k!r} for a client of {n} rows")
        if k > n:
            raise ValueError(f"{k} shards for a client with {n} rows would leave shards empty; use at most {n} "
                             "(or shards='rows': one record per shard)")
        counts.append(int(k))
    return np.asarray(counts)


#: Chance that some hashed shard of a fit is larger than :func:`padded_shard_rows` (the layout then takes the
#: largest shard, and that fit compiles a program of its own). The padding's cost against the largest shard
#: (median of 300 draws; 10 clients): 4,500 rows in 450 shards 27 rows against 23 (+17%), in 45 shards 143
#: against 131 (+9%); 200 rows in 20 shards 24 against 19 (+26%). At 1e-3 it would be +13% to +37%.
SHARD_OVERFLOW = 1e-2


def padded_shard_rows(sizes, counts, tail: float = SHARD_OVERFLOW) -> int:
    """Rows per shard to pad hashed shards to, from the clients' sizes and shard counts only (not from where the rows
    hashed; a padded shape is not released): the least ``s`` with
    ``P(n_{m,k} > s) <= tail / sum_m N_m`` for every client, ``n_{m,k} ~ Binomial(n_m, 1 / N_m)`` (to anyone without
    the key a distinct record's shard is uniform), so that by the union bound no shard of a fit is larger with
    probability at least ``1 - tail``. Repeated records share a shard (their bytes hash alike), which makes large
    shards more likely: such a fit may take its own layout more often, never a wrong one."""
    from scipy.stats import binom

    share = tail / max(int(np.sum(counts)), 1)
    bounds = [int(binom.isf(share, int(n), 1.0 / int(k))) for n, k in zip(sizes, counts) if n > 0]
    return max(bounds, default=1)


def assign(arrays, num_shards: int, secret: bytes, one_per_row: bool,
           by_position: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(shard of each row [n], id of each shard [N])`` for one client (see the module docstring)."""
    hashes = keyed_row_hashes(arrays, secret)
    if one_per_row:
        return np.arange(len(hashes)), (hashes & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    if by_position:
        hashes = keyed_row_hashes((np.arange(len(hashes), dtype=np.int64),), secret)
    fraction = hashes.astype(np.float64) / 2.0**64
    shard = np.minimum((fraction * num_shards).astype(np.int64), num_shards - 1)
    return shard, np.arange(num_shards, dtype=np.uint32)


def make_shards(clients, shards, secret: bytes, counts=None, by_position: bool = False) -> ShardedClients:
    """Assign every client's rows to its shards and pad to ``[M, K_max, S_max, ...]``.

    ``counts`` (the planned ``N_m``) default to :func:`shard_counts` of the clients' sizes; pass the
    planned counts to lay out a neighbouring data set under the same settings. ``by_position``: hash
    positions, not bytes (the substitute relation; module docstring).
    """
    sizes = np.array([len(c[0]) for c in clients])
    counts = shard_counts(sizes, shards) if counts is None else np.asarray(counts, int)
    one_per_row = shards == ROWS
    layout = [assign(c, int(k) if not one_per_row else len(c[0]), secret, one_per_row, by_position)
              for c, k in zip(clients, counts)]
    slots = [len(ids) for _, ids in layout]
    k_max = max(slots)
    s_max = max(int(np.bincount(rows, minlength=1).max()) if len(rows) else 1 for rows, _ in layout)
    if not one_per_row:
        s_max = max(s_max, padded_shard_rows(sizes, counts))
    m = len(clients)
    arrays = tuple(np.zeros((m, k_max, s_max) + np.shape(a)[1:], np.asarray(a).dtype) for a in clients[0])
    mask = np.zeros((m, k_max, s_max), bool)
    ids = np.zeros((m, k_max), np.uint32)
    for i, (client, (shard_of_row, shard_ids)) in enumerate(zip(clients, layout)):
        ids[i, : len(shard_ids)] = shard_ids
        order = np.argsort(shard_of_row, kind="stable")  # rows of a shard keep their relative order
        shard_sorted = shard_of_row[order]
        starts = np.searchsorted(shard_sorted, shard_sorted, side="left")
        slot = np.arange(len(order)) - starts
        for j, a in enumerate(client):
            arrays[j][i, shard_sorted, slot] = np.asarray(a)[order]
        mask[i, shard_sorted, slot] = True
    return ShardedClients(arrays, mask, counts, sizes, ids)
