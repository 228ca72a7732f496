"""The simulation and the Flower deployment accept and refuse the same combinations of a fit's settings.

Issue 61: a fit's settings are validated by ``DPPVI`` on one machine and by ``LocalSettings.check_method``
(which ``make_rule`` calls) on a node. This table-driven test holds the two to the same answer over every
combination the Flower settings can express (method x schedule x family x optimiser x noise awareness); since
issue 61 the node decides by the simulation's ``FitSettings.resolve``, and this table keeps it that way. The Flower
deployment has no trusted aggregator and no client-level unit (issue 62): its run config refuses them as unknown
keys. Validation only: nothing is fitted.
"""

import itertools

import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi.flower.local_update import optimizer
from numpyro_dppvi.flower.server_app import SCHEDULES, ServerSettings
from numpyro_dppvi.flower.settings import FAMILIES, METHODS, OPTIMIZERS, LocalSettings, SettingsError
from numpyro_dppvi.pvi.driver import DPPVI

#: 0.5 is a valid learning rate for every optimiser name (Newton's precision step is in (0, 0.5]).
LEARNING_RATE = 0.5
COMBINATIONS = list(itertools.product(METHODS, SCHEDULES, FAMILIES, OPTIMIZERS, (False, True)))


def _flower_refuses(method, schedule, family, name, noise_aware):
    try:
        LocalSettings(optimizer=name, learning_rate=LEARNING_RATE, family=family, noise_aware=noise_aware,
                      batch_size=10).check_method(method, schedule)
    except SettingsError as exc:
        return str(exc)
    return None


def _simulation_refuses(method, schedule, family, name, noise_aware):
    # a node with a budget runs DP optimisation privately; "pvi" runs without privacy (allow-non-private)
    privacy = dppvi.Privacy(epsilon=1.0, delta=1e-5, clip=1.0) if method == "dp_optimisation" else None
    try:
        DPPVI(lambda: None, method=method, schedule=schedule, optimizer=optimizer(name, LEARNING_RATE), family=family,
              noise_aware=True if noise_aware else None, batch_size=10, privacy=privacy)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def test_table_covers_every_flower_combination():
    assert len(COMBINATIONS) == len(METHODS) * len(SCHEDULES) * len(FAMILIES) * len(OPTIMIZERS) * 2
    refused = [c for c in COMBINATIONS if _flower_refuses(*c) is not None]
    assert 0 < len(refused) < len(COMBINATIONS)  # the table has both answers


@pytest.mark.parametrize("method,schedule,family,name,noise_aware", COMBINATIONS)
def test_simulation_and_flower_agree(method, schedule, family, name, noise_aware):
    flower = _flower_refuses(method, schedule, family, name, noise_aware)
    simulation = _simulation_refuses(method, schedule, family, name, noise_aware)
    assert (flower is None) == (simulation is None), (flower, simulation)


@pytest.mark.parametrize("key", ["trusted-aggregator", "privacy-unit"])
def test_the_flower_run_config_refuses_what_the_deployment_does_not_run(key):
    """A trusted aggregator and client-level DP run in the simulation only; a run config naming them is refused with
    the known keys, not silently run without them."""
    with pytest.raises(SettingsError, match="unknown key"):
        ServerSettings.from_run_config({"model": "m:f", key: "true"})
