"""What each party computes locally in the SFVI protocol (Hassan et al., §4.3-4.4).

A :class:`ClientParty` closes over one client's own columns (and ``y`` only when the formulation
shares it); a :class:`ServerParty` closes over ``y`` and the likelihood. Every method is a pure
function of the party's own variational parameters, a PRNG key, the batch row index and the
payloads of messages it received. ELBO pieces (one MC sample; ``scale = n / batch``):

* client, eq. (11)-(13), (15)-(17):
  ``L_j = log p(theta_j) - log q(theta_j)
  + scale * sum_i [log N(z_ij | g_ij, rho) - log q(z_ij | .)]``
* server, augmented (Alg. 1):
  ``L_0 = scale * log p(y_b | sum_j z_j, gamma) + log p(gamma) - log q(gamma)``
* client, power (Alg. 2): ``L_0j = scale / J * log p(y_b | g_j + sum_{k != j} z_k, gamma)``;
  the server keeps ``log p(gamma) - log q(gamma)``.
* split NN: ``z_j = g_j`` is deterministic, ``L_j = 0`` and the server's ``L_0`` as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.scipy.stats import norm

from .client import VFLClient, rows
from .guides import DiagonalGaussian, make_aux_guide
from .sites import ProgramLayout, run_program, trace_layout, unconstrained_zeros_like

FORMULATIONS = ("augmented", "power", "split")


@dataclass(frozen=True)
class ClientParty:
    """Client ``j``: its columns, sub-model layout and variational family."""

    client: VFLClient
    layout: ProgramLayout
    theta_guide: DiagonalGaussian
    aux_guide: Any  # MeanFieldAux | AmortizedAux | None (split NN)
    rho: float
    num_rows: int
    # only for the power formulation (y shared with clients):
    y: Any = None
    y_feature: Any = None
    likelihood: Callable | None = None
    server_layout: ProgramLayout | None = None
    num_clients: int = 1
    position: int = 0  # index j of this client in the protocol's order
    stl: bool = True

    @property
    def name(self) -> str:
        return self.client.name

    def init(self, key) -> dict:
        params = {
            "theta": self.theta_guide.init(),
            "point": self.layout.init_unconstrained_params(),
        }
        if self.aux_guide is not None:
            _, _, g = run_program(
                self.client.scoped_submodel, (self.client.x,), self.layout,
                params["theta"]["loc"], params["point"],
            )
            params["aux"] = self.aux_guide.init(key, g)
        return params

    def draw(self, params, key, index):
        """Sample ``theta_j`` (eq. 8) and ``z_j`` (eq. 9/10) on the batch rows.

        Returns ``(u_j, z_j, L_j)``: unconstrained ``theta_j``, the message ``z_j`` and the
        client's independent ELBO term ``L_j``.
        """
        k_theta, k_tau = jax.random.split(key)
        u, log_q_theta = self.theta_guide.sample(
            params["theta"], self.theta_guide.noise_like(k_theta), self.stl
        )
        log_prior, _, g = run_program(
            self.client.scoped_submodel, (rows(self.client.x, index),), self.layout, u,
            params["point"],
        )
        theta_term = log_prior - log_q_theta
        if self.aux_guide is None:  # split NN: the message is the network output itself
            return u, g, theta_term
        scale = self.num_rows / index.shape[0]
        y_feat = None if self.y_feature is None else self.y_feature[index]
        tau = jax.random.normal(k_tau, g.shape)
        z, log_q_z = self.aux_guide.sample(params["aux"], index, g, y_feat, tau, self.stl)
        log_p_z = jnp.sum(norm.logpdf(z, g, self.rho))
        return u, z, theta_term + scale * (log_p_z - log_q_z)

    def forward(self, params, key, index):
        """``(z_j, L_j)`` of :meth:`draw`."""
        _, z, local = self.draw(params, key, index)
        return z, local

    def power_likelihood_term(self, params, key, index, z_all, gamma_u):
        """``L_0j = scale / J * log p(y_b | g_j + sum_{k != j} z_k, gamma)`` (eq. 14)."""
        k_theta, _ = jax.random.split(key)
        u, _ = self.theta_guide.sample(
            params["theta"], self.theta_guide.noise_like(k_theta), self.stl
        )
        _, _, g = run_program(
            self.client.scoped_submodel, (rows(self.client.x, index),), self.layout, u,
            params["point"],
        )
        others = jnp.arange(z_all.shape[0]) != self.position
        eta = g + jnp.sum(jnp.where(others[:, None], z_all, 0.0), axis=0)
        _, log_lik, _ = run_program(
            self.likelihood, (eta, rows(self.y, index)), self.server_layout, gamma_u, {}
        )
        return (self.num_rows / index.shape[0]) * log_lik / self.num_clients

def make_client_party(client, *, position, formulation, guide, rho, y, likelihood,
                      server_layout, num_clients, rng_key, hidden, init_scale, stl):
    """Trace the client's sub-model and build its party (checks the sub-model's output)."""
    n = client.num_rows
    layout = trace_layout(client.scoped_submodel, (client.x,), rng_key,
                          what=f"client {client.name!r} submodel")
    g = run_program(client.scoped_submodel, (client.x,), layout, unconstrained_zeros_like(layout),
                    layout.init_unconstrained_params())[2]
    if g.shape != (n,):
        raise ValueError(
            f"client {client.name!r}: submodel(x_j) must return the per-row contribution g_j of "
            f"shape [{n}], got shape {g.shape}"
        )
    if n > 1:
        small = trace_layout(client.scoped_submodel, (rows(client.x, jnp.arange(1)),), rng_key,
                             what=f"client {client.name!r} submodel")
        for a, b in zip(layout.latent, small.latent):
            if a.shape != b.shape:
                raise ValueError(
                    f"client {client.name!r}: latent site {a.name!r} changes shape with the number "
                    "of rows; per-row latent variables are not supported in a sub-model (the "
                    "auxiliary z_j already plays that role)"
                )
    if formulation == "split":
        if layout.latent:
            raise ValueError(
                f"client {client.name!r}: a split NN client must be deterministic (numpyro.param "
                f"only), found latent sites {[s.name for s in layout.latent]}; use "
                "formulation='augmented' for the hierarchical Bayes split NN"
            )
        aux = None
    else:
        aux = make_aux_guide(guide, num_rows=n, rho=rho, uses_y=formulation == "power",
                             hidden=hidden, init_scale=init_scale)
    shared_y = formulation == "power"
    y_feature = standardised_response(y) if shared_y else None
    party = ClientParty(
        client=client, layout=layout, theta_guide=DiagonalGaussian(layout, init_scale),
        aux_guide=aux, rho=rho, num_rows=n,
        y=y if shared_y else None, y_feature=y_feature,
        likelihood=likelihood if shared_y else None,
        server_layout=server_layout if shared_y else None,
        num_clients=num_clients, position=position, stl=stl,
    )
    return party


def standardised_response(y):
    """``(y - mean) / sd`` of the response (the first array of ``y``): the amortised guide's
    input in the power formulation."""
    y_arr = jnp.asarray(jax.tree_util.tree_leaves(y)[0], jnp.float32)
    sd = jnp.std(y_arr)
    return (y_arr - jnp.mean(y_arr)) / jnp.where(sd > 0, sd, 1.0)


@dataclass(frozen=True)
class ServerParty:
    """The server: ``y``, the likelihood and ``q(gamma)`` over its shared latent sites."""

    likelihood: Callable
    layout: ProgramLayout
    gamma_guide: DiagonalGaussian
    y: Any
    num_rows: int
    stl: bool = True

    def init(self) -> dict:
        return self.gamma_guide.init()

    def sample_gamma(self, params, key):
        """``gamma_u ~ q(gamma)`` on the unconstrained space and ``log q(gamma_u)``."""
        return self.gamma_guide.sample(params, self.gamma_guide.noise_like(key), self.stl)

    def gamma_prior_term(self, gamma_u, log_q):
        """``log p(gamma) + log|J| - log q(gamma)`` (the server's own ELBO term)."""
        eta0 = jnp.zeros((1,))
        log_prior, _, _ = run_program(
            self.likelihood, (eta0, rows(self.y, jnp.arange(1))), self.layout, gamma_u, {}
        )
        return log_prior - log_q

    def augmented_objective(self, params, key, index, zs):
        """``L_0`` of Algorithm 1 at one MC sample (zs: list of the clients' ``z_j``)."""
        gamma_u, log_q = self.sample_gamma(params, key)
        log_prior, log_lik, _ = run_program(
            self.likelihood, (sum(zs), rows(self.y, index)), self.layout, gamma_u, {}
        )
        return (self.num_rows / index.shape[0]) * log_lik + log_prior - log_q

    def power_objective(self, params, key, dL0_dgamma):
        """Server surrogate in Algorithm 2: own prior/entropy term plus the clients' gradients."""
        gamma_u, log_q = self.sample_gamma(params, key)
        own = self.gamma_prior_term(gamma_u, log_q)
        pulled = sum(
            (jnp.sum(jax.lax.stop_gradient(dL0_dgamma[k]) * gamma_u[k]) for k in gamma_u),
            jnp.zeros(()),
        )
        return own + pulled, own
