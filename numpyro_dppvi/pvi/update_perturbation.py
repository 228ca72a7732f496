"""Privacy by perturbing model updates: local averaging, virtual PVI clients, parameter perturbation.

Heikkila et al. 2023, §4.2 (Algorithms 2 and 3, Theorems 7-14). Client ``m`` holds ``N_m`` fixed
disjoint shards (see :mod:`.shards`). Every shard ``k`` proposes a new posterior ``q_k`` from the
current ``q`` and its change in natural parameters ``Delta_k = eta(q_k) - eta(q)`` (the pair
``(eta1, eta2)`` as one vector) is clipped jointly to norm ``C``. The client releases

    R_m = sum_k clip_C(Delta_k) + N(0, sigma^2 C^2 I)                                    (eq. 4.7)

once per round. **Sensitivity**: one record sits in exactly one shard; changing it (added, removed or
replaced) can change that shard's ``clip_C(Delta_k)`` arbitrarily within the ball of radius ``C``, so
``R_m`` moves by at most ``2C`` under either neighbouring relation, and the other shards' terms do not
depend on the record (their inputs are the public ``q`` and their own rows). So one round is a
Gaussian mechanism with noise multiplier ``sigma C / (2C) = sigma / 2``, sampling rate 1 (Theorem 7,
Appendix A.6, ``privacy.sensitivity(C, relation, "shard_update")``); local optimiser steps are free.

* **Local averaging** (Algorithm 2): shard ``k`` maximises
  ``E_q[log p(x_{m,k} | theta)] - KL(q || cavity_m) / N_m`` (eq. 4.1) with full-shard steps and an
  optimiser state kept across rounds; the client's proposal is ``eta(q) + R_m / N_m`` (eq. 4.7).
* **Virtual clients** (Algorithm 3): shard ``k`` has its own factor ``t_{m,k}`` and cavity
  ``q / t_{m,k}``; it runs one PVI local step; ``t_{m,k} += rho (clip_C(Delta_k) + xi_k)`` with
  ``xi_k ~ N(0, sigma^2 C^2 / N_m)`` so that ``sum_k xi_k`` has the accounted ``sigma C``; the client's
  proposal is ``eta(q) + R_m`` and ``t_m = sum_k t_{m,k}`` is kept exact.
* **Parameter perturbation**: local averaging with one shard.

**Invalid noisy updates**: the noisy proposal can have a non-positive precision. The client checks its
own damped update ``q + rho (proposal - q)`` (post-processing of the release: no privacy cost) and
applies the documented rule ``invalid``: ``"reject"`` (default) keeps its old factor (sends a zero
change), ``"floor"`` raises every precision of the proposal to at least ``precision_floor``. Signs
are never flipped. Each occurrence is counted in the round's metrics (``"invalid"``) and the history
(``"invalid_updates"``). In a synchronous round individually valid changes can still sum to an improper
``q``; the server then rejects the round as a whole (all factors and client states kept, the releases
still charged) and the history marks it ``"rejected_round"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from .. import factors, objectives
from ..factors import Gaussian
from .local import optimise

INVALID_RULES = ("reject", "floor")


def _shard_sizes(mask):
    return jnp.sum(mask, axis=-1).astype(jnp.float32)


def clip_change(delta: Gaussian, clip):
    """Clip a change of natural parameters jointly over ``(eta1, eta2)`` to norm ``clip`` (None: no clip)."""
    if clip is None:
        return delta
    from ..privacy.mechanisms import clip_update

    return clip_update(delta, clip)[0]


def apply_invalid_rule(q: Gaussian, proposal: Gaussian, damping, rule: str, precision_floor: float):
    """Return ``(proposal', invalid)``: the proposal after the documented rule and whether it fired."""
    damped = factors.damp(q, proposal, damping)
    invalid = ~factors.is_proper(damped)
    if rule == "reject":
        kept = Gaussian(*(jnp.where(invalid, a, b) for a, b in zip(q, proposal)))
        return kept, invalid
    # floor: eta2 <= -precision_floor / 2 on every coordinate of the proposal
    floored = Gaussian(proposal.eta1, jnp.minimum(proposal.eta2, -0.5 * precision_floor))
    return floored, jnp.any(proposal.eta2 > -0.5 * precision_floor)


@dataclass(frozen=True)
class ShardRule:
    """Settings shared by the shard-based rules; ``clip=None`` means non-private (no clip, no noise)."""

    log_lik_rows: Callable
    dim: int
    optimizer: optax.GradientTransformation
    local_steps: int
    num_samples: int
    clip: float | None = None
    damping: float = 1.0
    invalid: str = "reject"
    precision_floor: float = 1e-3


@dataclass(frozen=True)
class LocalAveraging(ShardRule):
    """Local averaging / parameter perturbation rule (see module docstring)."""

    def init_client_state(self, arrays, mask, key):
        params = {"loc": jnp.zeros(self.dim), "log_scale": jnp.zeros(self.dim)}
        opt = jax.vmap(lambda _: self.optimizer.init(params))(jnp.arange(mask.shape[0]))
        return {"opt": opt, "noise_std": jnp.zeros(())}

    def shard_update(self, q, cavity, num_shards, arrays, mask, opt_state, key):
        """One shard's proposal ``q_k`` (eq. 4.1): full-shard steps with the KL weighted by ``1 / N_m``."""
        size = jnp.maximum(jnp.sum(mask), 1.0)
        return fit_shard(self, q, cavity, arrays, mask, num_shards * size, key, opt_state)

    def clipped_sum(self, q, cavity, arrays, mask, key, client_state):
        """``(sum_k clip_C(Delta_k), new optimiser states)``: the released query before noise."""
        valid_shard = jnp.any(mask, axis=-1)
        num_shards = jnp.sum(valid_shard).astype(jnp.float32)
        keys = jax.random.split(key, mask.shape[0])
        q_k, opt = jax.vmap(self.shard_update, in_axes=(None, None, None, 0, 0, 0, 0))(
            q, cavity, num_shards, arrays, mask, client_state["opt"], keys)
        deltas = jax.vmap(lambda a: clip_change(factors.divide(a, q), self.clip))(q_k)
        return _masked_sum(deltas, valid_shard), opt

    def update(self, q, cavity, arrays, mask, n, key, client_state):
        valid_shard = jnp.any(mask, axis=-1)
        num_shards = jnp.sum(valid_shard).astype(jnp.float32)
        k_shards, k_noise = jax.random.split(key)
        released, opt = self.clipped_sum(q, cavity, arrays, mask, k_shards, client_state)
        released = _add_noise(released, k_noise, client_state["noise_std"])
        proposal = factors.multiply(q, factors.scale(released, 1.0 / num_shards))
        proposal, invalid = apply_invalid_rule(q, proposal, self.damping, self.invalid, self.precision_floor)
        opt = jax.tree.map(lambda new, old: jnp.where(_expand(valid_shard, new), new, old), opt, client_state["opt"])
        return proposal, dict(client_state, opt=opt), {"loss": jnp.zeros(()), "invalid": invalid}


@dataclass(frozen=True)
class VirtualClients(ShardRule):
    """Virtual PVI clients rule (see module docstring).

    The real client's cavity ``q / t_m`` is never used (each virtual client has its own), so the
    server does not require it to be proper (``uses_client_cavity = False``).
    """

    uses_client_cavity = False

    def init_client_state(self, arrays, mask, key):
        k = mask.shape[0]
        return {"factors": Gaussian(jnp.zeros((k, self.dim)), jnp.zeros((k, self.dim))), "noise_std": jnp.zeros(())}

    def shard_update(self, q, t_k, arrays, mask, key):
        """One virtual client's PVI step from ``q`` with cavity ``q / t_k`` (full shard)."""
        cavity = factors.divide(q, t_k)
        q_k, _ = fit_shard(self, q, cavity, arrays, mask, jnp.maximum(jnp.sum(mask), 1.0), key)
        return q_k, factors.is_proper(cavity)

    def clipped_changes(self, q, arrays, mask, key, client_state):
        """Per virtual client ``clip_C(Delta_k)`` (zero for padding shards and invalid cavities) and
        the number of invalid cavities; their sum is the released query before noise."""
        valid_shard = jnp.any(mask, axis=-1)
        q_k, cavity_ok = jax.vmap(self.shard_update, in_axes=(None, 0, 0, 0, 0))(
            q, client_state["factors"], arrays, mask, jax.random.split(key, mask.shape[0]))
        use = valid_shard & cavity_ok  # a virtual client with an invalid cavity proposes no change
        deltas = jax.vmap(lambda a: clip_change(factors.divide(a, q), self.clip))(q_k)
        return Gaussian(*(jnp.where(use[:, None], d, 0.0) for d in deltas)), jnp.sum(valid_shard & ~cavity_ok)

    def update(self, q, cavity, arrays, mask, n, key, client_state):
        t = client_state["factors"]
        valid_shard = jnp.any(mask, axis=-1)
        num_shards = jnp.sum(valid_shard).astype(jnp.float32)
        k_shards, k_noise = jax.random.split(key)
        deltas, cavity_invalid = self.clipped_changes(q, arrays, mask, k_shards, client_state)
        share = client_state["noise_std"] / jnp.sqrt(num_shards)
        noise = jax.tree.map(lambda z: jnp.where(valid_shard[:, None], share * z, 0.0),
                             _normal_like(k_noise, deltas))
        steps = factors.multiply(deltas, noise)  # per virtual client: clip(Delta_k) + xi_k
        proposal = factors.multiply(q, factors.product(steps))
        proposal, invalid = apply_invalid_rule(q, proposal, self.damping, self.invalid, self.precision_floor)
        keep = invalid if self.invalid == "reject" else jnp.zeros((), bool)
        new_t = Gaussian(*(jnp.where(keep, a, a + self.damping * s) for a, s in zip(t, steps)))
        if self.invalid == "floor":  # keep t_m = sum_k t_mk exact: spread the floor's correction evenly
            target = factors.divide(factors.damp(q, proposal, self.damping), q)
            got = factors.scale(factors.product(steps), self.damping)
            fix = factors.scale(factors.divide(target, got), 1.0 / num_shards)
            new_t = Gaussian(*(a + jnp.where(valid_shard[:, None], f, 0.0) for a, f in zip(new_t, fix)))
        return proposal, dict(client_state, factors=new_t), {"loss": jnp.zeros(()), "invalid": invalid,
                                                          "cavity_invalid": cavity_invalid}


def fit_shard(rule, q, cavity, arrays, mask, n_eff, key, opt_state=None):
    """``local_steps`` full-shard steps from ``q`` on ``mean_i E_q[log p(x_i)] + (E_q log cavity + H[q]) / n_eff``;
    returns the shard's proposal and the optimiser state."""

    def gradient(params, k):
        eps = jax.random.normal(k, (rule.num_samples, rule.dim))
        loss = lambda p: -objectives.local_elbo(rule.log_lik_rows, p, eps, arrays, mask, n_eff, cavity)
        value, grads = jax.value_and_grad(loss)(params)
        return grads, value

    params, _, opt_state = optimise(rule.optimizer, factors.to_loc_log_scale(q), rule.local_steps, key, gradient,
                                    opt_state)
    return factors.from_loc_log_scale(params), opt_state


def _masked_sum(deltas: Gaussian, valid) -> Gaussian:
    return Gaussian(*(jnp.sum(jnp.where(valid[:, None], d, 0.0), axis=0) for d in deltas))


def _normal_like(key, g: Gaussian) -> Gaussian:
    k1, k2 = jax.random.split(key)
    return Gaussian(jax.random.normal(k1, g.eta1.shape), jax.random.normal(k2, g.eta2.shape))


def _add_noise(g: Gaussian, key, std) -> Gaussian:
    z = _normal_like(key, g)
    return Gaussian(g.eta1 + std * z.eta1, g.eta2 + std * z.eta2)


def _expand(flag, x):
    return jnp.reshape(flag, flag.shape + (1,) * (x.ndim - flag.ndim))
