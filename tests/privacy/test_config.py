import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from numpyro_dppvi.privacy import AdaptiveClip, PrivacyLedger, Privacy, plan_epsilon


def test_units_follow_the_relation():
    add = Privacy(noise_multiplier=1.2, clip=0.5)
    assert add.sensitivity == 0.5
    assert add.to_event(1.2) == pytest.approx(1.2)
    sub = Privacy(noise_multiplier=1.2, clip=0.5, neighbouring="substitute")
    assert sub.sensitivity == 1.0
    assert sub.to_event(1.2) == pytest.approx(0.6)
    assert sub.from_event(sub.to_event(1.7)) == pytest.approx(1.7)
    assert sub.gradient_noise_std(1.2) == pytest.approx(1.2 * 0.5)  # std = z C always


def test_step_event_uses_the_configured_sampler():
    p = Privacy(noise_multiplier=1.0, sampling="without_replacement", neighbouring="substitute",
                accountant="rdp")
    e = p.step_event(1.0, 0.1, 25)
    assert (e.sampling, e.rate, e.count) == ("without_replacement", 0.1, 25)
    assert e.noise_multiplier == 0.5
    full = p.step_event(1.0, 1.0)
    assert full.sampling == "none"
    pois = Privacy(noise_multiplier=1.0).step_event(1.0, 0.01, 3, overflow_probability=1e-13)
    assert pois.sampling == "poisson" and pois.overflow_probability == 1e-13


def test_resolve_calibrates_a_budget_for_every_client():
    p = Privacy(epsilon=1.0, delta=1e-5, clip=2.0)
    sizes = (1000, 4000)

    def plan(z):
        return [[p.step_event(z, 50 / n, 200)] for n in sizes]

    z = p.resolve(plan)
    ledger = p.ledger(len(sizes))
    for m, events in enumerate(plan(z)):
        for e in events:
            ledger.record(m, e)
    assert ledger.epsilon <= 1.0
    assert plan_epsilon(lambda s: plan(p.from_event(s)), p.to_event(0.99 * z), 1e-5,
                        "add_remove") > 1.0
    assert isinstance(ledger, PrivacyLedger) and ledger.accountant == "pld"


def test_resolve_with_noise_and_with_both():
    def plan(z):
        return [Privacy(noise_multiplier=1.0).step_event(z, 0.01, 100)]

    assert Privacy(noise_multiplier=0.9).resolve(plan) == 0.9
    assert Privacy(noise_multiplier=5.0, epsilon=1.0).resolve(plan) == 5.0
    with pytest.raises(ValueError, match="noise_multiplier >="):
        Privacy(noise_multiplier=0.8, epsilon=0.5).resolve(plan)
    with pytest.raises(TypeError, match="callable"):
        Privacy(noise_multiplier=1.0).resolve([])


def test_epsilon_max_per_client():
    assert np.all(np.isinf(Privacy(epsilon=1.0).epsilon_max_per_client(3)))
    np.testing.assert_array_equal(Privacy(epsilon=1.0, epsilon_max=2).epsilon_max_per_client(2),
                                  [2.0, 2.0])
    p = Privacy(epsilon=1.0, epsilon_max=[1.0, 3.0])
    np.testing.assert_array_equal(p.epsilon_max_per_client(2), [1.0, 3.0])
    with pytest.raises(ValueError, match="one per client"):
        p.epsilon_max_per_client(3)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(), ValueError, "epsilon"),
    (dict(epsilon=0.0), ValueError, "epsilon"),
    (dict(epsilon=-1.0), ValueError, "epsilon"),
    (dict(epsilon="1"), TypeError, "epsilon"),
    (dict(epsilon=1.0, delta=0.0), ValueError, "delta"),
    (dict(epsilon=1.0, delta=1.5), ValueError, "delta"),
    (dict(epsilon=1.0, clip=0.0), ValueError, "clip"),
    (dict(epsilon=1.0, clip=float("inf")), ValueError, "clip"),
    (dict(noise_multiplier=-1.0), ValueError, "noise_multiplier"),
    (dict(epsilon=1.0, sampling="shuffle"), ValueError, "sampling"),
    (dict(epsilon=1.0, neighbouring="replace"), ValueError, "neighbouring"),
    (dict(epsilon=1.0, accountant="fourier"), ValueError, "accountant"),
    (dict(epsilon=1.0, sampling="without_replacement"), ValueError, "substitute"),
    (dict(epsilon=1.0, sampling="without_replacement", neighbouring="substitute"), ValueError,
     "rdp"),
    (dict(epsilon=1.0, neighbouring="substitute", accountant="rdp"), ValueError, "pld"),
    (dict(epsilon=1.0, epsilon_max=0.0), ValueError, "epsilon_max"),
    (dict(epsilon=1.0, epsilon_max="1"), TypeError, "epsilon_max"),
    (dict(epsilon=1.0, adaptive_clip=0.5), TypeError, "AdaptiveClip"),
])
def test_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        Privacy(**kwargs)


def test_valid_configs_are_frozen():
    p = Privacy(epsilon=1.0, sampling="without_replacement", neighbouring="substitute",
                accountant="rdp", adaptive_clip=AdaptiveClip(0.7))
    with pytest.raises(AttributeError):
        p.epsilon = 2.0
    assert p.adaptive_clip.target_quantile == 0.7


_anything = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=3),
    st.floats(allow_nan=True, allow_infinity=True), st.lists(st.floats(-2, 2), max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(epsilon=_anything, delta=_anything, clip=_anything, noise_multiplier=_anything,
       epsilon_max=_anything)
# found by the search: the PLD grid estimate squared the noise multiplier and overflowed (OverflowError); a
# subnormal one would have divided by zero
@example(epsilon=None, delta=0.5, clip=1, noise_multiplier=1.3407807929942597e+154, epsilon_max=None)
@example(epsilon=None, delta=0.5, clip=1, noise_multiplier=5e-324, epsilon_max=None)
def test_hostile_inputs_either_raise_clearly_or_give_a_valid_config(
        epsilon, delta, clip, noise_multiplier, epsilon_max):
    try:
        p = Privacy(epsilon=epsilon, delta=delta, clip=clip, noise_multiplier=noise_multiplier,
                    epsilon_max=epsilon_max)
    except (ValueError, TypeError) as error:
        assert str(error)  # a message that names the problem
        return
    assert p.epsilon is not None or p.noise_multiplier is not None
    for value in (p.epsilon, p.noise_multiplier):
        assert value is None or (math.isfinite(value) and value > 0)
    assert 0 < p.delta < 1 and math.isfinite(p.clip) and p.clip > 0
    assert p.epsilon_max is None or all(
        math.isfinite(v) and v > 0
        for v in ((p.epsilon_max,) if isinstance(p.epsilon_max, float) else p.epsilon_max))


def test_a_clip_left_out_is_one_and_known_as_not_chosen():
    """``Privacy()``'s clip is 1.0 for every purpose (sensitivity, equality, hashing, JSON), and known as not chosen
    through copies, pickling and ``dataclasses.replace`` (a method with a clip rule of its own, virtual clients with
    full-rank factors, replaces only that one); ``clip=1.0`` written out is chosen."""
    import copy
    import dataclasses
    import json
    import pickle

    left_out, given = Privacy(epsilon=1.0), Privacy(epsilon=1.0, clip=1.0)
    assert left_out.clip == 1.0 and left_out.sensitivity == 1.0 and json.dumps(left_out.clip) == "1.0"
    assert left_out == given and hash(left_out) == hash(given) and repr(left_out) == repr(given)
    assert not left_out.clip_chosen and given.clip_chosen and Privacy(noise_multiplier=1.0, clip=2).clip_chosen
    for copied in (copy.deepcopy(left_out), pickle.loads(pickle.dumps(left_out)),
                   dataclasses.replace(left_out, adaptive_clip=None)):
        assert not copied.clip_chosen and copied.clip == 1.0
    assert dataclasses.replace(left_out, clip=0.25).clip_chosen
    assert type(left_out.clip * 2) is float
