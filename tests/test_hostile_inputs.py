"""Hostile and malformed input to the public API (issue 7, item 4).

Property tests (hypothesis, few examples, tiny data, ``rounds=1``, ``local_steps=1``) over
``fit_dppvi``, ``DPPVI``, ``Privacy``, ``partition``, ``fit_global_vi``, ``fit_bcm`` and
``fit_vips``: non-finite data, wrong dtypes and shapes, clients smaller than the batch, empty
clients, invalid privacy parameters and unknown names each raise a ``ValueError``/``TypeError``
whose message names the fix, before any training; finite data, however extreme, never yields a
NaN posterior.
"""

import math

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numpyro_dppvi as dppvi
from numpyro_dppvi.privacy import Privacy
from numpyro_dppvi.vips import BayesianLinearRegression, fit_vips

FAST = dict(rounds=1, local_steps=1, num_samples=2)
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)


@dppvi.model
def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def tiny_clients(num_clients=2, rows=6, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(rows, 2)).astype(np.float32), (rng.uniform(size=rows) < 0.5).astype(np.float32))
            for _ in range(num_clients)]


PRIVATE = Privacy(noise_multiplier=1.0, clip=1.0)

# every entry point that takes federated clients, as (name, fit(clients))
ENTRY_POINTS = {
    "pvi": lambda c: dppvi.fit_dppvi(logistic, c, **FAST),
    "dp_optimisation": lambda c: dppvi.fit_dppvi(logistic, c, method="dp_optimisation", batch_size=2,
                                                 privacy=PRIVATE, **FAST),
    "local_averaging": lambda c: dppvi.fit_dppvi(logistic, c, method="local_averaging", shards=2,
                                                 privacy=PRIVATE, **FAST),
    "global_vi": lambda c: dppvi.fit_global_vi(logistic, c, steps=1, steps_per_round=1, batch_size=2),
    "bcm": lambda c: dppvi.fit_bcm(logistic, c, local_steps=1, batch_size=2),
    "driver": lambda c: dppvi.DPPVI(logistic, local_steps=1).init(jax.random.key(0), c),
    "federated_vips": lambda c: dppvi.fit_dppvi(BayesianLinearRegression(2, 1.0), c, method="vips", rounds=1),
}
every_entry_point = pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
FEW = settings(max_examples=4, deadline=None, derandomize=True)


def raises_naming(exc, *words):
    """``pytest.raises`` whose message must contain one of ``words`` (the fix it names)."""
    return pytest.raises(exc, match="|".join(words))


# --------------------------------------------------------------------------- data

@every_entry_point
@FEW
@given(client=st.integers(0, 1), array=st.integers(0, 1), row=st.integers(0, 5),
       value=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_non_finite_data_is_rejected_before_training(entry, client, array, row, value):
    clients = tiny_clients()
    clients[client][array][row, ...] = value
    with raises_naming(ValueError, "NaN or inf"):
        ENTRY_POINTS[entry](clients)


@SETTINGS
@given(row=st.integers(0, 9), value=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_non_finite_data_is_rejected_by_partition_and_fit_vips(row, value):
    x = np.ones((10, 2))
    x[row, 1] = value
    with raises_naming(ValueError, "impute or drop"):
        dppvi.partition((x, np.zeros(10)), num_clients=2)
    with raises_naming(ValueError, "remove or impute"):
        fit_vips(BayesianLinearRegression(2, 1.0), (x, np.zeros(10)), rng_key=jax.random.key(0))


@every_entry_point
@FEW
@given(dtype=st.sampled_from(["U3", "object"]))
def test_non_numeric_dtypes_are_rejected(entry, dtype):
    clients = tiny_clients()
    clients = [(x.astype(str).astype(dtype), y) for x, y in clients]
    with raises_naming(TypeError, "numeric dtype"):
        ENTRY_POINTS[entry](clients)


def test_fit_vips_rejects_string_data_with_a_clear_message():
    x = np.array([["a", "b"]] * 4)
    with raises_naming(TypeError, "numeric"):
        fit_vips(BayesianLinearRegression(2, 1.0), (x, np.zeros(4)), rng_key=jax.random.key(0))


def _mismatched_rows(clients):
    x, y = clients[0]
    return [(x, y[:-1])] + clients[1:]


def _mismatched_columns(clients):
    x, y = clients[1]
    return [clients[0], (np.concatenate([x, x], axis=1), y)]


def _mismatched_dtype(clients):
    x, y = clients[1]
    return [clients[0], (x.astype(np.float64), y)]


def _single_array(clients):
    return [clients[0][0]] + clients[1:]


def _scalar(clients):
    return [(clients[0][0], np.float32(1.0))] + clients[1:]


def _not_a_list(clients):
    return clients[0][0]


SHAPE_FAULTS = {
    "rows differ within a client": (_mismatched_rows, ValueError, "one row per individual"),
    "columns differ between clients": (_mismatched_columns, ValueError, "same columns"),
    "dtypes differ between clients": (_mismatched_dtype, ValueError, "cast all clients"),
    "client is one array": (_single_array, TypeError, "wrap it in a list|tuple of arrays"),
    "scalar array": (_scalar, ValueError, "leading axis"),
    "clients is an array": (_not_a_list, TypeError, "list of per-client tuples"),
}


@every_entry_point
@pytest.mark.parametrize("fault", sorted(SHAPE_FAULTS))
def test_wrong_shapes_are_rejected(entry, fault):
    make, exc, words = SHAPE_FAULTS[fault]
    with raises_naming(exc, words):
        ENTRY_POINTS[entry](make(tiny_clients()))


@every_entry_point
@FEW
@given(which=st.integers(0, 1))
def test_empty_clients_are_rejected(entry, which):
    clients = tiny_clients()
    clients[which] = tuple(a[:0] for a in clients[which])
    with raises_naming(ValueError, "empty"):
        ENTRY_POINTS[entry](clients)
    with raises_naming(ValueError, "at least one client"):
        ENTRY_POINTS[entry]([])


@SETTINGS
@given(rows=st.integers(3, 5), batch=st.integers(5, 12), method=st.sampled_from(["dp_optimisation", "global_vi"]))
def test_clients_not_larger_than_the_private_batch_are_rejected(rows, batch, method):
    """DP-SGD needs subsampled batches (rate < 1) on every client: a clear error, not a silent
    rate > 1 that the accountant would misreport. (Client 0 needs 3 rows to trace the model.)"""
    clients = tiny_clients(rows=rows) if method == "dp_optimisation" else tiny_clients(num_clients=1, rows=rows)
    with raises_naming(ValueError, "batch_size <="):
        if method == "dp_optimisation":
            dppvi.fit_dppvi(logistic, clients, method="dp_optimisation", batch_size=batch, privacy=PRIVATE, **FAST)
        else:
            dppvi.fit_global_vi(logistic, clients, steps=1, steps_per_round=1, batch_size=batch, privacy=PRIVATE)


@SETTINGS
@given(rows=st.integers(3, 5), extra=st.integers(1, 5))
def test_more_shards_than_rows_and_vips_batches_larger_than_the_data_are_rejected(rows, extra):
    with raises_naming(ValueError, "use at most"):
        dppvi.fit_dppvi(logistic, tiny_clients(rows=rows), method="local_averaging", shards=rows + extra, **FAST)
    data = (np.ones((rows, 2)), np.zeros(rows))
    with raises_naming(ValueError, r"integer in \[1, "):
        fit_vips(BayesianLinearRegression(2, 1.0), data, batch_size=rows + extra, rng_key=jax.random.key(0))


def test_non_finite_eval_data_is_rejected():
    x, y = tiny_clients()[0]
    x[0, 0] = math.nan
    with raises_naming(ValueError, "NaN or inf"):
        dppvi.fit_dppvi(logistic, tiny_clients(), eval_data=(x, y), **FAST)


# --------------------------------------------------------------------------- privacy parameters

bad_positive = st.one_of(st.floats(max_value=0.0, allow_nan=False), st.just(math.nan), st.just(math.inf),
                         st.just(-math.inf))
bad_delta = st.one_of(st.floats(max_value=0.0, allow_nan=False), st.floats(min_value=1.0), st.just(math.nan))


@SETTINGS
@given(epsilon=bad_positive)
def test_non_positive_epsilon_is_rejected(epsilon):
    with raises_naming(ValueError, "epsilon must be a finite number > 0"):
        dppvi.fit_dppvi(logistic, tiny_clients(), method="dp_optimisation", batch_size=2,
                        privacy=Privacy(epsilon=epsilon), **FAST)


@SETTINGS
@given(delta=bad_delta)
def test_delta_outside_the_unit_interval_is_rejected(delta):
    with raises_naming(ValueError, "strictly between 0 and 1"):
        Privacy(epsilon=1.0, delta=delta)


@SETTINGS
@given(clip=bad_positive)
def test_non_positive_clip_is_rejected(clip):
    with raises_naming(ValueError, "clip must be a finite number > 0"):
        Privacy(epsilon=1.0, clip=clip)


@SETTINGS
@given(value=st.one_of(st.text(max_size=3), st.booleans(), st.lists(st.floats(), max_size=2)))
def test_non_numeric_privacy_parameters_are_type_errors(value):
    with raises_naming(TypeError, "must be a number"):
        Privacy(epsilon=value)
    with raises_naming(TypeError, "must be a number"):
        Privacy(noise_multiplier=value)


def test_privacy_of_the_wrong_type_is_rejected():
    with raises_naming(TypeError, r"Privacy\(...\)"):
        dppvi.DPPVI(logistic, method="dp_optimisation", batch_size=2, privacy={"epsilon": 1.0})


def test_a_budget_that_cannot_be_met_is_a_clear_error():
    with raises_naming(ValueError, "raise epsilon or delta"):
        dppvi.fit_dppvi(logistic, tiny_clients(), method="dp_optimisation", batch_size=2,
                        privacy=Privacy(epsilon=1e-6), **FAST)


# --------------------------------------------------------------------------- names

name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
KNOWN = {"pvi", "dp_optimisation", "local_averaging", "virtual_clients", "parameter_perturbation", "vips",
         "sequential", "synchronous", "asynchronous", "example", "client", "reject", "floor", "same", "split",
         "poisson", "without_replacement", "add_remove", "substitute", "pld", "rdp", "autodp"}


@SETTINGS
@given(value=name.filter(lambda s: s not in KNOWN),
       argument=st.sampled_from(["method", "schedule", "privacy_unit", "invalid"]))
def test_unknown_driver_names_list_the_choices(value, argument):
    kwargs = {argument: value}
    if argument == "invalid":
        kwargs["method"], kwargs["shards"] = "local_averaging", 1
    with raises_naming(ValueError, "choose one of"):
        dppvi.fit_dppvi(logistic, tiny_clients(), **kwargs, **FAST)


@SETTINGS
@given(value=name.filter(lambda s: s not in KNOWN),
       argument=st.sampled_from(["sampling", "neighbouring", "accountant"]))
def test_unknown_privacy_names_list_the_choices(value, argument):
    with raises_naming(ValueError, "use one of"):
        Privacy(epsilon=1.0, **{argument: value})


@SETTINGS
@given(value=name.filter(lambda s: s not in KNOWN))
def test_unknown_bcm_prior_is_rejected(value):
    with raises_naming(ValueError, "'same' or 'split'"):
        dppvi.fit_bcm(logistic, tiny_clients(), prior=value, local_steps=1)


@SETTINGS
@given(num_clients=st.one_of(st.integers(-3, 0), st.integers(11, 20)), rho=st.floats(1.0, 5.0))
def test_partition_rejects_impossible_splits(num_clients, rho):
    data = (np.zeros((10, 2)), np.zeros(10))
    with raises_naming(ValueError, "num_clients"):
        dppvi.partition(data, num_clients=num_clients)
    with raises_naming(ValueError, "choose rho in"):
        dppvi.partition(data, num_clients=2, rho=rho)


@SETTINGS
@given(value=st.one_of(st.integers(-2, 0), st.floats(1.01, 3.0), st.just(math.nan)),
       argument=st.sampled_from(["damping", "client_rate"]))
def test_out_of_range_numeric_options_are_rejected(value, argument):
    kwargs = {argument: value}
    if argument == "client_rate":
        kwargs.update(privacy_unit="client", privacy=PRIVATE)
    with raises_naming(ValueError, f"{argument} must be in"):
        dppvi.fit_dppvi(logistic, tiny_clients(), **kwargs, **FAST)


def test_integer_rng_key_is_a_clear_type_error():
    with raises_naming(TypeError, "jax.random.key"):
        dppvi.fit_dppvi(logistic, tiny_clients(), rng_key=0, **FAST)


# --------------------------------------------------------------------------- no NaN posterior

finite_scale = st.sampled_from([1e-30, 1.0, 1e3, 1e15, 1e30])  # |x| stays below float32 max (3.4e38)


@pytest.mark.slow  # every example compiles a fit (~5-30 s on the shared 2-core machine)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(scale=finite_scale, seed=st.integers(0, 3),
       method=st.sampled_from(["pvi", "dp_optimisation", "parameter_perturbation"]))
def test_finite_but_extreme_data_never_gives_a_nan_posterior(scale, seed, method):
    """Features anywhere in the float32 range: the fit either returns a finite, proper posterior or
    stops with a clear error; it never hands back NaN."""
    clients = [(x * np.float32(scale), y) for x, y in tiny_clients(seed=seed)]
    options = {"pvi": {}, "dp_optimisation": dict(batch_size=2, privacy=PRIVATE),
               "parameter_perturbation": dict(privacy=PRIVATE)}[method]
    try:
        result = dppvi.fit_dppvi(logistic, clients, method=method, rng_key=jax.random.key(seed), **options, **FAST)
    except FloatingPointError as err:
        assert "previous state is kept" in str(err)
        return
    post = result.posterior["w"]
    assert np.all(np.isfinite(post["loc"])) and np.all(np.isfinite(post["scale"])) and np.all(post["scale"] > 0)
