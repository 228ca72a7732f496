"""Variational families of the VFL driver (Hassan et al., §4.1-4.2).

Client ``j`` owns ``q_phi_j(theta_j) q_psi_j(z_j | theta_j)``:

* ``q_phi_j(theta_j)``: Gaussian with diagonal covariance on the unconstrained space,
  ``u_j = mu_j + exp(log_s_j) * eps_j`` (eq. 8 with a diagonal ``Sigma``). The client's
  ``numpyro.param`` sites (e.g. split-NN weights) are point parameters optimised with it.
* mean-field (§4.2, eq. 10): ``z_ij = m_ij + exp(log_s_ij) * tau_ij``, two numbers per row;
* amortised (§4.1, eq. 9): ``z_ij = g_ij + a_psi(f_ij) + sigma_psi(f_ij) * tau_ij`` where
  ``g_ij = g_j(x_ij, theta_j)`` and the features ``f_ij`` are ``g_ij`` (augmented model) or
  ``(g_ij, standardised y_i)`` (power model, where ``y`` is shared). ``(a, log sigma)`` is a
  one-hidden-layer ``tanh`` network with ``psi`` of fixed size: it does not grow with ``n`` and
  works on any mini-batch of rows.

The server owns ``q(gamma)``, Gaussian with diagonal covariance on the unconstrained space of the
likelihood's shared latent sites.

Log-densities of ``q`` are returned in the "sticking-the-landing" form of eq. (4): the variational
parameters inside the density are wrapped in ``stop_gradient`` while the sample path keeps them,
which drops the score term and leaves an unbiased, lower-variance gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.scipy.stats import norm

from .sites import ProgramLayout, unconstrained_zeros_like

GUIDES = ("mean_field", "amortised")
#: Spellings accepted for a guide (American spelling of the earlier releases).
GUIDE_ALIASES = {"amortized": "amortised"}


def _sg(tree, stl: bool):
    return jax.lax.stop_gradient(tree) if stl else tree


def _normal_logpdf_sum(value, loc, log_scale):
    return jnp.sum(norm.logpdf(value, loc, jnp.exp(log_scale)))


@dataclass(frozen=True)
class DiagonalGaussian:
    """``q(u) = N(loc, diag(exp(log_scale))^2)`` over a dict of unconstrained site arrays."""

    layout: ProgramLayout
    init_scale: float = 0.1

    def init(self) -> dict:
        zeros = unconstrained_zeros_like(self.layout)
        return {
            "loc": zeros,
            "log_scale": jax.tree_util.tree_map(
                lambda a: jnp.full_like(a, jnp.log(self.init_scale)), zeros
            ),
        }

    def noise_like(self, key) -> dict:
        zeros = unconstrained_zeros_like(self.layout)
        names = sorted(zeros)
        keys = jax.random.split(key, max(len(names), 1))
        return {k: jax.random.normal(kk, zeros[k].shape) for k, kk in zip(names, keys)}

    def sample(self, params: dict, eps: dict, stl: bool = True):
        """``u = loc + exp(log_scale) * eps`` and ``log q(u)`` (STL form when ``stl``)."""
        u = {
            k: params["loc"][k] + jnp.exp(params["log_scale"][k]) * eps[k] for k in params["loc"]
        }
        dens = _sg(params, stl)
        log_q = sum(
            (_normal_logpdf_sum(u[k], dens["loc"][k], dens["log_scale"][k]) for k in u),
            jnp.zeros(()),
        )
        return u, log_q


@dataclass(frozen=True)
class MeanFieldAux:
    """``q(z_j) = prod_i N(z_ij | m_ij, s_ij^2)`` (eq. 10); parameters grow with ``n``."""

    num_rows: int
    init_scale: float

    def init(self, key, g_init) -> dict:
        del key
        return {
            "loc": jnp.asarray(g_init, jnp.float32),
            "log_scale": jnp.full((self.num_rows,), jnp.log(self.init_scale), jnp.float32),
        }

    def sample(self, params, index, g, y_feature, tau, stl: bool = True):
        del g, y_feature
        loc, log_scale = params["loc"][index], params["log_scale"][index]
        z = loc + jnp.exp(log_scale) * tau
        dens = _sg((loc, log_scale), stl)
        return z, _normal_logpdf_sum(z, dens[0], dens[1])


@dataclass(frozen=True)
class AmortizedAux:
    """``q_psi(z_ij | theta_j) = N(g_ij + a_psi(f_ij), sigma_psi(f_ij)^2)`` (eq. 9).

    ``psi = (W1 [d, H], b1 [H], W2 [H, 2], b2 [2])``, ``h = tanh(f W1 + b1)``,
    ``(a, log sigma) = h W2 + b2``. ``d = 1`` (feature ``g``) or ``2`` (``g`` and ``y``).
    """

    uses_y: bool
    hidden: int
    init_scale: float

    def init(self, key, g_init) -> dict:
        del g_init
        d = 2 if self.uses_y else 1
        k1, k2 = jax.random.split(key)
        return {
            "W1": jax.random.normal(k1, (d, self.hidden)) / jnp.sqrt(d),
            "b1": jnp.zeros((self.hidden,)),
            "W2": 0.01 * jax.random.normal(k2, (self.hidden, 2)) / jnp.sqrt(self.hidden),
            "b2": jnp.array([0.0, jnp.log(self.init_scale)]),
        }

    def _outputs(self, psi, g, y_feature):
        f = g[:, None] if not self.uses_y else jnp.stack([g, y_feature], axis=-1)
        h = jnp.tanh(f @ psi["W1"] + psi["b1"])
        out = h @ psi["W2"] + psi["b2"]
        return g + out[:, 0], out[:, 1]

    def sample(self, params, index, g, y_feature, tau, stl: bool = True):
        del index
        loc, log_scale = self._outputs(params, g, y_feature)
        z = loc + jnp.exp(log_scale) * tau
        d_loc, d_log_scale = self._outputs(_sg(params, stl), g, y_feature)
        return z, _normal_logpdf_sum(z, d_loc, d_log_scale)


def make_aux_guide(kind: str, *, num_rows: int, rho: float, uses_y: bool, hidden: int = 16,
                   init_scale: float = 0.1):
    """The ``q(z_j | .)`` family named ``kind`` ("mean_field" or "amortised").

    The initial standard deviation of ``z`` is ``init_scale * rho``.
    """
    if kind == "mean_field":
        return MeanFieldAux(num_rows, init_scale * rho)
    if GUIDE_ALIASES.get(kind, kind) == "amortised":
        return AmortizedAux(uses_y, hidden, init_scale * rho)
    raise ValueError(f"guide must be one of {GUIDES}, got {kind!r}")
