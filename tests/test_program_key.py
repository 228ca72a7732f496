"""Keys of compiled programs by structure (numpyro_dppvi.program_key): equal for objects that behave alike,
different whenever something a traced program reads differs."""

import numpy as np
import optax

from numpyro_dppvi.program_key import MAX_ARRAY_BYTES, Identity, structural_key

LIMIT = 3


def recursive(n):
    return 0 if n <= 0 else recursive(n - 1) + LIMIT


def closure_over(value):
    return lambda x: x * value


def test_optax_transformations_written_twice_share_a_key():
    assert structural_key(optax.adam(1e-2)) == structural_key(optax.adam(1e-2))
    assert hash(structural_key(optax.adam(1e-2))) == hash(structural_key(optax.adam(1e-2)))
    chain = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.cosine_decay_schedule(1e-2, 100)))
    assert structural_key(chain()) == structural_key(chain())
    assert structural_key(optax.adam(1e-2)) != structural_key(optax.adam(1e-3))
    assert structural_key(optax.adam(1e-2)) != structural_key(optax.sgd(1e-2))
    assert structural_key(optax.adam(1e-2)) != structural_key(optax.adam(1e-2, b1=0.8))


def test_closures_globals_and_containers_are_read_by_value():
    assert structural_key(closure_over(2.0)) == structural_key(closure_over(2.0))
    assert structural_key(closure_over(2.0)) != structural_key(closure_over(3.0))
    assert structural_key(closure_over(2)) != structural_key(closure_over(2.0))  # int and float trace differently
    assert structural_key(closure_over([1, 2])) != structural_key(closure_over([1, 3]))
    assert structural_key(closure_over({"a": 1})) == structural_key(closure_over({"a": 1}))
    before = structural_key(recursive)  # a recursive function (a cycle through its globals) has a key
    globals()["LIMIT"] = 4
    try:
        assert structural_key(recursive) != before
    finally:
        globals()["LIMIT"] = 3
    assert structural_key(recursive) == before


def test_arrays_by_bytes_up_to_a_size_and_unknown_objects_by_identity():
    small = np.arange(4.0)
    assert structural_key(closure_over(small)) == structural_key(closure_over(small.copy()))
    assert structural_key(closure_over(small)) != structural_key(closure_over(small + 1))
    large = np.zeros(MAX_ARRAY_BYTES // 8 + 1)
    assert structural_key(closure_over(large)) != structural_key(closure_over(large.copy()))
    thing = object()
    assert structural_key(closure_over(thing)) == structural_key(closure_over(thing))
    assert structural_key(closure_over(thing)) != structural_key(closure_over(object()))
    assert isinstance(structural_key(thing), Identity)


def test_a_function_with_an_empty_cell_counts_by_identity():
    def outer():
        def inner():
            return later  # noqa: F821 - assigned after inner is made
        key = structural_key(inner)
        later = 1
        return key, inner
    key, inner = outer()
    assert isinstance(key, Identity) and key.obj is inner
