"""Federated VIPS: PVI for conjugate-exponential models with exact local steps.

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

**Noise-aware posterior** (issue 23; models whose statistics do not depend on ``q``, ``ess_uses_params = False``,
with ``noise_aware_params``: linear regression). Each round client ``m`` releases ``S_m + xi_{m,r}`` (its clipped
ESS sum, the same every round) and its factor moves ``rho`` of the way to it, so after ``R`` rounds

    t_m = sum_r w_r (S_m + xi_{m,r}),   w_r = rho (1 - rho)^(R - r),   a = sum_r w_r = 1 - (1 - rho)^R,

and ``E = sum_m t_m / a = S + e`` with ``e`` Gaussian of variance ``(C_b s)^2 M sum_r w_r^2 / a^2`` per coordinate of
block ``b`` (``s = z sqrt(B)`` the std of a client's noise in rescaled units, ``z`` its noise multiplier; with a
trusted aggregator ``z = sigma / sqrt(M)``; a symmetric block's noise as :func:`~numpyro_dppvi.vips.release.release_ess`
draws it). The result's ``params`` is the model's posterior given the noisy ``E`` (``noise_aware_params``,
Bernstein & Sheldon's model, as :func:`~numpyro_dppvi.vips.fit.fit_vips`), ``params_fitted`` the server's
parameters as fitted (projected every round). **Privacy**: ``E`` is the sum of the released factors (what the server
holds), ``a``, ``rho``, ``R``, ``M``, the bounds and ``z`` are public settings: post-processing of the releases
(Dwork & Roth 2014, Prop. 2.1), no privacy cost, no unreleased value used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dppvi.data import validate_clients
from numpyro_dppvi.keys import resolve as resolve_key
from numpyro_dppvi.program_cache import cached, jit
from numpyro_dppvi.privacy.calibration import plan_charges
from numpyro_dppvi.vips.detect import detect_conjugate
from numpyro_dppvi.vips.engine import is_conjugate_model, joint_sensitivity, scale_bounds
from numpyro_dppvi.vips.federated import conjugate_client_delta, conjugate_server_update
from numpyro_dppvi.vips.fit import noise_aware_posterior, release_noise_variance
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
                       detect_options: dict | None = None, noise_aware: bool | None = None) -> VIPSResult:
    """Federated (DP-)VIPS over ``clients`` (a list of data tuples). Returns a :class:`VIPSResult`
    whose ``privacy`` ledger has one row per client and whose ``history`` has one entry per round.

    ``noise_aware``: None (default) gives a private fit of a model that has it (linear regression) the
    noise-aware posterior (module docstring; ``result.params_fitted`` as fitted), ``False`` the parameters as
    fitted, ``True`` insists (an error for a model or fit without it)."""
    if schedule not in ("synchronous", "sequential"):
        raise ValueError(f"federated VIPS runs schedule='synchronous' or 'sequential', got {schedule!r}")
    if not 0 < damping <= 1:
        raise ValueError(f"damping must be in (0, 1], got {damping}")
    if int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if noise_aware not in (None, True, False):
        raise TypeError(f"fit_federated_vips: noise_aware must be None, True or False, got {noise_aware!r}")
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
    step = cached(("federated-vips-client-step", conjugate, clip, float(share)), lambda: jit(
        lambda d, nbar, prev, key: conjugate_client_delta(conjugate, d, nbar, prev, noise_key=key, clip=clip,
                                                          noise_multiplier=share)[0]))
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
    available = privacy is not None and hasattr(conjugate, "noise_aware_params") and not getattr(
        conjugate, "ess_uses_params", True)
    if noise_aware and not available:
        raise ValueError(f"fit_federated_vips: noise_aware=True needs a private fit of a model with noise_aware_params "
                         f"whose statistics do not depend on q (BayesianLinearRegression); this is a "
                         f"{'private' if privacy is not None else 'non-private'} fit of a {type(conjugate).__name__}: "
                         f"leave noise_aware out")
    fitted, variance, draws = None, None, None
    if privacy is not None:
        bounds = scale_bounds(conjugate.block_bounds, clip)
        variance = released_sum_noise_variance(damping, int(rounds), num_clients,
                                               share * float(joint_sensitivity(bounds)), bounds)
    if available and noise_aware is not False:
        coverage = 1.0 - (1.0 - damping) ** int(rounds)  # a: the weight of S in every factor
        released = jax.tree_util.tree_map(lambda t: t / coverage, _sum(factors))
        fitted = params
        params, draws = noise_aware_posterior(conjugate, conjugate.m_step(conjugate.prior_params(), released),
                                              variance, "fit_dppvi(method='vips')")
    return VIPSResult(model=conjugate, params=params, history=history, privacy=ledger, params_fitted=fitted,
                      noise_multiplier=sigma if privacy is not None else None, numpyro_model=numpyro_model,
                      site_map=site_map, info={"federated": True, "schedule": schedule, "damping": damping,
                                               **({"observed": observed} if observed else {}),
                                               "trusted_aggregator": trusted_aggregator,
                                               "noise_aware": fitted is not None, "release_noise_variance": variance,
                                               **({} if draws is None else {"noise_aware_effective_draws": draws})})


def released_sum_noise_variance(damping: float, rounds: int, num_clients: int, client_noise_std: float,
                                bounds: dict) -> dict:
    """Per block, the variance of the release noise in ``E = sum_m t_m / a`` (module docstring): ``(C_b s)^2 M
    sum_r w_r^2 / a^2`` with ``s = client_noise_std`` (rescaled units), ``w_r = rho (1 - rho)^(R - r)`` and ``a =
    sum_r w_r``. Public: the damping, the rounds, the number of clients, the noise std and the bounds."""
    one_client = release_noise_variance(np.full(rounds, damping), 1.0, client_noise_std, bounds)  # sum_r w_r^2
    coverage = 1.0 - (1.0 - damping) ** rounds  # a
    return {name: num_clients * v / coverage ** 2 for name, v in one_client.items()}


def _zero_factor(conjugate, data, nbar):
    """A zero ESS pytree with the model's block shapes (from one non-private, unclipped step)."""
    return conjugate_client_delta(conjugate, data, nbar, None, clip=None, noise_multiplier=0.0)[0]


def _sum(factor_list):
    return jax.tree_util.tree_map(lambda *xs: sum(xs), *factor_list)
