"""Keys of compiled programs by structure (numpyro_dppvi.program_key): equal for objects that behave alike,
different whenever something a traced program reads differs."""

import numpy as np
import optax

from numpyro_dppvi.program_key import MAX_ARRAY_BYTES, Identity, persistent_digest, structural_key

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


# --------------------------------------------------------------------------- across processes (persistent_digest)

_DIGEST_IN_A_NEW_PROCESS = """
import importlib, sys
sys.path.insert(0, sys.argv[1])
import optax
from numpyro_dppvi.program_key import persistent_digest
here = importlib.import_module(sys.argv[2])  # under this test module's name: a function's module is in its digest
closure_over, recursive = here.closure_over, here.recursive
print(persistent_digest((optax.adam(1e-2), closure_over(2.0), recursive, {"b": 1, "a": (1.5, None)})))
"""


def test_the_persistent_digest_is_equal_where_the_key_is_and_the_same_in_another_process():
    import os
    import subprocess
    import sys

    digest = lambda *objects: persistent_digest(objects)
    assert digest(optax.adam(1e-2)) == digest(optax.adam(1e-2))
    assert digest(optax.adam(1e-2)) != digest(optax.adam(1e-3))
    assert digest(optax.adam(1e-2)) != digest(optax.sgd(1e-2))
    assert digest(closure_over(2.0)) != digest(closure_over(3.0))
    assert digest(closure_over(2)) != digest(closure_over(2.0))
    assert digest(closure_over(np.arange(4.0))) != digest(closure_over(np.arange(4.0) + 1))
    before = digest(recursive)
    globals()["LIMIT"] = 4
    try:
        assert digest(recursive) != before
    finally:
        globals()["LIMIT"] = 3
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    expected = digest(optax.adam(1e-2), closure_over(2.0), recursive, {"a": (1.5, None), "b": 1})
    for seed in ("1", "2"):  # str hashes differ between these processes: the digest must not use hash()
        run = subprocess.run([sys.executable, "-c", _DIGEST_IN_A_NEW_PROCESS, root, __name__], check=True, capture_output=True,
                             text=True, env=dict(os.environ, PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu"))
        assert run.stdout.strip() == expected


class Unknown:
    pass


def test_what_the_digest_can_only_know_by_identity_has_none():
    assert persistent_digest(closure_over(Unknown())) is None
    assert persistent_digest(closure_over(np.zeros(MAX_ARRAY_BYTES // 8 + 1))) is None
    assert persistent_digest(closure_over(Unknown)) is not None  # a class of a file: by the file's hash


def test_a_class_of_a_user_file_is_named_by_its_file_and_its_bases_files(tmp_path, monkeypatch):
    import importlib
    import sys

    from numpyro_dppvi import program_key

    monkeypatch.syspath_prepend(str(tmp_path))
    digests = []
    for base, body in (("return 1.0", "return 1.0"), ("return 1.0", "return 2.0"), ("return 3.0", "return 2.0")):
        (tmp_path / "user_base.py").write_text(f"class Base:\n    def scale(self):\n        {base}\n")
        (tmp_path / "user_prior.py").write_text(
            f"from user_base import Base\n\nclass Prior(Base):\n    def shift(self):\n        {body}\n")
        for name in ("user_prior", "user_base"):
            sys.modules.pop(name, None)
        program_key._module_token.cache_clear()
        digests.append(persistent_digest(closure_over(importlib.import_module("user_prior").Prior)))
    for name in ("user_prior", "user_base"):
        sys.modules.pop(name, None)
    program_key._module_token.cache_clear()
    assert None not in digests and len(set(digests)) == 3  # the class's file, then its base's file, changed
