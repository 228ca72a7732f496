"""Whether virtual clients' clip lets their factors arrive (pvi.release_saturation, issue 59).

Statistical tolerances: the statistic's mean and sd are checked over 4,000 noise draws (fixed seeds) to 4 Monte
Carlo standard errors (the standard error of a mean of 4,000 draws, and of an sd: ``sd / sqrt(2 n)``, 1.1%), so a
correct implementation fails with probability under 1e-4 and one that leaves out the noise's share
(``P s^2``, here 3 times the signal) or scales by the wrong size fails by far more. The fits' verdicts sit far from
the bound: the censored Weibull regression's releases saturate at 28 (bound 10, its standard error 0.04), the same
fit with ``clip=10`` at 0.09.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi.diagnostics import CalibrationWarning, ConvergenceWarning
from numpyro_dppvi.pvi import release_saturation as S
from tests import calibration_zoo_models as Z

DRAWS = 4000


def noisy_releases(signal, noise_std, key):
    """``DRAWS`` releases ``signal + N(0, noise_std^2)`` of a two-leaf change (the eta1 / eta2 of a Gaussian)."""
    keys = jax.random.split(key, len(signal))
    return [s + noise_std * jax.random.normal(k, (DRAWS,) + s.shape) for s, k in zip(signal, keys)]


@pytest.mark.parametrize("signal_norm2", [0.0, 30.0])
def test_the_statistic_is_unbiased_and_its_sd_is_the_noise_s(signal_norm2):
    clip, shards, noise_std = 0.5, 40, 1.5
    shape = [(3,), (3,)]
    num_coordinates = 6
    direction = np.ones(num_coordinates) / math.sqrt(num_coordinates)
    flat = direction * math.sqrt(signal_norm2)
    signal = [jnp.asarray(flat[:3]), jnp.asarray(flat[3:])]
    draws = noisy_releases(signal, noise_std, jax.random.key(1))
    z, sd = jax.vmap(lambda a, b: S.statistic([a, b], noise_std, clip, shards, num_coordinates))(*draws)
    z = np.asarray(z)
    truth = signal_norm2 / (shards * clip ** 2)
    assert abs(z.mean() - truth) < 4 * z.std() / math.sqrt(DRAWS), (z.mean(), truth)
    if signal_norm2 == 0.0:  # no cross term: eq. (1)'s sd is exact
        assert abs(z.std() / float(sd[0]) - 1) < 4 / math.sqrt(2 * DRAWS), (z.std(), sd[0])
    else:  # the cross term 2 <S, xi> adds sqrt(1 + 2 ||S||^2 / (P s^2)) (module docstring)
        factor = math.sqrt(1 + 2 * signal_norm2 / (num_coordinates * noise_std ** 2))
        assert abs(z.std() / (float(sd[0]) * factor) - 1) < 4 / math.sqrt(2 * DRAWS), (z.std(), sd[0] * factor)


def test_a_round_summary_averages_the_releases_that_were_applied():
    z, se = S.round_summary(np.array([2.0, np.nan, 4.0]), np.array([0.3, np.nan, 0.4]))
    assert z == pytest.approx(3.0) and se == pytest.approx(0.25)
    assert S.round_summary(np.array([np.nan]), np.array([np.nan])) is None


def history(saturations, se=0.1, invalid=0, clients=5):
    return [{"clip_saturation": z, "clip_saturation_se": se, "participated": [True] * clients,
             "invalid_updates": invalid} for z in saturations]


def test_the_verdict_reads_the_last_quarter_of_the_rounds_two_standard_errors_above_the_bound():
    bound = S.SATURATION_BOUND
    assert S.calibration(history([2 * bound] * 8), False)["reason"] == "clip"
    flagged = S.calibration(history([1.0] * 6 + [2 * bound] * 2), False)
    assert flagged["calibrated"] is False and flagged["clip_saturation"] == pytest.approx(2 * bound)
    early = S.calibration(history([10 * bound] * 6 + [1.0] * 2), False)  # the factors arrived by the end
    assert early["calibrated"] is None and early["clip_saturation"] == pytest.approx(1.0)
    # one standard error above the bound is not two: the flag needs the releases to show it
    assert S.calibration(history([bound + 1.0] * 4, se=1.0), False)["calibrated"] is None
    assert S.calibration(history([bound + 1.0] * 4, se=0.4), False)["calibrated"] is False
    assert S.calibration([{"participated": [True]}], False) == {
        "calibrated": None, "clip_saturation": None, "clip_saturation_se": None, "floored_share": None, "reason": None}


def test_the_floor_rule_flags_when_it_set_the_precision_in_nearly_every_client_round():
    every = S.calibration(history([1.0] * 10, invalid=5), True)
    assert every["reason"] == "floor" and every["floored_share"] == 1.0
    some = S.calibration(history([1.0] * 10, invalid=4), True)  # 0.8 of the client-rounds
    assert some["calibrated"] is None and some["floored_share"] == 0.8
    assert S.calibration(history([1.0] * 10, invalid=5), False)["floored_share"] is None  # no floor rule in force
    both = S.calibration(history([3 * S.SATURATION_BOUND] * 10, invalid=5), True)
    assert both["reason"] == "clip"  # the clip's bias is named first: its remedy is the user's


def weibull_clients(rows=1000, clients=5):
    """The zoo's censored Weibull regression at a typical prior draw (fixed seeds)."""
    values = {"b0": 0.3, "w": np.array([0.4, -0.3]), "k": 1.5}
    return [Z.simulate_weibull(jax.random.key(100 + i), values, c)
            for i, c in enumerate(Z.client_covariates("weibull_censored", rows, clients, seed=1))]


def test_a_virtual_clients_fit_whose_clip_holds_its_factors_back_says_so_and_a_larger_clip_does_not():
    """The zoo's Weibull cells (90% coverage 0.40-0.60 with the default clip, 0.96 with ``clip=10``): the default
    clip's releases saturate (z-bar 28 here), the fit flags itself, is not converged and gives the one warning that
    names the larger clip (not a second one for the drift it causes); with ``clip=10`` the same fit's releases read as arrived factors (z-bar below 1)."""
    clients = weibull_clients()
    results = {}
    for clip in (None, 10.0):
        privacy = dppvi.Privacy(epsilon=8.0, delta=1e-5, public_sizes=[200] * 5,
                                **({} if clip is None else {"clip": clip}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[clip] = dppvi.fit_dppvi(Z.weibull_censored, clients, method="virtual_clients", privacy=privacy,
                                            rng_key=jax.random.key(3))
        results[clip].warned = [w for w in caught if issubclass(w.category, (CalibrationWarning, ConvergenceWarning))]
    held = results[None]
    assert held.calibrated is False and held.calibration["reason"] == "clip"
    assert held.calibration["clip_saturation"] - 2 * held.calibration["clip_saturation_se"] > S.SATURATION_BOUND
    assert held.convergence["converged"] is False
    # one warning, naming the clip: the drift it causes is not warned of a second time (result.convergence has it)
    assert [w.category for w in held.warned] == [CalibrationWarning] and "Privacy(clip=" in str(held.warned[0].message)
    assert all("clip_saturation" in h and "clip_saturation_se" in h for h in held.history)
    free = results[10.0]
    assert free.calibrated is None and free.calibration["clip_saturation"] < 1.0 and free.warned == []
