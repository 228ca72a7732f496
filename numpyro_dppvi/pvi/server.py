"""PVI server: the state, and one round under each schedule (DESIGN §4).

Global posterior ``eta_q = eta_prior + eta_t0 + sum_m eta_t_m`` (natural parameters). A client's
cavity is ``eta_q - eta_t_m``; its update ``q_new`` becomes the damped change
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

SCHEDULES = ("sequential", "synchronous", "asynchronous")


class PVIState(NamedTuple):
    """Everything a fit needs to continue: a pytree of arrays (saved and resumed as is)."""

    q: Gaussian  # [D]
    factors: Gaussian  # [M, D]
    server_factor: Gaussian  # [D]; zero on coordinates with an exact Gaussian prior
    q_seen: Gaussian  # [M, D]: the q each client received last (asynchronous schedule)
    client_state: Any  # per-client state of the local rule, stacked on axis 0
    key: jax.Array  # base PRNG key (raw uint32 key data)
    round: jax.Array  # int32: rounds completed
    communications: jax.Array  # int32: exchanges so far
    active: jax.Array  # [M] bool: clients still contributing


def round_key(state: PVIState) -> jax.Array:
    """Key of the coming round: ``fold_in(base, round)``; client ``m`` then uses ``fold_in(., m)``."""
    return jax.random.fold_in(jax.random.wrap_key_data(state.key), state.round)


def _broadcast(g: Gaussian, m: int) -> Gaussian:
    return Gaussian(jnp.broadcast_to(g.eta1, (m,) + g.eta1.shape), jnp.broadcast_to(g.eta2, (m,) + g.eta2.shape))


def _select(flag, a: Gaussian, b: Gaussian) -> Gaussian:
    return Gaussian(jnp.where(flag, a.eta1, b.eta1), jnp.where(flag, a.eta2, b.eta2))


def synchronous(rule, damping, state: PVIState, data, mask, sizes, key):
    """One synchronous round; returns ``(state, metrics)`` (``metrics["valid"]`` flags trouble)."""
    m = sizes.shape[0]
    q = state.q
    cavities = factors.divide(_broadcast(q, m), state.factors)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(m))
    q_new, client_state, metrics = jax.vmap(rule.update, in_axes=(None, 0, 0, 0, 0, 0, 0))(
        q, cavities, data, mask, sizes, keys, state.client_state
    )
    failed = state.active & ~jax.vmap(_finite)(q_new)  # a client whose update is non-finite is dropped
    ok = state.active & ~failed
    delta = Gaussian(*(jnp.where(ok[:, None], damping * (new - q_), 0.0) for new, q_ in zip(q_new, _broadcast(q, m))))
    new_factors = factors.multiply(state.factors, delta)
    new_q = factors.multiply(q, factors.product(delta))
    client_state = jax.tree.map(lambda new, old: jnp.where(_expand(ok, new), new, old), client_state, state.client_state)
    cavity_ok = jax.vmap(factors.is_proper)(cavities) | ~state.active | (not getattr(rule, "uses_client_cavity", True))
    valid = jnp.all(cavity_ok) & factors.is_proper(new_q)
    new_state = state._replace(
        q=new_q, factors=new_factors, q_seen=_broadcast(new_q, m), client_state=client_state,
        round=state.round + 1, communications=state.communications + jnp.sum(state.active),
    )
    out = {"valid": valid, "loss": metrics["loss"], "participated": state.active, "failed": failed}
    if "invalid" in metrics:
        out["invalid"] = metrics["invalid"] & state.active
    return new_state, out


def _finite(g: Gaussian) -> jax.Array:
    return jnp.all(jnp.isfinite(g.eta1)) & jnp.all(jnp.isfinite(g.eta2))


def _expand(flag, x):
    return jnp.reshape(flag, flag.shape + (1,) * (x.ndim - flag.ndim))


def arrivals(rule, damping, state: PVIState, data, mask, sizes, key, order, stale: bool):
    """Clients arrive one after another in ``order`` (sequential: ``arange(M)``; asynchronous: drawn).

    With ``stale=True`` a client computes against ``q_seen[m]`` (asynchronous); otherwise against
    the current ``q`` (sequential).
    """

    def arrive(carry, step):
        q, fac, seen, cstate, valid = carry
        i, m = step
        t_m = jax.tree.map(lambda a: a[m], fac)
        start = jax.tree.map(lambda a: a[m], seen) if stale else q
        cavity = factors.divide(start, t_m)
        rows = jax.tree.map(lambda a: a[m], data)
        cs = jax.tree.map(lambda a: a[m], cstate)
        q_new, cs_new, metrics = rule.update(start, cavity, rows, mask[m], sizes[m], jax.random.fold_in(key, i), cs)
        failed = state.active[m] & ~_finite(q_new)  # a non-finite update is dropped
        act = state.active[m] & ~failed
        delta = Gaussian(*(jnp.where(act, damping * (new - old), 0.0) for new, old in zip(q_new, start)))
        q_next = factors.multiply(q, delta)
        fac = jax.tree.map(lambda a, d: a.at[m].add(d), fac, delta)
        seen = jax.tree.map(lambda a, v: a.at[m].set(v), seen, q_next)
        cstate = jax.tree.map(lambda a, v: a.at[m].set(jnp.where(act, v, a[m])), cstate, cs_new)
        cavity_ok = factors.is_proper(cavity) | (not getattr(rule, "uses_client_cavity", True))
        valid = valid & ((cavity_ok & factors.is_proper(q_next)) | ~act)
        invalid = metrics.get("invalid", jnp.zeros((), bool)) & act
        return (q_next, fac, seen, cstate, valid), (metrics["loss"], act | failed, invalid, failed)

    init = (state.q, state.factors, state.q_seen, state.client_state, jnp.array(True))
    (q, fac, seen, cstate, valid), (loss, act, invalid, failed) = jax.lax.scan(
        arrive, init, (jnp.arange(order.shape[0]), order)
    )
    new_state = state._replace(
        q=q, factors=fac, q_seen=seen, client_state=cstate, round=state.round + 1,
        communications=state.communications + jnp.sum(act),
    )
    participated = jnp.zeros(sizes.shape[0], bool).at[order].max(act)
    failed_clients = jnp.zeros(sizes.shape[0], bool).at[order].max(failed)
    return new_state, {"valid": valid, "loss": loss, "participated": participated, "order": order, "invalid": invalid,
                       "failed": failed_clients}


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
        q_seen=Gaussian(*(s + d for s, d in zip(state.q_seen, _broadcast(delta, m)))),
    )


def client_level(rule, damping, state: PVIState, data, mask, sizes, key, clip, noise_std, client_rate):
    """Synchronous round with client-level DP (Liu 2019, §3.3; DESIGN §5.3).

    Clients take part independently with probability ``client_rate`` (Poisson over clients). Each
    participant's change ``Delta_m = eta(q_m) - eta(q)`` is clipped jointly to norm ``C``; the server
    adds ``xi ~ N(0, noise_std^2 I)`` once to the sum and gives every participant the share
    ``clip(Delta_m) + xi / |P|``, so ``t_m += rho (clip(Delta_m) + xi / |P|)`` and
    ``q += rho (sum_m clip(Delta_m) + xi)``: ``q = prior * t_0 * prod_m t_m`` stays exact.
    Sensitivity: adding or removing one client's whole data changes the sum by at most ``C``
    (replacing it: ``2C``); each client's update is otherwise post-processing of the noisy sums.
    """
    from .update_perturbation import clip_change

    m = sizes.shape[0]
    q = state.q
    k_part, k_clients, k_noise = jax.random.split(key, 3)
    part = state.active & (jax.random.uniform(k_part, (m,)) < client_rate)
    cavities = factors.divide(_broadcast(q, m), state.factors)
    keys = jax.vmap(lambda i: jax.random.fold_in(k_clients, i))(jnp.arange(m))
    q_new, client_state, metrics = jax.vmap(rule.update, in_axes=(None, 0, 0, 0, 0, 0, 0))(
        q, cavities, data, mask, sizes, keys, state.client_state)
    failed = part & ~jax.vmap(_finite)(q_new)
    part = part & ~failed
    changes = jax.vmap(lambda a: clip_change(factors.divide(a, q), clip))(q_new)
    changes = Gaussian(*(jnp.where(part[:, None], c, 0.0) for c in changes))
    k1, k2 = jax.random.split(k_noise)
    xi = Gaussian(noise_std * jax.random.normal(k1, q.eta1.shape), noise_std * jax.random.normal(k2, q.eta2.shape))
    count = jnp.maximum(jnp.sum(part), 1)
    shares = Gaussian(*(jnp.where(part[:, None], c + x / count, 0.0) for c, x in zip(changes, xi)))
    delta = factors.scale(shares, damping)
    new_q = factors.multiply(q, factors.product(delta))
    valid = factors.is_proper(new_q)
    new_state = state._replace(q=new_q, factors=factors.multiply(state.factors, delta), q_seen=_broadcast(new_q, m),
                               round=state.round + 1, communications=state.communications + jnp.sum(part))
    return new_state, {"valid": valid, "loss": metrics["loss"], "participated": part | failed, "failed": failed}
