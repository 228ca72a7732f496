"""The paper's joint models as ordinary NumPyro models (Hassan et al., §3.2-3.3).

With clients ``j = 1..J`` returning ``g_j = g_j(x_j, theta_j)`` and the server likelihood
``p(y | eta, gamma)`` (``likelihood(eta, y)``, which samples the shared ``gamma`` itself):

* true (centralised) model, eq. (5): ``y ~ p(y | sum_j g_j, gamma)``;
* augmented-variable model, eq. (6): ``z_j ~ N(g_j, rho)`` per row, ``y ~ p(y | sum_j z_j, gamma)``;
* power-likelihood model, eq. (7): ``z_j ~ N(g_j, rho)``,
  ``y ~ prod_j p(y | g_j + sum_{k != j} z_k, gamma)^(1/J)``.

``rho`` is the standard deviation of ``z_j | theta_j`` (the paper's Table 1 writes
``N(x^T beta, rho)``). As ``rho -> 0`` both augmented posteriors of ``(theta, gamma)`` tend to the
true one. The auxiliary site of client ``c`` is ``"c/z"`` (shape ``[n]``, in plate ``"c/rows"``).
In the power model the ``J`` tempered likelihood terms are observed sites ``"c/<obs>"``; the
shared ``gamma`` is sampled once, by an untempered pass whose observed sites are hidden.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.primitives import Messenger

from .client import VFLClient, check_clients

AUX_SITE = "z"


class scale_observed(Messenger):
    """Multiply the log-density of observed sample sites (only) by ``scale``."""

    def __init__(self, fn=None, scale=1.0):
        self.scale = scale
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "sample" and msg["is_observed"]:
            msg["scale"] = self.scale if msg.get("scale") is None else self.scale * msg["scale"]


def _check_rho(rho) -> float:
    try:
        rho = float(rho)
    except (TypeError, ValueError):
        raise TypeError(f"rho must be a positive number, got {rho!r}") from None
    if not rho > 0 or not jnp.isfinite(rho):
        raise ValueError(
            f"rho must be a positive finite number (the std of z_j | theta_j), got {rho}"
        )
    return rho


def _is_latent(msg) -> bool:
    return msg["type"] == "sample" and not msg["is_observed"]


def _auxiliary(client: VFLClient, g, rho):
    with handlers.scope(prefix=client.name):
        with numpyro.plate("rows", g.shape[0]):
            return numpyro.sample(AUX_SITE, dist.Normal(g, rho))


def centralised_model(clients: Sequence[VFLClient], likelihood: Callable):
    """The true model (5): ``y ~ p(y | sum_j g_j(x_j, theta_j), gamma)``; returns
    ``model(y=None)``.

    Args:
      clients: the :class:`~numpyro_dppvi.VFLClient` s, each with its columns ``x`` and its sub-model ``g_j``.
      likelihood: ``likelihood(eta, y)``: a NumPyro program that samples the shared parameters ``gamma`` and
        observes ``y`` given the linear predictor ``eta`` of shape ``[rows]``.
    """
    check_clients(clients)

    def model(y=None):
        eta = sum(c.scoped_submodel(c.x) for c in clients)
        return likelihood(eta, y)

    return model


def augmented_model(clients: Sequence[VFLClient], likelihood: Callable, rho: float):
    """Augmented-variable model (6); returns ``model(y=None)``.

    Args:
      clients: the :class:`~numpyro_dppvi.VFLClient` s, each with its columns ``x`` and its sub-model ``g_j``.
      likelihood: ``likelihood(eta, y)``: a NumPyro program that samples the shared parameters ``gamma`` and
        observes ``y`` given the linear predictor ``eta`` of shape ``[rows]``.
      rho: the standard deviation of ``z_j | theta_j``, a positive number.
    """
    check_clients(clients)
    rho = _check_rho(rho)

    def model(y=None):
        eta = 0.0
        for c in clients:
            eta = eta + _auxiliary(c, c.scoped_submodel(c.x), rho)
        return likelihood(eta, y)

    return model


def power_likelihood_model(clients: Sequence[VFLClient], likelihood: Callable, rho: float):
    """Power-likelihood model (7); returns ``model(y=None)``.

    Client ``j``'s term ``p(y | g_j + sum_{k != j} z_k, gamma)^(1/J)`` enters as observed sites
    scoped ``"<client>/..."`` with log-density scale ``1/J``; all terms share one ``gamma``. The model needs
    ``y`` (it has no generative form).

    Args:
      clients: the :class:`~numpyro_dppvi.VFLClient` s, each with its columns ``x`` and its sub-model ``g_j``.
      likelihood: ``likelihood(eta, y)``: a NumPyro program that samples the shared parameters ``gamma`` and
        observes ``y`` given the linear predictor ``eta`` of shape ``[rows]``.
      rho: the standard deviation of ``z_j | theta_j``, a positive number.
    """
    check_clients(clients)
    rho = _check_rho(rho)
    num_clients = len(clients)

    def model(y=None):
        if y is None:
            raise ValueError(
                "the power-likelihood model is a tempered product of likelihoods and has no "
                "generative form; pass y (use augmented_model or centralised_model to simulate)"
            )
        gs, zs = [], []
        for c in clients:
            g = c.scoped_submodel(c.x)
            gs.append(g)
            zs.append(_auxiliary(c, g, rho))
        z_total = sum(zs)
        # gamma: sampled once, by a pass whose observed sites are hidden
        with handlers.trace() as shared:
            with handlers.block(hide_fn=lambda m: m["type"] == "sample" and m["is_observed"]):
                likelihood(gs[0] + z_total - zs[0], y)
        gamma = {
            k: s["value"]
            for k, s in shared.items()
            if s["type"] == "sample" and not s["is_observed"]
        }
        for j, c in enumerate(clients):
            eta_j = gs[j] + z_total - zs[j]
            with handlers.scope(prefix=c.name), scale_observed(scale=1.0 / num_clients):
                with handlers.block(hide_fn=_is_latent), handlers.substitute(data=gamma):
                    likelihood(eta_j, y)

    return model
