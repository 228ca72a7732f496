"""A fit's settings as one value (``pvi.fit_settings``, issue 61): refused where it is made, resolved by one function
of the settings and the model's dimension, and enough to run the same fit again (``result.settings``)."""

import dataclasses

import jax
import numpy as np
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi.optim import Newton, PrivateNewton
from numpyro_dppvi.pvi.defaults import (DEFAULT_OPTIMIZER, METHOD_DEFAULTS, NEWTON_MAX_DIM, PRIVATE_NEWTON_DEFAULTS,
                                        VIRTUAL_FULL_RANK_DEFAULTS)

from .test_noise_aware import linear, regression

pytestmark = pytest.mark.filterwarnings("ignore::numpyro_dppvi.privacy.sizes.SizeDisclosureWarning",
                                        "ignore::numpyro_dppvi.diagnostics.NoiseWarning",
                                        "ignore::numpyro_dppvi.diagnostics.ConvergenceWarning",
                                        "ignore::numpyro_dppvi.diagnostics.CalibrationWarning")

PRIVACY = dppvi.Privacy(epsilon=1.0, delta=1e-5)


@pytest.mark.parametrize("options,error,match", [
    ({"method": "dp_optimisation", "batch_size": 10}, TypeError, "needs privacy"),
    ({"method": "dp_optimisation", "privacy": PRIVACY}, ValueError, "needs a batch_size"),
    ({"method": "pvi", "privacy": PRIVACY}, ValueError, "not private at the example level"),
    ({"family": "mean_field", "optimizer": Newton()}, ValueError, "local step of family='full_rank'"),
    ({"method": "virtual_clients", "family": "low_rank"}, ValueError, "not available with virtual clients"),
    ({"damping": 1.5}, ValueError, "damping must be in"),
    ({"method": "local_averaging"}, ValueError, "needs shards"),
    ({"method": "local_averaging", "shards": (2, 0)}, ValueError, "one positive int per client"),
])
def test_a_value_that_cannot_be_resolved_is_refused_where_it_is_made(options, error, match):
    """The errors are DPPVI's (the same function decides), raised by the value's constructor."""
    with pytest.raises(error, match=match):
        dppvi.FitSettings(**options)
    with pytest.raises(error, match=match):
        dppvi.DPPVI(linear, **options)


def test_settings_are_frozen_and_replace_checks_names_and_values():
    settings = dppvi.FitSettings(method="dp_optimisation", batch_size=10, privacy=PRIVACY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.damping = 0.5
    assert settings.replace(damping=0.5).damping == 0.5 and settings.damping is None
    with pytest.raises(TypeError, match="no option"):
        settings.replace(dampng=0.5)
    with pytest.raises(ValueError, match="damping must be in"):
        settings.replace(damping=0.0)


def test_defaults_the_model_decides_are_one_function_of_the_settings_and_the_dimension():
    """DP optimisation without an optimizer: private Newton steps and the noise-aware answer up to NEWTON_MAX_DIM,
    the optax default with the method's damping above, and noise_aware=True refused there; non-private PVI and
    virtual clients take full-rank factors up to it. Options given are kept."""
    dp = dppvi.FitSettings(method="dp_optimisation", batch_size=10, privacy=PRIVACY).resolve()
    small, large = dp.for_model(NEWTON_MAX_DIM), dp.for_model(NEWTON_MAX_DIM + 1)
    assert isinstance(small.optimizer, PrivateNewton) and small.noise_aware
    assert (small.damping, small.local_steps) == (PRIVATE_NEWTON_DEFAULTS["damping"],
                                                  PRIVATE_NEWTON_DEFAULTS["local_steps"])
    assert large.optimizer is DEFAULT_OPTIMIZER and not large.noise_aware
    assert large.damping == METHOD_DEFAULTS["dp_optimisation"]["damping"]
    assert dp.for_model(3) == small and dp.auto_local_step and not small.auto_family  # pure: dp is unchanged
    kept = dppvi.FitSettings(method="dp_optimisation", batch_size=10, privacy=PRIVACY, damping=0.3).resolve()
    assert kept.for_model(3).damping == 0.3
    with pytest.raises(ValueError, match="needs optim.PrivateNewton"):
        dppvi.FitSettings(method="dp_optimisation", batch_size=10, privacy=PRIVACY,
                          noise_aware=True).resolve().for_model(NEWTON_MAX_DIM + 1)
    pvi = dppvi.FitSettings().resolve()
    assert pvi.for_model(3).family == "full_rank" and isinstance(pvi.for_model(3).optimizer, Newton)
    assert pvi.for_model(NEWTON_MAX_DIM + 1).family == "mean_field"
    virtual = dppvi.FitSettings(method="virtual_clients", privacy=PRIVACY).resolve().for_model(3, auto_rounds=True)
    assert virtual.family == "full_rank" and virtual.virtual_full_rank
    assert (virtual.damping, virtual.planned_rounds) == (VIRTUAL_FULL_RANK_DEFAULTS["damping"],
                                                         VIRTUAL_FULL_RANK_DEFAULTS["rounds"])


def _clients():
    x, y = regression(120)
    return [(x[:60], y[:60]), (x[60:], y[60:])]


@pytest.mark.parametrize("options", [
    {"method": "dp_optimisation", "batch_size": 20, "rounds": 3,
     "privacy": dppvi.Privacy(epsilon=1.0, delta=1e-5, public_sizes=60)},
    {"method": "local_averaging", "shards": 3, "rounds": 3,
     "privacy": dppvi.Privacy(epsilon=1.0, delta=1e-5, public_sizes=60)},
    {"rounds": 3},
])
def test_settings_keyword_and_result_settings_run_the_same_fit(options):
    """``fit_dppvi(settings=FitSettings(**options))`` is the keyword fit, and so is ``settings=result.settings``
    (the defaults the model decided come back as the values they took): the same key gives the same q, bit for
    bit."""
    clients, key = _clients(), jax.random.key(3)
    by_keywords = dppvi.fit_dppvi(linear, clients, rng_key=key, **options)
    by_value = dppvi.fit_dppvi(linear, clients, rng_key=key, settings=dppvi.FitSettings(**options))
    again = dppvi.fit_dppvi(linear, clients, rng_key=key, settings=by_keywords.settings)
    for other in (by_value, again):
        assert other.config == by_keywords.config
        for a, b in zip(jax.tree.leaves(by_keywords.q), jax.tree.leaves(other.q)):
            np.testing.assert_array_equal(a, b)


def test_settings_beside_a_settings_keyword_is_refused():
    settings = dppvi.FitSettings(rounds=2)
    with pytest.raises(TypeError, match=r"not both .*\['damping'\].*settings.replace"):
        dppvi.fit_dppvi(linear, _clients(), settings=settings, damping=0.5)
    with pytest.raises(TypeError, match=r"not both .*\['family'\]"):
        dppvi.fit_dppvi(linear, _clients(), settings=settings, family="mean_field")
    with pytest.raises(TypeError, match="must be a dppvi.FitSettings"):
        dppvi.fit_dppvi(linear, _clients(), settings={"rounds": 2})


#: One set of options per entry of REFUSALS, in the table's order: each combination the table refuses.
_PRIVATE = dppvi.Privacy(epsilon=1.0, delta=1e-5)
ONE_PER_REFUSAL = [
    {"rank": 2},
    {"method": "dp_optimisation", "optimizer": Newton(), "privacy": _PRIVATE, "batch_size": 10},
    {"method": "virtual_clients", "family": "low_rank", "privacy": _PRIVATE},
    {"family": "full_rank", "optimizer": DEFAULT_OPTIMIZER},
    {"family": "mean_field", "optimizer": Newton()},
    {"optimizer": PrivateNewton()},
    {"noise_aware": True},
    {"method": "dp_optimisation", "batch_size": 10},
    {"method": "dp_optimisation", "privacy": _PRIVATE},
    {"method": "dp_optimisation", "privacy": _PRIVATE, "batch_size": 10, "trusted_aggregator": True},
    {"method": "local_averaging", "shards": 2, "privacy": dppvi.Privacy(epsilon=1.0, delta=1e-5,
                                                                       adaptive_clip=dppvi.privacy.AdaptiveClip())},
    {"privacy": _PRIVATE},
    {"privacy_unit": "client", "privacy": _PRIVATE, "schedule": "sequential"},
    {"method": "local_averaging", "shards": 2, "trusted_aggregator": True, "schedule": "sequential",
     "privacy": _PRIVATE},
    {"method": "local_averaging"},
    {"method": "parameter_perturbation", "shards": 3},
]


def test_every_refusal_of_the_table_is_reached_and_raised_with_its_message():
    """The combinations refused are decided by one table (``fit_settings.REFUSALS``): each entry is reached by some
    options (no dead rule) and raises its own error and message, the first match in the table's order."""
    from numpyro_dppvi.pvi.fit_settings import REFUSALS

    assert len(ONE_PER_REFUSAL) == len(REFUSALS)
    for options, refusal in zip(ONE_PER_REFUSAL, REFUSALS):
        with pytest.raises(refusal.error) as caught:
            dppvi.FitSettings(**options)
        fired = [r for r in REFUSALS if r.when(_combination(options))]
        assert fired and fired[0] is refusal, options
        expected = refusal.message if isinstance(refusal.message, str) else None
        assert expected is None or str(caught.value) == expected


def _combination(options):
    """The table's view of ``options`` (as FitSettings.resolve builds it), for the test above."""
    from numpyro_dppvi.pvi.defaults import default_schedule
    from numpyro_dppvi.pvi.fit_settings import Combination

    settings = {f.name: f.default for f in dataclasses.fields(dppvi.FitSettings)} | options
    method, family, optimizer = settings["method"], settings["family"] or "mean_field", settings["optimizer"]
    privacy = settings["privacy"]
    privacy = None if privacy is None else privacy.resolved(per_example=method == "dp_optimisation")
    schedule = settings["schedule"] or default_schedule(method, settings["trusted_aggregator"],
                                                        settings["privacy_unit"])
    return Combination(method, family, optimizer, schedule, privacy, settings["privacy_unit"],
                       settings["trusted_aggregator"], settings["rank"], settings["noise_aware"],
                       settings["batch_size"], settings["shards"],
                       method == "dp_optimisation" and optimizer is None and family in ("mean_field", "full_rank"))
