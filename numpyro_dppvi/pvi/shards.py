"""Fixed local partitions ("shards") of each client's data (Heikkila et al. 2023, Algorithm 2 step 1).

Client ``m`` splits its ``n_m`` rows once, at random, into ``N_m`` disjoint shards of near-equal size;
the split never changes during a fit (local averaging keeps an optimiser state per shard; virtual
clients keep a factor per shard). For ``vmap`` over clients and shards the rows are laid out as
``[M, K_max, S_max, ...]`` with a mask, ``K_max = max_m N_m`` and ``S_max`` the largest shard.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


class ShardedClients(NamedTuple):
    arrays: tuple  # each [M, K_max, S_max, ...]
    mask: np.ndarray  # [M, K_max, S_max] bool
    num_shards: np.ndarray  # [M] int: N_m
    sizes: np.ndarray  # [M] int: n_m


def shard_counts(sizes, shards: int | Callable[[int], int]) -> np.ndarray:
    """``N_m`` per client: a fixed int, or ``shards(n_m)`` (e.g. ``lambda n: ceil(n / 100)``)."""
    counts = []
    for n in np.asarray(sizes, int):
        k = shards(int(n)) if callable(shards) else shards
        if isinstance(k, bool) or int(k) != k or k < 1:
            raise ValueError(f"shards must give a positive integer per client, got {k!r} for a client of {n} rows")
        if k > n:
            raise ValueError(f"{k} shards for a client with {n} rows leaves empty shards; use at most {n}")
        counts.append(int(k))
    return np.asarray(counts)


def make_shards(clients, shards, seed: int = 0) -> ShardedClients:
    """Split every client's rows at random into its shards and pad to ``[M, K_max, S_max, ...]``."""
    sizes = np.array([len(c[0]) for c in clients])
    counts = shard_counts(sizes, shards)
    rng = np.random.default_rng(seed)
    k_max = int(counts.max())
    s_max = int(max(int(np.ceil(n / k)) for n, k in zip(sizes, counts)))
    m = len(clients)
    arrays = tuple(np.zeros((m, k_max, s_max) + a.shape[1:], a.dtype) for a in clients[0])
    mask = np.zeros((m, k_max, s_max), bool)
    for i, client in enumerate(clients):
        for k, rows in enumerate(np.array_split(rng.permutation(sizes[i]), counts[i])):
            for j, a in enumerate(client):
                arrays[j][i, k, : len(rows)] = a[rows]
            mask[i, k, : len(rows)] = True
    return ShardedClients(arrays, mask, counts, sizes)
