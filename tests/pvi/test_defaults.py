"""Defaults chosen by the model: virtual clients' family, rounds, damping and clip (pvi.defaults, issue 23)."""

import warnings

import jax
import numpy as np
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi.optim import Newton
from numpyro_dppvi.privacy import Privacy
from numpyro_dppvi.pvi.defaults import (DEFAULT_ROUNDS, METHOD_DEFAULTS, NEWTON_MAX_DIM, VIRTUAL_CLIP_MAX,
                                        VIRTUAL_FULL_RANK_DEFAULTS, VIRTUAL_NOISE_PER_RECORD, virtual_clip)

from .test_noise_aware import linear, regression

pytestmark = pytest.mark.filterwarnings("ignore::numpyro_dppvi.privacy.sizes.SizeDisclosureWarning",
                                        "ignore::numpyro_dppvi.diagnostics.NoiseWarning",
                                        "ignore::numpyro_dppvi.diagnostics.ConvergenceWarning")


def split(x, y, rows=30):
    return [(x[:rows], y[:rows]), (x[rows:], y[rows:])]


def test_the_virtual_clip_is_the_noise_per_record_bound_capped_at_the_travel():
    """``C = min(0.5, 0.02 mean(N_m) / sigma)``: the coverage study's cells (10 clients; sigma 16.69 at epsilon 1 and
    2.685 at epsilon 8 for 20 rounds, as the ledger calibrates them) give 0.24 at epsilon 1 with 200 rows a client
    and the cap 0.5 elsewhere; unequal clients count by their mean; nonsense is refused."""
    assert virtual_clip(16.694, [200] * 10) == pytest.approx(VIRTUAL_NOISE_PER_RECORD * 200 / 16.694)
    assert virtual_clip(16.694, [200] * 10) == pytest.approx(0.2396, abs=1e-4)
    assert virtual_clip(2.685, [200] * 10) == VIRTUAL_CLIP_MAX == 0.5
    assert virtual_clip(16.694, [1000] * 10) == VIRTUAL_CLIP_MAX
    assert virtual_clip(10.0, [100, 300]) == pytest.approx(0.4)
    for sigma, shards in ((0.0, [10]), (-1.0, [10]), (1.0, []), (1.0, [0, 10])):
        with pytest.raises(ValueError, match="virtual_clip needs"):
            virtual_clip(sigma, shards)


def test_virtual_clients_choose_full_rank_factors_by_the_models_dimension():
    """Without a family or optimizer, a private, noise-aware virtual-clients fit of up to ``NEWTON_MAX_DIM`` latents
    takes full-rank factors with Newton steps, damping 0.25 and the clip of ``virtual_clip`` (from the calibrated
    noise and the planned shards, one row each); above it mean-field with the method's defaults and the clip 1.
    The choice is made by ``init`` (checked at the threshold)."""
    privacy = Privacy(noise_multiplier=2.0, accountant="rdp")

    def chosen(dim, privacy=privacy, **extra):
        d = dppvi.DPPVI(linear, method="virtual_clients", rounds=2, local_steps=2, privacy=privacy, **extra)
        d.init(jax.random.key(0), split(*regression(60, dim)))
        return d

    for dim, full in ((3, True), (NEWTON_MAX_DIM, True), (NEWTON_MAX_DIM + 1, False)):
        d = chosen(dim)
        settings = d.settings()
        assert settings["family"] == ("full_rank" if full else "mean_field") and d.noise_aware
        assert settings["damping"] == (0.25 if full else METHOD_DEFAULTS["virtual_clients"]["damping"])
        assert isinstance(d.optimizer, Newton) == full
        assert settings["privacy"]["clip"] == (virtual_clip(2.0, [30, 30]) if full else 1.0) == d.rule.clip
        assert d.plan.noise_std(0) == pytest.approx(2.0 * settings["privacy"]["clip"])
    # the same driver set up again on larger clients chooses again (0.02 x 30 / 2 = 0.3, then the cap 0.5)
    d = chosen(3)
    assert d.privacy.clip == pytest.approx(0.3)
    d.init(jax.random.key(0), split(*regression(120, 3), rows=60))
    assert d.privacy.clip == VIRTUAL_CLIP_MAX == d.rule.clip and not d.given["privacy"].clip_chosen


@pytest.mark.parametrize("extra, family, damping, clip", [
    (dict(trusted_aggregator=True), "mean_field", 0.1, 1.0),  # no noise-aware posterior there
    (dict(noise_aware=False), "mean_field", 0.1, 1.0),
    (dict(family="mean_field"), "mean_field", 0.1, 1.0),
    (dict(optimizer=dppvi.optim.natural_gradient(0.5)), "mean_field", 0.1, 1.0),
    (dict(damping=0.3), "full_rank", 0.3, "rule"),
    (dict(family="full_rank"), "full_rank", 0.25, "rule"),  # full-rank asked for: its measured defaults
    (dict(family="full_rank", noise_aware=False), "full_rank", 0.1, 1.0),
])
def test_the_virtual_defaults_keep_what_the_caller_chose(extra, family, damping, clip):
    """Options the caller sets are kept; the full-rank defaults (damping 0.25, the clip rule) are those of
    noise-aware full-rank fits, measured as such; a chosen clip (even 1.0) is kept."""
    d = dppvi.DPPVI(linear, method="virtual_clients", rounds=2, local_steps=2,
                    privacy=Privacy(noise_multiplier=2.0, accountant="rdp"), **extra)
    d.init(jax.random.key(0), split(*regression(60, 3)))
    assert (d.family, d.damping) == (family, damping)
    assert d.privacy.clip == (virtual_clip(2.0, [30, 30]) if clip == "rule" else clip)
    kept = dppvi.DPPVI(linear, method="virtual_clients", rounds=2, local_steps=2,
                       privacy=Privacy(noise_multiplier=2.0, clip=1.0, accountant="rdp"), **extra)
    kept.init(jax.random.key(0), split(*regression(60, 3)))
    assert kept.privacy.clip == 1.0 and kept.privacy.clip_chosen and kept.family == family


def test_fit_dppvi_plans_the_rounds_with_the_family(tmp_path):
    """``rounds`` left out: 20 for a full-rank virtual-clients fit (its noise calibrated to them), 10 for a
    mean-field one, and what the caller gives otherwise. A fit stopped after 3 of its 20 rounds and resumed with
    ``rounds`` left out ends where the uninterrupted one does, with the same ledger."""
    clients = split(*regression(60, 3))
    privacy = Privacy(epsilon=2.0, delta=1e-5)
    common = dict(method="virtual_clients", privacy=privacy, local_steps=2)
    whole = dppvi.fit_dppvi(linear, clients, rng_key=jax.random.key(1), **common)
    assert whole.config["planned_rounds"] == VIRTUAL_FULL_RANK_DEFAULTS["rounds"] == len(whole.history) == 20
    assert whole.config["family"] == "full_rank"
    assert whole.config["privacy"]["clip"] < VIRTUAL_CLIP_MAX  # 30 rows a client at epsilon 2: the noise bound
    mean_field = dppvi.fit_dppvi(linear, clients, rng_key=jax.random.key(1), noise_aware=False, **common)
    assert mean_field.config["planned_rounds"] == DEFAULT_ROUNDS == len(mean_field.history)
    given = dppvi.fit_dppvi(linear, clients, rng_key=jax.random.key(1), rounds=4, **common)
    assert given.config["planned_rounds"] == 4 == len(given.history)

    path = tmp_path / "fit.ckpt"

    def stop_after_three(state, entry):
        if entry["round"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dppvi.fit_dppvi(linear, clients, rng_key=jax.random.key(1), checkpoint=path, callback=stop_after_three,
                        **common)
    resumed = dppvi.fit_dppvi(linear, clients, resume=path, **common)
    assert len(resumed.history) == 20
    np.testing.assert_array_equal(np.asarray(resumed.q.eta2), np.asarray(whole.q.eta2))
    np.testing.assert_array_equal(np.asarray(resumed.q.eta1), np.asarray(whole.q.eta1))
    assert resumed.privacy == whole.privacy


def test_the_default_clip_is_the_same_for_every_neighbour():
    """The clip rule reads only public values (the noise multiplier calibrated from the budget and the planned
    shards), so with declared sizes every neighbour (one record added, removed or replaced, in a random client)
    gets the same clip and the same published settings; the shards are re-derived from each neighbour's data as
    the fit derives them."""
    rng = np.random.default_rng(7)
    x, y = regression(80, 3, seed=3)
    privacy = Privacy(epsilon=2.0, delta=1e-5, public_sizes=45)

    def fitted(clients):
        d = dppvi.DPPVI(linear, method="virtual_clients", rounds=3, local_steps=2, privacy=privacy)
        d.init(jax.random.key(0), clients)
        return d

    first = fitted([(x[:40], y[:40]), (x[40:], y[40:])])
    base = first.settings()
    assert base["family"] == "full_rank" and [int(k) for k in first.num_shards] == [45, 45]
    assert base["privacy"]["clip"] == virtual_clip(float(np.max(first.plan.noise_multipliers)), [45, 45])
    for trial in range(12):
        kind = ("add", "remove", "replace")[trial % 3]
        row = int(rng.integers(0, 80))
        new_x, new_y = rng.normal(size=(1, 3)).astype(np.float32) * 3, rng.normal(size=1).astype(np.float32) * 3
        if kind == "add":  # into the first client, at a random place
            xs, ys = np.insert(x, row % 40, new_x, axis=0), np.insert(y, row % 40, new_y)
            clients = [(xs[:41], ys[:41]), (xs[41:], ys[41:])]
        elif kind == "remove":
            xs, ys = np.delete(x, row, axis=0), np.delete(y, row)
            cut = 39 if row < 40 else 40
            clients = [(xs[:cut], ys[:cut]), (xs[cut:], ys[cut:])]
        else:
            xs, ys = x.copy(), y.copy()
            xs[row], ys[row] = new_x[0], new_y[0]
            clients = [(xs[:40], ys[:40]), (xs[40:], ys[40:])]
        assert fitted(clients).settings() == base, kind
