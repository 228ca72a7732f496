"""Federated VIPS: PVI for conjugate-exponential models with exact local steps (DESIGN §6).

Each client ``m`` holds a factor ``t_m`` in the model's ESS parameters. In a round it receives the
current expected natural parameters ``n̄``, computes its exact conjugate local step (its summed ESS,
each record's ESS clipped block-wise to the declared bounds) and releases it with Gaussian noise
(:func:`~numpyro_dppvi.vips.federated.conjugate_client_delta`); its delta is the change of its
released factor, damped by ``rho``. The server's global parameters are the M-step of
``nu + sum_m t_m``. For models without local latent variables (linear regression, the conjugate
pairs) one undamped synchronous round gives the exact posterior of the pooled data.

Privacy: one release per round per client over all its rows (rate 1). Sensitivity of a clipped ESS
sum in bound-rescaled units: ``sqrt(B)`` when a record is added or removed, ``2 sqrt(B)`` when one
is replaced (``B`` blocks, each record's block clipped to its bound): ``Privacy.step_event(z, 1.0)``
with ``z`` = noise std / ``sqrt(B)``. With ``trusted_aggregator=True`` (synchronous) every client adds
``z / sqrt(M)`` and the ledger records the aggregated release (full ``z``) as a joint guarantee.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dppvi.data import validate_clients
from numpyro_dppvi.keys import resolve as resolve_key
from numpyro_dppvi.privacy.calibration import plan_charges
from numpyro_dppvi.vips.detect import detect_conjugate
from numpyro_dppvi.vips.engine import is_conjugate_model
from numpyro_dppvi.vips.federated import conjugate_client_delta, conjugate_server_update
from numpyro_dppvi.vips.release import noise_coordinates
from numpyro_dppvi.vips.results import VIPSResult


def _resolve_model(model, clients, detect_options):
    if is_conjugate_model(model):
        return model, [model.validate_data(tuple(np.asarray(a) for a in c)) for c in clients], None, None, None
    if not callable(model):
        raise TypeError("model must be a ConjugateModel or a NumPyro model function")
    detections = [detect_conjugate(model, *c, **(detect_options or {})) for c in clients]
    conjugate = detections[0].model
    return (conjugate, [conjugate.validate_data(d.data) for d in detections], model, detections[0].site_map,
            detections[0].observed_site)


def fit_federated_vips(model, clients, *, privacy=None, rounds: int = 1, schedule: str = "synchronous",
                       damping: float = 1.0, trusted_aggregator: bool = False, rng_key=None,
                       detect_options: dict | None = None) -> VIPSResult:
    """Federated (DP-)VIPS over ``clients`` (a list of data tuples). Returns a :class:`VIPSResult`
    whose ``privacy`` ledger has one row per client and whose ``history`` has one entry per round."""
    if schedule not in ("synchronous", "sequential"):
        raise ValueError(f"federated VIPS runs schedule='synchronous' or 'sequential', got {schedule!r}")
    if not 0 < damping <= 1:
        raise ValueError(f"damping must be in (0, 1], got {damping}")
    if int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if trusted_aggregator and (privacy is None or schedule != "synchronous"):
        raise ValueError("trusted_aggregator=True needs privacy and schedule='synchronous'")
    clients = validate_clients(clients)
    conjugate, data, numpyro_model, site_map, observed = _resolve_model(model, clients, detect_options)
    num_clients = len(data)
    key_data, seed = resolve_key(rng_key)
    rng_key = jax.random.wrap_key_data(key_data)
    ledger, sigma, clip, dimension = None, 0.0, None, 1
    if privacy is not None:
        if privacy.adaptive is not None:
            raise ValueError("VIPS clips every ESS block to its declared bound; adaptive_clip is not supported")
        dimension = noise_coordinates(_zero_factor(conjugate, data[0], conjugate.expected_natural_params(
            conjugate.prior_params())), tuple(conjugate.symmetric_blocks))
        plan = lambda z: [privacy.step_event(z, 1.0, int(rounds), dimension=dimension)]  # noqa: E731
        sigma = float(privacy.resolve(plan))
        ledger = privacy.ledger(num_clients, trusted_aggregator, seed=seed, charges=plan_charges(plan), sizes="unused")
        clip = privacy.clip
    share = sigma / np.sqrt(num_clients) if trusted_aggregator else sigma
    params = conjugate.prior_params()
    nbar0 = conjugate.expected_natural_params(params)
    factors = [jax.tree_util.tree_map(jnp.zeros_like, _zero_factor(conjugate, d, nbar0)) for d in data]
    history = []
    step = jax.jit(lambda d, nbar, prev, key: conjugate_client_delta(
        conjugate, d, nbar, prev, noise_key=key, clip=clip, noise_multiplier=share)[0])
    for r in range(int(rounds)):
        round_key = jax.random.fold_in(rng_key, r)
        nbar = conjugate.expected_natural_params(params)
        for m in range(num_clients):
            if schedule == "sequential":
                nbar = conjugate.expected_natural_params(params)
            key = jax.random.fold_in(round_key, m)
            delta = step(data[m], nbar, factors[m], key)
            factors[m] = jax.tree_util.tree_map(lambda t, d: t + damping * d, factors[m], delta)
            if ledger is not None:
                ledger.record(m, privacy.step_event(sigma, 1.0, 1, dimension=dimension))
            if schedule == "sequential":
                params = conjugate_server_update(conjugate, params, _sum(factors), 1.0, noisy=privacy is not None)
        if schedule == "synchronous":  # with a trusted aggregator only this sum is revealed
            params = conjugate_server_update(conjugate, params, _sum(factors), 1.0, noisy=privacy is not None)
        entry = {"round": r + 1, "communications": (r + 1) * num_clients}
        if ledger is not None:
            entry["epsilon"] = ledger.epsilon
        history.append(entry)
    return VIPSResult(model=conjugate, params=params, history=history, privacy=ledger,
                      noise_multiplier=sigma if privacy is not None else None, numpyro_model=numpyro_model,
                      site_map=site_map, info={"federated": True, "schedule": schedule, "damping": damping,
                                               **({"observed": observed} if observed else {}),
                                               "trusted_aggregator": trusted_aggregator})


def _zero_factor(conjugate, data, nbar):
    """A zero ESS pytree with the model's block shapes (from one non-private, unclipped step)."""
    return conjugate_client_delta(conjugate, data, nbar, None, clip=None, noise_multiplier=0.0)[0]


def _sum(factor_list):
    return jax.tree_util.tree_map(lambda *xs: sum(xs), *factor_list)
