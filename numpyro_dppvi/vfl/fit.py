"""``fit_vfl``: wire clients, server, guides and the SFVI protocol together."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..keys import resolve as resolve_key
from ..program_cache import cached, jit, shapes
from .client import VFLClient, check_clients
from .guides import GUIDE_ALIASES, GUIDES, DiagonalGaussian
from .models import _check_rho
from .parties import FORMULATIONS, ServerParty, make_client_party, standardised_response
from .protocol import Channel, make_step
from .results import VFLResult
from .sites import trace_layout


def fit_vfl(
    clients: Sequence[VFLClient],
    y,
    likelihood: Callable,
    *,
    formulation: str = "augmented",
    guide: str = "mean_field",
    rho: float = 1.0,
    steps: int = 1000,
    optimizer: optax.GradientTransformation | None = None,
    num_samples: int = 1,
    rng_key=None,
    batch_size: int | None = None,
    amortised_hidden: int = 16,
    init_scale: float = 0.1,
    stl: bool = True,
    amortized_hidden: int | None = None,
) -> VFLResult:
    """Fit a vertical federated model by SFVI (Hassan et al., Algorithm 1 or 2).

    Args:
        clients: the :class:`VFLClient` s, each with its own columns and sub-model.
        y: the response, held by the server (``"augmented"``, ``"split"``) or shared with the
            clients (``"power"``). It may be a tuple of row arrays (e.g. ``(counts, log_offset)``)
            when the likelihood needs more server-held row data; ``likelihood`` then receives
            the rows of each (the first array is taken as the response by the amortised guide).
        likelihood: ``likelihood(eta, y)``: a NumPyro program that samples the shared parameters
            ``gamma`` (e.g. an intercept, a noise scale) and observes ``y`` given the linear
            predictor ``eta`` of shape ``[rows]``.
        formulation: ``"augmented"`` (eq. 6, Algorithm 1), ``"power"`` (eq. 7, Algorithm 2) or
            ``"split"`` (split NN: deterministic clients, ``z_j = g_j``, same messages as
            Algorithm 1).
        guide: ``"mean_field"`` (eq. 10) or ``"amortised"`` (eq. 9; ``"amortized"`` is accepted) for
            ``q(z_j | .)``.
        rho: standard deviation of ``z_j | theta_j`` (ignored by ``"split"``).
        steps: protocol iterations.
        optimizer: an optax transformation used by every party (default ``adam(1e-2)``).
        num_samples: Monte Carlo draws per iteration.
        rng_key: a ``jax.random`` key (default: a fresh key from the operating system).
        batch_size: rows per iteration (sampled without replacement by the server and sent to
            the clients as a row index); ``None`` uses all rows.
        amortised_hidden: width of the amortised network's hidden layer.
        amortized_hidden: the same as ``amortised_hidden`` (American spelling); when given it takes
            precedence.
        init_scale: initial std of ``q(theta)`` (and ``init_scale * rho`` for ``q(z)``).
        stl: use the sticking-the-landing gradient estimator (eq. 4).

    Returns:
        :class:`VFLResult` with the fitted parameters, ELBO trace and message history.
    """
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    guide = GUIDE_ALIASES.get(guide, guide)
    if guide not in GUIDES:
        raise ValueError(f"fit_vfl: guide must be one of {GUIDES}, got {guide!r}")
    amortised_hidden = amortised_hidden if amortized_hidden is None else amortized_hidden
    if y is None:
        raise ValueError("y is required: the server (or, for 'power', every client) holds it")
    n = check_clients(clients, y)
    rho = _check_rho(rho) if formulation != "split" else 1.0
    if not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    if batch_size is not None and (
        not isinstance(batch_size, (int, np.integer)) or not 1 <= batch_size <= n
    ):
        raise ValueError(f"batch_size must be None or an integer in [1, {n}], got {batch_size!r}")
    if batch_size == n:
        batch_size = None
    if optimizer is None:
        optimizer = optax.adam(1e-2)
    if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
        raise TypeError("optimizer must be an optax GradientTransformation, e.g. optax.adam(1e-2)")
    rng_key = jax.random.wrap_key_data(resolve_key(rng_key)[0])
    k_trace, k_init, k_run = jax.random.split(rng_key, 3)

    y = jax.tree_util.tree_map(jnp.asarray, y)
    parties, server = build_parties(clients, y, likelihood, formulation=formulation, guide=guide, rho=rho,
                                    amortised_hidden=amortised_hidden, init_scale=init_scale, stl=stl,
                                    rng_key=k_trace)
    init, _, _ = make_step(parties, server, optimizer, formulation=formulation,
                           num_samples=num_samples, batch_size=batch_size, num_rows=n)
    state = init(k_init)
    signature = (
        formulation, guide, rho, num_samples, batch_size, amortised_hidden, init_scale, stl,
        likelihood, shapes(y), tuple((c.name, c.submodel, shapes(c.x)) for c in clients),
    )
    run, recorder = cached(
        ("fit",) + signature + (optimizer,),
        lambda: _compile_run(parties, server, optimizer, formulation, num_samples, batch_size, n),
    )
    state, elbo = run([c.x for c in clients], y, state, jax.random.split(k_run, steps))
    return VFLResult(
        clients=list(clients), likelihood=likelihood, formulation=formulation, guide=guide,
        rho=rho, parties=parties, server=server, state=state, elbo=np.asarray(elbo),
        messages=recorder.messages, steps=steps, signature=signature,
        settings=dict(num_samples=int(num_samples), batch_size=batch_size, amortised_hidden=int(amortised_hidden),
                      init_scale=float(init_scale), stl=bool(stl)),
    )


def build_parties(clients, y, likelihood, *, formulation, guide, rho, amortised_hidden, init_scale, stl, rng_key):
    """Trace the likelihood and every client's sub-model; the server's and the clients' parties."""
    n = check_clients(clients, y)
    server_layout = trace_layout(likelihood, (jnp.zeros((n,)), y), rng_key, what="likelihood")
    if not server_layout.observed:
        raise ValueError(
            "likelihood(eta, y) observes nothing: it must contain numpyro.sample(..., obs=y)"
        )
    if server_layout.params:
        raise ValueError(
            "likelihood(eta, y) has numpyro.param sites "
            f"{[p.name for p in server_layout.params]}; give shared parameters a prior instead"
        )
    server = ServerParty(likelihood, server_layout, DiagonalGaussian(server_layout, init_scale),
                         y, n, stl)
    parties = [
        make_client_party(
            c, position=j, formulation=formulation, guide=guide, rho=rho, y=y,
            likelihood=likelihood, server_layout=server_layout, num_clients=len(clients),
            rng_key=rng_key, hidden=amortised_hidden, init_scale=init_scale, stl=stl,
        )
        for j, c in enumerate(clients)
    ]
    return parties, server


def _with_data(parties, server, xs, y):
    """The parties of a compiled program, holding the program's data arguments."""
    def client(p, x):
        shared = p.y is not None
        return dataclasses.replace(
            p, client=p.client.with_x(x), y=y if shared else None,
            y_feature=standardised_response(y) if shared else None,
        )

    return [client(p, x) for p, x in zip(parties, xs)], dataclasses.replace(server, y=y)


def _compile_run(parties, server, optimizer, formulation, num_samples, batch_size, n):
    """``run(xs, y, state, keys) -> (state, elbo trace)``, jitted, plus the message recorder."""
    recorder = Channel()

    def run(xs, y, state, keys):
        ps, sv = _with_data(parties, server, xs, y)
        _, step, _ = make_step(ps, sv, optimizer, formulation=formulation,
                               num_samples=num_samples, batch_size=batch_size, num_rows=n)
        if not recorder.messages:
            jax.eval_shape(lambda s, k: step(s, k, recorder), state, keys[0])
        return jax.lax.scan(lambda s, k: step(s, k, Channel()), state, keys)

    return jit(run), recorder
