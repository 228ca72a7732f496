"""PVI server: the state, and one round under each schedule.

Global posterior ``eta_q = eta_prior + eta_t0 + sum_m eta_t_m + eta_t_noise`` (natural parameters).
``t_noise`` is zero except with a trusted aggregator or client-level DP, where it holds the server's
aggregate noise (see :func:`client_level` and :func:`.update_perturbation.trusted_aggregator_round`).
A client's cavity is ``eta_q - eta_t_m``; its update ``q_new`` becomes the damped change
``delta_m = rho (eta(q_new) - eta(q_m))`` of its factor, ``eta_t_m += delta_m`` and
``eta_q += delta_m`` (Heikkila et al. 2023, Algorithm 1; Ashman et al. 2022, Algorithm 1).

Schedules:

* ``synchronous``: every active client starts from the same ``q``; changes are summed once.
  Clients run in parallel with ``vmap`` over padded client data.
* ``sequential``: clients in turn, each from the ``q`` left by the previous one.
* ``asynchronous``: ``M`` arrivals per round drawn with probability proportional to ``1 / n_m``
  (Sharma et al. 2019, §3); an arriving client computed its update against the ``q`` it received at
  its previous exchange (``q_seen``, possibly stale); the server applies the change on arrival and
  sends the current ``q`` back.

Privacy budgets are checked inside the compiled round: ``state.participations[m]`` counts the
participations charged to client ``m`` and ``limits[m]`` is the largest count its budget allows
(precomputed from the plan, :mod:`.privacy_plan`). A client whose next participation would pass its
limit stops for good before it releases anything.

One exchange (server sends ``q`` to a client and receives one change) is one communication.
Sequential and asynchronous rounds are one ``lax.scan`` over arrivals; everything is jitted by the
caller.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import factors
from ..factors import Gaussian
from ..privacy.sampling import inclusion_threshold
from . import full_rank, low_rank
from .update_perturbation import apply_invalid_rule, clip_change, release_change

SCHEDULES = ("sequential", "synchronous", "asynchronous")


class PVIState(NamedTuple):
    """Everything a fit needs to continue: a pytree of arrays. **Private**: it holds the fit's key
    and every client's private state; it goes only into the private checkpoint.

    ``M`` is the number of clients, ``D`` the length of the unconstrained latent vector; a Gaussian's
    ``eta2`` is ``[D]`` (mean-field), ``[D, D]`` (full-rank) or a low-rank structure, with the same
    leading axis ``[M]`` where it is per client.

    Attributes:
      q: the current posterior (natural parameters).
      factors: ``[M, ...]``: every client's factor ``t_m``.
      server_factor: the server-held prior factor ``t_0``; zero on coordinates with an exact Gaussian prior.
      noise_factor: the server-held aggregate noise (trusted aggregator, client-level DP); zero otherwise.
      q_seen: ``[M, ...]``: the ``q`` each client received last (asynchronous schedule).
      client_state: the per-client state of the local rule, stacked on axis 0 (private).
      key: the fit's base PRNG key as raw ``uint32`` key data: secret.
      round: int32: rounds completed.
      communications: int32: client-server exchanges so far.
      active: ``[M]`` bool: the clients still contributing (False once a client's budget is spent).
      participations: ``[M]`` int32: participations charged to each client's budget.
    """

    q: Gaussian  # eta1 [D]; eta2 [D] (mean-field) or [D, D] (full-rank), and so on below
    factors: Gaussian  # [M, D]
    server_factor: Gaussian  # [D]; zero on coordinates with an exact Gaussian prior
    noise_factor: Gaussian  # [D]; the server-held aggregate noise (trusted aggregator, client-level DP)
    q_seen: Gaussian  # [M, D]: the q each client received last (asynchronous schedule)
    client_state: Any  # per-client state of the local rule, stacked on axis 0
    key: jax.Array  # base PRNG key (raw uint32 key data): secret
    round: jax.Array  # int32: rounds completed
    communications: jax.Array  # int32: exchanges so far
    active: jax.Array  # [M] bool: clients still contributing
    participations: jax.Array  # [M] int32: participations charged to each client's budget


def round_key(state: PVIState) -> jax.Array:
    """Key of the coming round: ``fold_in(base, round)``; client ``m`` then uses ``fold_in(., m)``."""
    return jax.random.fold_in(jax.random.wrap_key_data(state.key), state.round)


def broadcast(g: Gaussian, m: int) -> Gaussian:
    """``m`` copies of the factor ``g`` stacked on a new leading axis (one per client)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (m,) + x.shape), g)


def within_budget(state: PVIState, limits, extra=1):
    """``[M]`` bool: active clients whose budget allows ``extra`` more participations."""
    return state.active & (state.participations + extra <= limits)


def charge(state: PVIState, participating) -> PVIState:
    """Charge one participation to each participating client."""
    return state._replace(participations=state.participations + participating.astype(jnp.int32))


def stop_over_budget(state: PVIState, limits):
    """Deactivate the active clients that cannot afford one more participation; returns
    ``(state, stopped [M] bool)``."""
    stopped = state.active & ~within_budget(state, limits)
    return state._replace(active=state.active & ~stopped), stopped


def synchronous(rule, damping, state: PVIState, data, mask, sizes, key, limits):
    """One synchronous round; returns ``(state, metrics)`` (``metrics["valid"]`` flags trouble)."""
    m = sizes.shape[0]
    state, stopped = stop_over_budget(state, limits)
    q = state.q
    cavities = factors.divide(broadcast(q, m), state.factors)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(m))
    q_new, client_state, metrics = full_rank.map_clients(  # in chunks where jaxlib would split the LAPACK batches
        lambda *xs: rule.update(q, *xs), (cavities, data, mask, sizes, keys, state.client_state), q)
    # A non-finite q_new (a local optimisation that diverged on the client's released, noisy
    # gradients, or a non-private step) is dropped: post-processing of the releases.
    failed = state.active & ~full_rank.map_clients(_finite, (q_new,), q)
    ok = state.active & ~failed
    client_state = jax.tree.map(lambda new, old: jnp.where(_expand(ok, new), new, old), client_state, state.client_state)
    extra = {}
    if factors.is_low_rank(q):  # the changes' bases [B, E_m] widen B; then q is truncated to rank r
        delta = low_rank.changes(q, q_new, ok, damping)
        wide = low_rank.widened_basis(q.eta2.basis, delta.eta2.basis)
        # the clients' private states (virtual factors) are rebased with everything else
        delta, (q, old_factors, t0, t_noise, client_state) = low_rank.rebase(delta, wide), low_rank.rebase_tree(
            (q, state.factors, state.server_factor, state.noise_factor, client_state), wide)
        new_q = factors.multiply(q, factors.product(delta))
        (new_q, new_factors, t0, t_noise, client_state), extra["low_rank_truncation"] = low_rank.truncate_tree(
            (new_q, factors.multiply(old_factors, delta), t0, t_noise, client_state), new_q, rule.rank)
        state = state._replace(server_factor=t0, noise_factor=t_noise)
    else:
        delta = Gaussian(*(jnp.where(_expand(ok, new), damping * (new - q_), 0.0) for new, q_ in zip(q_new, broadcast(q, m))))
        new_factors = factors.multiply(state.factors, delta)
        new_q = factors.multiply(q, factors.product(delta))
    cavity_ok = full_rank.map_clients(factors.is_proper, (cavities,), q) | ~state.active \
        | (not getattr(rule, "uses_client_cavity", True))
    valid = jnp.all(cavity_ok) & factors.is_proper(new_q)
    new_state = charge(state, state.active)._replace(
        q=new_q, factors=new_factors, q_seen=broadcast(new_q, m), client_state=client_state,
        round=state.round + 1, communications=state.communications + jnp.sum(state.active),
    )
    out = {"valid": valid, "loss": metrics["loss"], "participated": state.active, "failed": failed,
           "stopped": stopped,
           "failed_coordinates": jnp.any(failed[:, None] & ~full_rank.map_clients(factors.finite_coordinates, (q_new,), q), 0),
           **extra}
    if "invalid" in metrics:
        out["invalid"] = metrics["invalid"] & state.active
    for name in ("bound", "floored"):
        if name in metrics:
            out[name] = metrics[name] & ok
    for name in ("saturation", "saturation_sd"):  # NaN for a client whose release was not applied
        if name in metrics:
            out[name] = jnp.where(ok, metrics[name], jnp.nan)
    return new_state, out


def _finite(g: Gaussian) -> jax.Array:
    return jnp.all(factors.finite_coordinates(g))


def _expand(flag, x):
    return jnp.reshape(flag, flag.shape + (1,) * (x.ndim - flag.ndim))


def arrivals(rule, damping, state: PVIState, data, mask, sizes, key, order, limits, stale: bool):
    """Clients arrive one after another in ``order`` (sequential: ``arange(M)``; asynchronous: drawn).

    With ``stale=True`` a client computes against ``q_seen[m]`` (asynchronous); otherwise against
    the current ``q`` (sequential). An arrival whose client cannot afford one more participation
    stops that client instead (it releases nothing).
    """

    def arrive(carry, step):
        q, fac, seen, cstate, valid, active, counts, dropped, fixed = carry
        i, m = step
        afford = active[m] & (counts[m] + 1 <= limits[m])
        stop = active[m] & ~afford
        active = active.at[m].set(afford)
        t_m = jax.tree.map(lambda a: a[m], fac)
        start = jax.tree.map(lambda a: a[m], seen) if stale else q
        cavity = factors.divide(start, t_m)
        rows = jax.tree.map(lambda a: a[m], data)
        cs = jax.tree.map(lambda a: a[m], cstate)
        q_new, cs_new, metrics = rule.update(start, cavity, rows, mask[m], sizes[m], jax.random.fold_in(key, i), cs)
        failed = afford & ~_finite(q_new)  # post-processing of the client's releases
        act = afford & ~failed
        if factors.is_low_rank(q):  # widen the shared basis by the answer's, add, truncate (see synchronous)
            delta = low_rank.changes(start, q_new, act, damping)
            wide = low_rank.widened_basis(q.eta2.basis, delta.eta2.basis[None])
            delta, (q, fac, seen, fixed) = low_rank.rebase(delta, wide), low_rank.rebase_tree((q, fac, seen, fixed), wide)
            q_next = factors.multiply(q, delta)
            fac = jax.tree.map(lambda a, d: a.at[m].add(d), fac, delta)
            fac = fac._replace(eta2=fac.eta2._replace(basis=seen.eta2.basis))  # the add summed the shared basis
            (q_next, fac, seen, fixed), share = low_rank.truncate_tree((q_next, fac, seen, fixed), q_next, rule.rank)
            dropped = jnp.maximum(dropped, share)
        else:
            delta = Gaussian(*(jnp.where(act, damping * (new - old), 0.0) for new, old in zip(q_new, start)))
            q_next = factors.multiply(q, delta)
            fac = jax.tree.map(lambda a, d: a.at[m].add(d), fac, delta)
        seen = jax.tree.map(lambda a, v: a.at[m].set(jnp.where(afford, v, a[m])), seen, q_next)
        # an entry the rule passed through (the same traced value: most of a noise-aware state in an optax step)
        # is kept as it is, with no slice and scatter in the program
        cstate = jax.tree.map(lambda a, old, v: a if v is old else a.at[m].set(jnp.where(act, v, old)), cstate, cs,
                              cs_new)
        counts = counts.at[m].add(afford.astype(jnp.int32))
        cavity_ok = factors.is_proper(cavity) | (not getattr(rule, "uses_client_cavity", True))
        valid = valid & ((cavity_ok & factors.is_proper(q_next)) | ~act)
        invalid = metrics.get("invalid", jnp.zeros((), bool)) & act
        bound = metrics.get("bound", jnp.zeros((), bool)) & act
        floored = metrics.get("floored", jnp.zeros((), bool)) & act
        bad = failed & ~factors.finite_coordinates(q_new)
        saturation = tuple(jnp.where(act, metrics.get(name, jnp.nan), jnp.nan) for name in ("saturation", "saturation_sd"))
        return (q_next, fac, seen, cstate, valid, active, counts, dropped, fixed), (
            metrics["loss"], afford, invalid, failed, stop, bad, bound, floored, saturation)

    # the server's factors take no change in these rounds, but each arrival's rebase applies to them as to q
    init = (state.q, state.factors, state.q_seen, state.client_state, jnp.array(True), state.active,
            state.participations, jnp.zeros((), state.q.eta1.dtype), (state.server_factor, state.noise_factor))
    (q, fac, seen, cstate, valid, active, counts, dropped, (t0, t_noise)), (loss, took_part, invalid, failed, stop, bad, bound, floored, saturation) = jax.lax.scan(
        arrive, init, (jnp.arange(order.shape[0]), order)
    )
    extra = {}
    if getattr(rule, "measures_saturation", lambda q: False)(q):
        extra["saturation"], extra["saturation_sd"] = saturation
    if factors.is_low_rank(q):
        state = state._replace(server_factor=t0, noise_factor=t_noise)
        extra["low_rank_truncation"] = dropped
    new_state = state._replace(
        q=q, factors=fac, q_seen=seen, client_state=cstate, round=state.round + 1,
        communications=state.communications + jnp.sum(took_part), active=active, participations=counts,
    )
    m = sizes.shape[0]
    per_client = lambda flags: jnp.zeros(m, bool).at[order].max(flags)
    return new_state, {"valid": valid, "loss": loss, "participated": per_client(took_part), "order": order,
                       "invalid": invalid, "failed": per_client(failed), "stopped": per_client(stop),
                       "failed_coordinates": jnp.any(bad, axis=0), "bound": bound, "floored": floored, **extra}


def arrival_order(key, sizes, active, num_arrivals: int):
    """Asynchronous arrivals: ``num_arrivals`` clients drawn with probability proportional to ``1/n_m``
    among active clients (Sharma et al. 2019)."""
    weights = jnp.where(active, 1.0 / sizes, 0.0)
    logits = jnp.log(jnp.maximum(weights, 1e-30))
    return jax.random.categorical(key, logits, shape=(num_arrivals,))


def refine_server_factor(step, state: PVIState, key) -> PVIState:
    """Server-held prior factor ``t_0`` update (no data, no privacy cost, no communication)."""
    cavity = factors.divide(state.q, state.server_factor)
    q_new = step.update(state.q, cavity, key)
    delta = factors.divide(q_new, state.q)
    m = state.factors.eta1.shape[0]
    return state._replace(
        q=q_new,
        server_factor=factors.multiply(state.server_factor, delta),
        q_seen=factors.multiply(state.q_seen, broadcast(delta, m)),
    )


def client_sample(key, active, rate):
    """Poisson sample of clients: each active client independently with probability ``q' <= rate``,
    decided on 32 random bits (:func:`~numpyro_dppvi.privacy.sampling.inclusion_threshold`), so float
    rounding never samples above the accounted rate (a float32 ``uniform < 0.1`` samples at
    0.1000000238)."""
    bits = jax.random.bits(key, active.shape, dtype=jnp.uint32)
    return active & (bits < inclusion_threshold(rate))


def client_level(rule, damping, state: PVIState, data, mask, sizes, key, limits, clip, noise_std, client_rate,
                 invalid_rule="reject", precision_floor=1e-3):
    """Synchronous round with client-level DP (Liu 2019, §3.3).

    Clients take part independently with probability ``client_rate`` (:func:`client_sample`). Each
    participant's change ``Delta_m = eta(q_m) - eta(q)`` is clipped jointly to norm ``C`` (a
    non-finite change becomes zero); the server releases
    ``A = sum_{m in P} clip(Delta_m) + xi``, ``xi ~ N(0, noise_std^2 I)`` and sets
    ``q <- q + rho A`` (the invalid-update rule runs on this aggregate).

    **The noise stays with the server**: client ``m``'s factor takes only its own clipped change,
    ``t_m += rho clip(Delta_m)``, and the server's noise factor takes ``rho xi``, so
    ``q = prior * t_0 * prod_m t_m * t_noise`` stays exact while a participant who knows its own
    change learns ``sum_{j != m} clip(Delta_j) + xi`` and nothing less noisy (issue 12: giving
    every participant ``clip(Delta_m) + xi / |P|`` let it subtract the noise exactly).

    Sensitivity: adding or removing one client's whole data changes ``A`` by at most ``C``
    (replacing it: ``2C``) in the joint norm of :func:`~.update_perturbation.clip_change`, whichever the
    family (full-rank: the Frobenius norm of the ``eta2`` change, the norm ``release_change`` noises); every other client's change depends on its own data, its private
    factor (no noise share) and the public ``q``. Every active client is charged every round (it
    may be sampled); which clients were sampled, and how many, stays private.
    """
    m = sizes.shape[0]
    state, stopped = stop_over_budget(state, limits)
    q = state.q
    k_part, k_clients, k_noise = jax.random.split(key, 3)
    part = client_sample(k_part, state.active, client_rate)
    cavities = factors.divide(broadcast(q, m), state.factors)
    keys = jax.vmap(lambda i: jax.random.fold_in(k_clients, i))(jnp.arange(m))
    q_new, client_state, metrics = full_rank.map_clients(
        lambda *xs: rule.update(q, *xs), (cavities, data, mask, sizes, keys, state.client_state), q)
    if factors.is_low_rank(q):
        return _client_level_low_rank(rule, damping, state, stopped, part, cavities, q_new, client_state, metrics,
                                      k_noise, clip, noise_std, invalid_rule, precision_floor)
    changes = full_rank.map_clients(lambda a: clip_change(factors.divide(a, q), clip), (q_new,), q)
    changes = Gaussian(*(jnp.where(_expand(part, c), c, 0.0) for c in changes))
    released = release_change(k_noise, factors.product(changes), noise_std)
    proposal, invalid = apply_invalid_rule(q, factors.multiply(q, released), damping, invalid_rule, precision_floor)
    accepted = ~invalid if invalid_rule == "reject" else jnp.ones((), bool)
    new_q = factors.damp(q, proposal, damping)
    own = factors.scale(Gaussian(*(jnp.where(accepted, c, 0.0) for c in changes)), damping)
    noise_part = factors.divide(factors.divide(new_q, q), factors.product(own))
    client_state = jax.tree.map(lambda new, old: jnp.where(_expand(part & accepted, new), new, old),
                                client_state, state.client_state)
    new_state = charge(state, state.active)._replace(
        q=new_q, factors=factors.multiply(state.factors, own),
        noise_factor=factors.multiply(state.noise_factor, noise_part), q_seen=broadcast(new_q, m),
        client_state=client_state, round=state.round + 1, communications=state.communications + jnp.sum(part))
    return new_state, {"valid": factors.is_proper(new_q), "loss": metrics["loss"], "participated": part,
                       "failed": jnp.zeros(m, bool), "invalid": invalid, "stopped": stopped}


def low_rank_client_changes(q: Gaussian, cavities: Gaussian, q_new: Gaussian, part, clip):
    """Each participant's change in public coordinates (:func:`~.low_rank.change_coordinates` of its dense answer),
    clipped jointly to ``clip``; zero for the others. Their sum is client-level DP's release before the noise."""
    changes = full_rank.map_clients(
        lambda c, a: clip_change(low_rank.change_coordinates(q, c, factors.to_full_rank(a)), clip), (cavities, q_new), q)
    return jax.tree.map(lambda c: jnp.where(_expand(part, c), c, 0.0), changes)


def _client_level_low_rank(rule, damping, state, stopped, part, cavities, q_new, client_state, metrics, k_noise,
                           clip, noise_std, invalid_rule, precision_floor):
    """:func:`client_level` for low-rank factors: each participant's change in public coordinates
    (:func:`~.low_rank.change_coordinates`, from its dense answer), clipped jointly to ``C``, summed and released
    with isotropic noise (:func:`~.low_rank.release_coordinates`); the proposal completed with ``q``'s core, each
    participant's factor moved by its own coordinates and its share of the completion, the remainder to the
    server's noise factor (:func:`~.low_rank.settle_aggregate`). Sensitivity: one client's clipped coordinates,
    ``C`` (``2C`` replaced), as for the other families."""
    m = part.shape[0]
    q = state.q
    basis = q.eta2.basis
    changes = low_rank_client_changes(q, cavities, q_new, part, clip)
    released = release_change(k_noise, jax.tree.map(lambda c: jnp.sum(c, axis=0), changes), noise_std, basis)
    proposal = low_rank.from_coordinates(q, q, released, 1.0, noise_std)
    proposal, invalid = apply_invalid_rule(q, proposal, damping, invalid_rule, precision_floor)
    accepted = ~invalid if invalid_rule == "reject" else jnp.ones((), bool)
    new_q = factors.damp(low_rank.in_basis_of(q, proposal), proposal, damping)
    inverse = low_rank.completion_inverse(q.eta2.core + released["core"], noise_std)
    weight = jnp.where(part & accepted, damping, 0.0)
    own = full_rank.map_clients(lambda c, w: low_rank.own_change(c, released, inverse, basis, w), (changes, weight), q)
    client_state = jax.tree.map(lambda new, old: jnp.where(_expand(part & accepted, new), new, old),
                                client_state, state.client_state)
    new_q, new_factors, noise_factor, server_factor, client_state, dropped = low_rank.settle_aggregate(
        q, new_q, own, state.factors, state.noise_factor, state.server_factor, rule.rank, client_state)
    new_state = charge(state, state.active)._replace(
        q=new_q, factors=new_factors, noise_factor=noise_factor, server_factor=server_factor,
        q_seen=broadcast(new_q, m), client_state=client_state, round=state.round + 1,
        communications=state.communications + jnp.sum(part))
    return new_state, {"valid": factors.is_proper(new_q), "loss": metrics["loss"], "participated": part,
                       "failed": jnp.zeros(m, bool), "invalid": invalid, "stopped": stopped,
                       "low_rank_truncation": dropped}
