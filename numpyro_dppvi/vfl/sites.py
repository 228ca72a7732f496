"""A NumPyro sub-program's sites on the unconstrained space.

Both a client's sub-model ``submodel(x_j) -> g_j`` and the server's ``likelihood(eta, y)`` are
small NumPyro programs. The VFL driver needs three things from them:

* the static layout of their latent ``numpyro.sample`` sites (name, shape, bijection
  ``T = biject_to(support)``) and of their ``numpyro.param`` sites (point parameters, e.g. the
  weights of a split-NN client network), found by tracing the program once;
* the log density with the latent values given on the unconstrained space ``u``:
  ``log p(T(u)) + log|det dT/du|`` (prior part) and ``sum log p(obs | ...)`` (observed part, kept
  separate so that it can be scaled for mini-batches or tempered by ``1/J``);
* the program's return value (a client's contribution ``g_j``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to


@dataclass(frozen=True)
class LatentSite:
    """Static description of one latent sample site."""

    name: str
    shape: tuple
    transform: Any  # T: unconstrained -> support


@dataclass(frozen=True)
class ParamSite:
    """Static description of one ``numpyro.param`` site, optimised as a point estimate."""

    name: str
    init: Any  # constrained initial value
    transform: Any


@dataclass(frozen=True)
class ProgramLayout:
    """Latent, param and observed sites of a traced sub-program."""

    latent: tuple[LatentSite, ...]
    params: tuple[ParamSite, ...]
    observed: tuple[str, ...]

    def init_unconstrained_params(self) -> dict:
        return {p.name: p.transform.inv(jnp.asarray(p.init)) for p in self.params}

    def constrain_latent(self, u: dict) -> dict:
        return {s.name: s.transform(u[s.name]) for s in self.latent}

    def constrain_params(self, v: dict) -> dict:
        return {p.name: p.transform(v[p.name]) for p in self.params}


def trace_layout(fn: Callable, args: tuple, rng_key, *, what: str) -> ProgramLayout:
    """Trace ``fn(*args)`` once and return its site layout.

    ``what`` names the program in error messages. Discrete latent sites are rejected: VFL
    inference here is reparameterised VI on continuous latents.
    """
    trace = handlers.trace(handlers.seed(fn, rng_key)).get_trace(*args)
    latent, params, observed = [], [], []
    for name, site in trace.items():
        if site["type"] == "sample":
            if site["is_observed"]:
                observed.append(name)
                continue
            support = site["fn"].support
            if support.is_discrete:
                raise ValueError(
                    f"{what}: latent site {name!r} is discrete; VFL inference needs continuous "
                    "latent sites. Marginalise it out or make it observed."
                )
            latent.append(LatentSite(name, tuple(jnp.shape(site["value"])), biject_to(support)))
        elif site["type"] == "param":
            constraint = site["kwargs"].get("constraint", constraints.real)
            params.append(ParamSite(name, site["value"], biject_to(constraint)))
    return ProgramLayout(tuple(latent), tuple(params), tuple(observed))


def run_program(fn: Callable, args: tuple, layout: ProgramLayout, u: dict, v: dict):
    """Run ``fn(*args)`` at unconstrained latents ``u`` and unconstrained params ``v``.

    Returns ``(log_prior, log_lik, value)`` where
    ``log_prior = sum_s log p_s(T_s(u_s)) + log|det J_{T_s}(u_s)|`` over latent sites,
    ``log_lik = sum`` of observed sites' log-probabilities (each times its handler scale) and
    ``value`` is the program's return value.
    """
    constrained = layout.constrain_latent(u)
    data = {**constrained, **layout.constrain_params(v)}
    with handlers.trace() as trace, handlers.substitute(data=data):
        value = fn(*args)
    log_prior = jnp.zeros(())
    log_lik = jnp.zeros(())
    for name, site in trace.items():
        if site["type"] != "sample":
            continue
        lp = jnp.sum(site["fn"].log_prob(site["value"]))
        if site.get("scale") is not None:
            lp = lp * site["scale"]
        if site["is_observed"]:
            log_lik = log_lik + lp
        else:
            log_prior = log_prior + lp
    for s in layout.latent:
        log_prior = log_prior + jnp.sum(
            s.transform.log_abs_det_jacobian(u[s.name], constrained[s.name])
        )
    return log_prior, log_lik, value


def unconstrained_zeros_like(layout: ProgramLayout) -> dict:
    """Unconstrained arrays of each latent site's shape, filled with zeros."""
    return {s.name: jnp.zeros(s.transform.inverse_shape(s.shape)) for s in layout.latent}


def tree_size(tree) -> int:
    """Number of scalars in a pytree of arrays."""
    return int(sum(jnp.size(leaf) for leaf in jax.tree_util.tree_leaves(tree)))


def log_lik_rows(fn: Callable, args: tuple, layout: ProgramLayout, u: dict, v: dict):
    """Per-row log-likelihood of ``fn(*args)``: observed sites' log-probabilities, not summed.

    Every observed site must carry the row on its leading axis (e.g. sampled inside a plate over
    rows); the rows' terms of several observed sites are added.
    """
    data = {**layout.constrain_latent(u), **layout.constrain_params(v)}
    with handlers.trace() as trace, handlers.substitute(data=data):
        fn(*args)
    total = None
    for name, site in trace.items():
        if site["type"] == "sample" and site["is_observed"]:
            lp = site["fn"].log_prob(site["value"])
            if jnp.ndim(lp) == 0:
                raise ValueError(
                    f"observed site {name!r} has no row axis; sample it inside "
                    "numpyro.plate(..., eta.shape[0]) for per-row predictive densities"
                )
            lp = jnp.reshape(lp, (lp.shape[0], -1)).sum(-1)
            total = lp if total is None else total + lp
    return total
