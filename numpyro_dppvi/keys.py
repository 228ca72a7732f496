"""The randomness of a fit: secret by default, derived by purpose, never published.

Threat (issue 11): privacy noise is only as secret as the key it is drawn from. With a public
default key anyone can rerun the public algorithm on ``D`` and on a neighbour ``D'`` and see which
one reproduces a published posterior; two fits with the same key cancel their noise.

* Without ``rng_key`` a fit draws 64 random bits from the operating system (:mod:`secrets`), the
  full key of JAX's threefry generator. They are kept in the fit's private state only (the private
  checkpoint, used to resume) and never in a result or a published file.
* With ``rng_key`` (reproducible research), the ledger records ``seed="user_key"`` and its report
  says that the guarantee rests on that key staying secret.
* Every other secret (the per-record shard hash key, the keyed fingerprint of the data) is derived
  from the fit key with :func:`derived_bytes`, so nothing saved lets anyone recompute the noise.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import jax
import jax.numpy as jnp
import numpy as np

from .program_cache import committed, to_device

#: ``fold_in`` tags of the secrets derived from a fit's key (distinct from any round index).
SHARD_HASH_TAG = 0x53484152  # "SHAR"
FINGERPRINT_TAG = 0x46505249  # "FPRI"


def key_data(rng_key) -> jax.Array:
    """Raw uint32 data ``[2]`` of a JAX PRNG key (typed ``jax.random.key`` or legacy ``PRNGKey``)."""
    dtype = getattr(rng_key, "dtype", None)
    if dtype is None:
        raise TypeError(f"rng_key must be a JAX PRNG key such as jax.random.key(...) or None (a secret key "
                        f"from the operating system), got {type(rng_key).__name__}")
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng_key)
    if dtype != jnp.uint32 or tuple(rng_key.shape[-1:]) != (2,):
        raise TypeError(f"rng_key must be a JAX PRNG key such as jax.random.key(...) or None, got an array of "
                        f"{dtype} {tuple(rng_key.shape)}")
    return jnp.asarray(rng_key)


def secret_key_data() -> jax.Array:
    """64 bits from the operating system's entropy, as threefry key data ``[2]`` uint32."""
    return to_device(np.frombuffer(secrets.token_bytes(8), dtype=np.uint32).copy())


def resolve(rng_key) -> tuple[jax.Array, str]:
    """``(key data, seed kind)``: the user's key (``"user_key"``) or a fresh OS secret (``"os_entropy"``)."""
    if rng_key is None:
        return secret_key_data(), "os_entropy"
    return key_data(rng_key), "user_key"


def derived_bytes(data, tag: int, num_bytes: int = 32) -> bytes:
    """``num_bytes`` secret bytes for one purpose (``tag``), derived from the fit's key data."""
    # committed, as a round's state is: one program whether the key comes from a state or a checkpoint
    key = jax.random.fold_in(jax.random.wrap_key_data(committed(to_device(data, np.uint32))), tag)
    words = jax.random.bits(key, (-(-num_bytes // 4),), dtype=jnp.uint32)
    return np.asarray(words).tobytes()[:num_bytes]


def row_bytes(arrays) -> np.ndarray:
    """``[n]`` object array: the bytes of each row, all data arrays of the row concatenated.

    A row's bytes depend on that row alone (its values, dtypes and shapes), not on its position.
    """
    arrays = [np.ascontiguousarray(np.asarray(a)) for a in arrays]
    n = arrays[0].shape[0]
    columns = [a.reshape(n, -1).view(np.uint8).reshape(n, -1) for a in arrays]
    joined = np.ascontiguousarray(np.concatenate(columns, axis=1))
    return joined


def keyed_row_hashes(arrays, secret: bytes) -> np.ndarray:
    """``[n]`` uint64 keyed hashes (BLAKE2b with ``secret``) of each row's bytes: uniform and
    independent across distinct rows to anyone without the secret."""
    joined = row_bytes(arrays)
    out = np.empty(joined.shape[0], np.uint64)
    for i, row in enumerate(joined):
        out[i] = int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8, key=secret).digest(), "little")
    return out


def keyed_fingerprint(data, clients) -> str:
    """HMAC-SHA256 of every client's arrays under a secret derived from the fit key: lets a resume
    check that it continues on the same data, without a hash that could confirm a guessed dataset."""
    mac = hmac.new(derived_bytes(data, FINGERPRINT_TAG), digestmod=hashlib.sha256)
    for client in clients:
        for a in client:
            a = np.ascontiguousarray(np.asarray(a))
            mac.update(f"{a.dtype.str}|{a.shape}".encode())
            mac.update(a.tobytes())
    return mac.hexdigest()
