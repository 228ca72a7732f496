"""The SFVI protocol for vertical federated learning (Hassan et al., Algorithms 1 and 2).

One iteration is one jitted, pure function of the parties' states; iterations run under
``lax.scan``. Parties only exchange *messages* through a :class:`Channel`, which records who sent
what to whom (kind, shape, number of scalars) while the step is traced. A client's functions close
over its own columns only (plus ``y`` in the power formulation, where ``y`` is shared by
definition); they receive nothing but the payloads listed below.

Augmented-variable model, Algorithm 1 (also the split NN, where ``z_j = g_j``):

1. server -> client j: the batch row index (``B`` integers; omitted without mini-batches);
2. client j -> server: ``z_j`` (``S x B`` draws, eq. 9/10);
3. server -> client j: ``dL_0/dz_j``; every client updates ``(phi_j, psi_j)`` with eq. (11)-(13).

Power-likelihood model, Algorithm 2:

1. server -> client j: the batch row index;
2. client j -> server: ``z_j``;
3. server -> client j: all ``z`` and a draw of the shared ``gamma`` (unconstrained);
4. client j -> server: ``{dL_0j/dz_k}_{k != j}`` and ``dL_0j/dgamma``;
5. server -> client j: ``sum_{k != j} dL_0k/dz_j``; clients update with eq. (15)-(17), the server
   updates ``q(gamma)`` with its own term plus the summed ``dL_0j/dgamma``.

``S = num_samples`` Monte Carlo draws are processed together (``vmap``); gradients are averaged.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

SERVER = "server"


@dataclass(frozen=True)
class Message:
    """One message of one protocol iteration.

    Attributes:
      phase: the message's place in the iteration, counted from 0 (the numbered steps of the module
        docstring, minus one: 0 the row index, 1 the clients' ``z_j``, ...).
      sender: the sending party: ``"server"`` or a client's name.
      receiver: the receiving party: ``"server"`` or a client's name.
      kind: what the payload is (``"row_index"``, ``"z"``, ``"dL0/dz"``, ``"z_all"``, ``"gamma"``, ...).
      shape: the payload's shape (for a payload of several arrays, ``(number of arrays,)``).
      size: the number of scalars in the payload.
    """

    phase: int
    sender: str
    receiver: str
    kind: str
    shape: tuple
    size: int  # number of scalars

    def to_dict(self) -> dict:
        return {
            "phase": self.phase, "sender": self.sender, "receiver": self.receiver,
            "kind": self.kind, "shape": list(self.shape), "size": self.size,
        }


class Channel:
    """Passes payloads between parties and records each message (at trace time)."""

    def __init__(self):
        self.messages: list[Message] = []

    def send(self, phase: int, sender: str, receiver: str, kind: str, payload):
        leaves = jax.tree_util.tree_leaves(payload)
        shape = tuple(np.shape(leaves[0])) if len(leaves) == 1 else (len(leaves),)
        size = int(sum(np.size(leaf) for leaf in leaves))
        self.messages.append(Message(phase, sender, receiver, kind, shape, size))
        return payload


def _ascend(optimizer, grads, opt_state, params):
    """One optax step that *maximises* (optax minimises, so the gradient is negated)."""
    neg = jax.tree_util.tree_map(jnp.negative, grads)
    updates, opt_state = optimizer.update(neg, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def make_step(clients, server, optimizer, *, formulation, num_samples, batch_size, num_rows):
    """Build ``init(key) -> state`` and ``step(state, key, channel) -> (state, elbo)``.

    ``elbo`` is the one-iteration Monte Carlo estimate of the ELBO (before the update), summed
    over the parties' terms: ``L_0 + sum_j L_j`` (augmented) or
    ``sum_j (L_0j + L_1j) + E[log p(gamma) - log q(gamma)]`` (power), eq. (14).
    """

    num_clients = len(clients)

    def init(key):
        keys = jax.random.split(key, num_clients)
        cparams = [c.init(k) for c, k in zip(clients, keys)]
        sparams = server.init()
        return {
            "clients": cparams,
            "server": sparams,
            "client_opt": [optimizer.init(p) for p in cparams],
            "server_opt": optimizer.init(sparams),
        }

    def draws(key):
        """Batch index and per-party keys of one iteration (``S`` keys per party)."""
        k_batch, k_server, k_clients = jax.random.split(key, 3)
        client_keys = [
            jax.random.split(k, num_samples) for k in jax.random.split(k_clients, num_clients)
        ]
        server_keys = jax.random.split(k_server, num_samples)
        if batch_size is None:
            index = jnp.arange(num_rows)
        else:
            index = jax.random.choice(k_batch, num_rows, (batch_size,), replace=False)
        return index, client_keys, server_keys

    def step(state, key, channel: Channel):
        index, client_keys, server_keys = draws(key)
        inbox_index = [
            channel.send(0, SERVER, c.name, "row_index", index) if batch_size is not None else index
            for c in clients
        ]
        # clients: draw theta_j, z_j (eq. 8-10), keep the pullback, send z_j to the server
        zs, locals_, pullbacks = [], [], []
        for c, p, ks, idx in zip(clients, state["clients"], client_keys, inbox_index):
            (z, local), pullback = jax.vjp(
                lambda pp, c=c, ks=ks, idx=idx: jax.vmap(c.forward, (None, 0, None))(pp, ks, idx),
                p,
            )
            zs.append(channel.send(1, c.name, SERVER, "z", z))
            locals_.append(local)
            pullbacks.append(pullback)
        if formulation in ("augmented", "split"):
            return _augmented_round(state, channel, zs, locals_, pullbacks, server_keys, index)
        return _power_round(state, channel, zs, locals_, pullbacks, server_keys, client_keys,
                            inbox_index)

    def _client_update(state, j, pullback, dz, extra_grads=None):
        """Client j's gradient of ``mean_s [L_j + <dL_0/dz_j, z_j>]`` (eq. 11-13 / 15-17)."""
        ones = jnp.full((num_samples,), 1.0 / num_samples)
        (grads,) = pullback((dz / num_samples, ones))
        if extra_grads is not None:
            grads = jax.tree_util.tree_map(jnp.add, grads, extra_grads)
        return _ascend(optimizer, grads, state["client_opt"][j], state["clients"][j])

    def _augmented_round(state, channel, zs, locals_, pullbacks, server_keys, index):
        def server_per_draw(sp, zs_all):
            return jax.vmap(lambda z_s, k: server.augmented_objective(sp, k, index, z_s))(
                zs_all, server_keys
            )

        l0, vjp_server = jax.vjp(server_per_draw, state["server"], zs)
        # per-draw dL_0/dz_j for the clients; the mean over draws for the server's own update
        g_server, g_zs = vjp_server(jnp.ones((num_samples,)))
        g_server = jax.tree_util.tree_map(lambda g: g / num_samples, g_server)
        sparams, sopt = _ascend(optimizer, g_server, state["server_opt"], state["server"])

        new_c, new_opt, elbo = [], [], jnp.mean(l0)
        for j, c in enumerate(clients):
            dz = channel.send(2, SERVER, c.name, "dL0/dz", g_zs[j])
            p, o = _client_update(state, j, pullbacks[j], dz)
            new_c.append(p)
            new_opt.append(o)
            elbo = elbo + jnp.mean(locals_[j])
        new_state = {"clients": new_c, "server": sparams, "client_opt": new_opt, "server_opt": sopt}
        return new_state, elbo

    def _power_round(state, channel, zs, locals_, pullbacks, server_keys, client_keys, inbox_index):
        gamma_u, _ = jax.vmap(lambda k: server.sample_gamma(state["server"], k))(server_keys)
        z_all = jnp.stack(zs, axis=1)  # [S, J, B]

        # server -> clients: all z and gamma; clients -> server: dL_0j/dz_k (k != j), dL_0j/dgamma
        from_clients, theta_grads, l0_values = [], [], []
        for j, c in enumerate(clients):
            z_in = channel.send(3, SERVER, c.name, "z_all", z_all)
            gamma_in = channel.send(3, SERVER, c.name, "gamma", gamma_u)

            def l0j(p, z_s, g_s, k, c=c, idx=inbox_index[j]):
                return c.power_likelihood_term(p, k, idx, z_s, g_s)

            value, vjp_l0j = jax.vjp(
                lambda p, z, g, ks=client_keys[j]: jax.vmap(l0j, (None, 0, 0, 0))(p, z, g, ks),
                state["clients"][j], z_in, gamma_in,
            )
            g_theta, g_z, g_gamma = vjp_l0j(jnp.ones((num_samples,)))
            theta_grads.append(jax.tree_util.tree_map(lambda g: g / num_samples, g_theta))
            l0_values.append(jnp.mean(value))
            others = np.array([k for k in range(num_clients) if k != j])
            sent_z = channel.send(4, c.name, SERVER, "dL0j/dz_others", g_z[:, others])
            sent_gamma = channel.send(4, c.name, SERVER, "dL0j/dgamma", g_gamma)
            from_clients.append((others, sent_z, sent_gamma))

        # server: sum_{k != j} dL_0k/dz_j, and the summed gamma gradients
        summed = [jnp.zeros_like(zs[j]) for j in range(num_clients)]
        for others, sent_z, _ in from_clients:
            for pos, k in enumerate(others):
                summed[k] = summed[k] + sent_z[:, pos]
        dgamma = jax.tree_util.tree_map(lambda *gs: sum(gs), *[g for _, _, g in from_clients])
        s_value, s_grads = _server_power_grads(state["server"], server_keys, dgamma)
        sparams, sopt = _ascend(optimizer, s_grads, state["server_opt"], state["server"])

        new_c, new_opt, elbo = [], [], s_value
        for j, c in enumerate(clients):
            dz = channel.send(5, SERVER, c.name, "sum_k dL0k/dz_j", summed[j])
            p, o = _client_update(state, j, pullbacks[j], dz, theta_grads[j])
            new_c.append(p)
            new_opt.append(o)
            elbo = elbo + jnp.mean(locals_[j]) + l0_values[j]
        new_state = {"clients": new_c, "server": sparams, "client_opt": new_opt, "server_opt": sopt}
        return new_state, elbo

    def _server_power_grads(sparams, keys, dgamma):
        def mean_fn(sp):
            obj, own = jax.vmap(lambda k, d: server.power_objective(sp, k, d))(keys, dgamma)
            return jnp.mean(obj), jnp.mean(own)

        (_, own), grads = jax.value_and_grad(mean_fn, has_aux=True)(sparams)
        return own, grads

    return init, step, draws


def joint_elbo_estimate(clients, server, state, key, *, formulation, draws):
    """The same one-iteration ELBO estimate, computed centrally without messages.

    A reference for the protocol: its gradient with respect to all parties' parameters at once
    equals the gradients the parties assemble from the messages (eq. 11-13, 15-17). Only for
    tests and diagnostics: it reads every party's data in one place.
    """
    index, client_keys, server_keys = draws(key)
    cparams, sparams = state["clients"], state["server"]

    def one_draw(ckeys, skey):
        outs = [c.forward(p, k, index) for c, p, k in zip(clients, cparams, ckeys)]
        zs = [z for z, _ in outs]
        total = sum(local for _, local in outs)
        if formulation in ("augmented", "split"):
            return total + server.augmented_objective(sparams, skey, index, zs)
        gamma_u, log_q = server.sample_gamma(sparams, skey)
        z_all = jnp.stack(zs)
        for c, p, k in zip(clients, cparams, ckeys):
            total = total + c.power_likelihood_term(p, k, index, z_all, gamma_u)
        return total + server.gamma_prior_term(gamma_u, log_q)

    return jnp.mean(jax.vmap(one_draw)(client_keys, server_keys))
