"""``VFLResult``: the fitted variational posterior of a VFL model, its ELBO trace and messages."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from numpyro import handlers
from numpyro.infer import Predictive, log_likelihood

from .models import AUX_SITE, augmented_model, centralised_model


@dataclass
class VFLResult:
    """What :func:`fit_vfl` returns.

    Attributes:
        elbo: per-iteration Monte Carlo ELBO estimates, shape ``[steps]``.
        history: message log: the messages of one iteration (sender, receiver, kind, shape,
            size), their totals over the fit and per party.
        state: the parties' final variational parameters and optimiser states (a pytree).
    """

    clients: list
    likelihood: Callable
    formulation: str
    guide: str
    rho: float
    parties: list
    server: Any
    state: dict
    elbo: np.ndarray
    messages: list
    steps: int
    history: dict = field(init=False)

    def __post_init__(self):
        per_iteration = [m.to_dict() for m in self.messages]
        sent, received = Counter(), Counter()
        for m in self.messages:
            sent[m.sender] += m.size * self.steps
            received[m.receiver] += m.size * self.steps
        self.history = {
            "elbo": self.elbo,
            "iterations": self.steps,
            "messages_per_iteration": per_iteration,
            "num_messages": len(self.messages) * self.steps,
            "num_scalars": sum(m.size for m in self.messages) * self.steps,
            "scalars_sent": dict(sent),
            "scalars_received": dict(received),
        }

    # ----- posterior draws -------------------------------------------------------------------
    def point_params(self) -> dict:
        """Constrained values of the clients' ``numpyro.param`` sites (e.g. split-NN weights)."""
        out = {}
        for party, p in zip(self.parties, self.state["clients"]):
            out.update(party.layout.constrain_params(p["point"]))
        return out

    def sample_posterior(self, rng_key=None, num_samples: int = 1000, include_aux: bool = False):
        """Draws of every latent site from ``q`` (constrained, site names as in the models).

        ``include_aux`` adds the training rows' auxiliary ``"<client>/z"`` (``[num_samples, n]``).
        """
        rng_key = jax.random.key(1) if rng_key is None else rng_key
        cache = self.__dict__.setdefault("_samplers", {})
        if (num_samples, include_aux) not in cache:
            cache[num_samples, include_aux] = jax.jit(
                lambda state, key: self._draw(state, key, num_samples, include_aux)
            )
        draws = cache[num_samples, include_aux](self.state, rng_key)
        return {k: np.asarray(v) for k, v in draws.items()}

    def _draw(self, state, rng_key, num_samples, include_aux):
        k_server, *k_clients = jax.random.split(rng_key, len(self.parties) + 1)
        out = {}
        gamma = jax.vmap(lambda k: self.server.sample_gamma(state["server"], k)[0])(
            jax.random.split(k_server, num_samples)
        )
        out.update(self.server.layout.constrain_latent(gamma))  # transforms broadcast over draws
        for party, p, k in zip(self.parties, state["clients"], k_clients):
            index = jnp.arange(party.num_rows)
            u, z, _ = jax.vmap(lambda kk: party.draw(p, kk, index))(jax.random.split(k, num_samples))
            out.update(party.layout.constrain_latent(u))
            if include_aux and party.aux_guide is not None:
                out[f"{party.name}/{AUX_SITE}"] = z
        return out

    def to_arviz(self, num_samples: int = 1000, rng_key=None, include_aux: bool = False):
        """``arviz.InferenceData`` with a ``posterior`` group (one chain) of the latent sites."""
        import arviz as az

        draws = self.sample_posterior(rng_key, num_samples, include_aux)
        return az.from_dict(posterior={k: v[None] for k, v in draws.items()})

    # ----- prediction ------------------------------------------------------------------------
    def _new_clients(self, x_new):
        if isinstance(x_new, dict):
            missing = {c.name for c in self.clients} - set(x_new)
            if missing:
                raise ValueError(f"x_new misses the columns of clients {sorted(missing)}")
            x_new = [x_new[c.name] for c in self.clients]
        if len(x_new) != len(self.clients):
            raise ValueError(
                f"x_new must give the new rows' columns of each of the {len(self.clients)} "
                "clients, in the clients' order (or a dict by client name)"
            )
        return [c.with_x(x) for c, x in zip(self.clients, x_new)]

    def _predictive_model(self, x_new, model: str | None):
        model = model or ("augmented" if self.formulation == "augmented" else "centralised")
        new = self._new_clients(x_new)
        if model == "augmented":
            return augmented_model(new, self.likelihood, self.rho)
        if model == "centralised":
            return centralised_model(new, self.likelihood)
        raise ValueError(f"model must be 'augmented' or 'centralised', got {model!r}")

    def predict(self, x_new, rng_key=None, num_samples: int = 1000, model: str | None = None,
                return_sites=None) -> dict:
        """Posterior predictive draws for new rows split across the clients like the training rows.

        ``model="augmented"`` (default after an augmented fit) draws new ``z_j ~ N(g_j, rho)``;
        ``"centralised"`` (default otherwise) uses ``eta = sum_j g_j``. Runs NumPyro's
        ``Predictive`` with draws of ``theta`` and ``gamma`` from ``q``.
        """
        rng_key = jax.random.key(2) if rng_key is None else rng_key
        k_post, k_pred = jax.random.split(rng_key)
        predictive = self._predictive(self._predictive_model(x_new, model), k_post, num_samples,
                                      return_sites)
        return {k: np.asarray(v) for k, v in predictive(k_pred).items()}

    def _predictive(self, program, rng_key, num_samples, return_sites):
        samples = self.sample_posterior(rng_key, num_samples)
        if not samples:  # nothing latent (a plain split NN): the network is the prediction
            return Predictive(program, num_samples=num_samples, params=self.point_params(),
                              return_sites=return_sites)
        return Predictive(program, posterior_samples=samples, params=self.point_params(),
                          return_sites=return_sites)

    def log_predictive_density(self, x_new, y_new, rng_key=None, num_samples: int = 1000,
                               model: str | None = None) -> np.ndarray:
        """Per-row ``log p(y_i | x_i, data) ~= log mean_s p(y_i | draw s)`` for new rows."""
        rng_key = jax.random.key(3) if rng_key is None else rng_key
        k_post, k_pred = jax.random.split(rng_key)
        program = self._predictive_model(x_new, model)
        latent = [s.name for s in self.server.layout.latent]
        latent += [s.name for p in self.parties for s in p.layout.latent]
        aux = [f"{c.name}/{AUX_SITE}" for c in self.clients]
        full = self._predictive(program, k_post, num_samples, latent + aux)(k_pred)
        ll = log_likelihood(handlers.substitute(program, data=self.point_params()), full,
                            y=jnp.asarray(y_new))
        # one row of draws per posterior draw (a single row when nothing is random)
        per_draw = sum(jnp.reshape(v, (v.shape[0], -1)) for v in ll.values())
        return np.asarray(logsumexp(per_draw, axis=0) - jnp.log(per_draw.shape[0]))
