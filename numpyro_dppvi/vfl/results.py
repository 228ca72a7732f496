"""``VFLResult``: the fitted variational posterior of a VFL model, its ELBO trace and messages."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from numpyro.infer import Predictive

from .. import checkpoint
from ..arviz_compat import from_groups
from ..program_cache import cached, jit, shapes
from ..privacy.ledger import NotPrivate
from ..results import Result, load, resolve_key
from .client import check_clients
from .models import AUX_SITE, augmented_model, centralised_model
from .sites import log_lik_rows, run_program


@dataclass
class VFLResult(Result):
    """What :func:`fit_vfl` returns (the :class:`~numpyro_dppvi.results.Result` protocol).

    :func:`fit_vfl` and :meth:`load` build it; its fields are the fit's inputs and outputs.

    Attributes:
        clients: the :class:`~numpyro_dppvi.VFLClient` s of the fit (names, columns, sub-models).
        likelihood: the likelihood program ``likelihood(eta, y)`` of the fit.
        formulation: ``"augmented"``, ``"power"`` or ``"split"`` (see :func:`fit_vfl`).
        guide: ``"mean_field"`` or ``"amortised"``: the guide of ``q(z_j | .)``.
        rho: the standard deviation of ``z_j | theta_j`` (1 for ``"split"``).
        parties: one :class:`~numpyro_dppvi.vfl.parties.ClientParty` per client, with its traced sub-model
            and guide.
        server: the :class:`~numpyro_dppvi.vfl.parties.ServerParty`, holding ``y``, the likelihood and the
            guide of the shared parameters ``gamma``.
        state: the parties' final variational parameters (and, after a fit, optimiser states).
        elbo: per-iteration Monte Carlo ELBO estimates, shape ``[steps]``.
        messages: the :class:`~numpyro_dppvi.vfl.Message` s of one iteration, in order (empty for a loaded
            result, whose ``communication`` keeps the log).
        steps: the protocol iterations run.
        signature: the fit's static structure (settings, likelihood, shapes, sub-models), under which its
            compiled programs are reused; None for a loaded result. Default None.
        settings: the fit's remaining settings (``num_samples``, ``batch_size``, ``amortised_hidden``,
            ``init_scale``, ``stl``), saved with the result. Default ``{}``.
        communication: the message log: the messages of one iteration (sender, receiver, kind,
            shape, size), their totals over the fit and per party. None (the default): computed from
            ``messages`` and ``steps``.
        history: one dict per step: ``{"step", "elbo"}`` (computed, not an argument).
        privacy: :class:`~numpyro_dppvi.privacy.NotPrivate` (vertical fits add no noise; not an argument).
    """

    kind = "VFLResult"

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
    signature: tuple | None = None  # static structure, for reusing compiled programs
    settings: dict = field(default_factory=dict)  # the fit's remaining settings (for saving)
    communication: dict | None = None
    history: list = field(init=False)
    privacy: Any = field(init=False)

    def __post_init__(self):
        if self.communication is None:
            sent, received = Counter(), Counter()
            for m in self.messages:
                sent[m.sender] += m.size * self.steps
                received[m.receiver] += m.size * self.steps
            self.communication = {
                "iterations": self.steps,
                "messages_per_iteration": [m.to_dict() for m in self.messages],
                "num_messages": len(self.messages) * self.steps,
                "num_scalars": sum(m.size for m in self.messages) * self.steps,
                "scalars_sent": dict(sent),
                "scalars_received": dict(received),
            }
        self.history = [{"step": t + 1, "elbo": float(e)} for t, e in enumerate(np.asarray(self.elbo))]
        self.privacy = NotPrivate("vertical federated fits (fit_vfl) add no noise")

    # ----- the Result protocol ---------------------------------------------------------------
    def sample(self, num_samples: int = 1000, rng_key=None) -> dict:
        """Posterior draws of the latent sites, keyed by the sub-models' and the likelihood's own site
        names (a name two clients share keeps its ``"<client>/"`` scope to stay unique)."""
        draws = self.sample_posterior(rng_key, num_samples)
        bare = [k.split("/", 1)[-1] for k in draws]
        return {(b if bare.count(b) == 1 else k): v for k, b, (k, v) in zip(bare, bare, draws.items())}

    def pointwise_log_likelihood(self, x_new, y_new, num_samples: int = 100, rng_key=None,
                                 model: str | None = None) -> np.ndarray:
        """``log p(y_i | x_i, draw s)`` for new rows, ``[num_samples, n]`` (see
        :meth:`log_predictive_density`)."""
        return np.asarray(self._pointwise(x_new, y_new, resolve_key(rng_key),
                                          num_samples, model))

    observed_name = "y"

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
        rng_key = resolve_key(rng_key)
        cache = self.__dict__.setdefault("_samplers", {})
        if num_samples not in cache:  # one program per draw count; z is dropped when not asked
            cache[num_samples] = jit(lambda state, key: self._draw(state, key, num_samples))
        draws = cache[num_samples](self.state, rng_key)
        aux = {f"{p.name}/{AUX_SITE}" for p in self.parties}
        return {k: np.asarray(v) for k, v in draws.items() if include_aux or k not in aux}

    def _draw(self, state, rng_key, num_samples):
        k_server, *k_clients = jax.random.split(rng_key, len(self.parties) + 1)
        out = {}
        gamma = jax.vmap(lambda k: self.server.sample_gamma(state["server"], k)[0])(
            jax.random.split(k_server, num_samples)
        )
        out.update(self.server.layout.constrain_latent(gamma))  # transforms broadcast over draws
        for party, p, k in zip(self.parties, state["clients"], k_clients):
            index = jnp.arange(party.num_rows)
            keys = jax.random.split(k, num_samples)
            u, z, _ = jax.vmap(lambda kk: party.draw(p, kk, index))(keys)
            out.update(party.layout.constrain_latent(u))
            if party.aux_guide is not None:
                out[f"{party.name}/{AUX_SITE}"] = z
        return out

    def to_arviz(self, num_samples: int = 1000, rng_key=None, eval_data=None, include_aux: bool = False,
                 num_chains: int = 4):
        """ArviZ data as :meth:`numpyro_dppvi.Result.to_arviz` (independent draws in ``num_chains`` chains) of
        the latent sites (``include_aux``: the training rows' auxiliary ``z_j`` too, in one chain) and, given
        ``eval_data=(x_new, y_new)``, ``log_likelihood`` and ``observed_data``."""
        if not include_aux:
            return super().to_arviz(num_samples, rng_key, eval_data, num_chains)
        draws = self.sample_posterior(rng_key, num_samples, include_aux)
        return from_groups({"posterior": {k: v[None] for k, v in draws.items()}})

    def observed_values(self, eval_data) -> dict:
        """``{"y": y_new}`` of ``eval_data=(x_new, y_new)``."""
        return {self.observed_name: np.asarray(eval_data[-1])}

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
        rng_key = resolve_key(rng_key)
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
        """Per-row ``log p(y_i | x_i, data) ~= log mean_s p(y_i | draw s)`` for new rows.

        Draw ``s``: ``theta, gamma ~ q``; ``g_j`` on the new rows; ``eta = sum_j z_j`` with new
        ``z_j ~ N(g_j, rho)`` (``model="augmented"``, the default after an augmented fit) or
        ``eta = sum_j g_j`` (``"centralised"``). One compiled program, reused across results
        with the same structure (e.g. the folds of a cross-validation).
        """
        rng_key = resolve_key(rng_key)
        per_draw = self._pointwise(x_new, y_new, rng_key, num_samples, model)
        return np.asarray(logsumexp(per_draw, axis=0) - jnp.log(num_samples))

    def _pointwise(self, x_new, y_new, rng_key, num_samples, model):
        model = model or ("augmented" if self.formulation == "augmented" else "centralised")
        if model not in ("augmented", "centralised"):
            raise ValueError(f"model must be 'augmented' or 'centralised', got {model!r}")
        xs = [c.x for c in self._new_clients(x_new)]
        check_clients(self._new_clients(x_new), y_new)
        y_new = jax.tree_util.tree_map(jnp.asarray, y_new)
        build = lambda: jit(functools.partial(  # noqa: E731
            _log_predictive_density, self.parties, self.server, self.rho, model, num_samples))
        key = None if self.signature is None else (
            "lpd", self.signature, model, num_samples, shapes(xs), shapes(y_new))
        program = build() if key is None else cached(key, build)
        return program(xs, y_new, self.state, rng_key)

    # ----- saving ----------------------------------------------------------------------------
    def save(self, path, hmac_key: bytes | None = None) -> None:
        """Write the variational parameters, the ELBO trace, the message log and the settings to
        ``path`` (``.npz`` + JSON, no pickle; no data rows). Load with
        ``numpyro_dppvi.load(path, (clients, likelihood))``."""
        leaves = jax.tree_util.tree_leaves(self.server.y)
        meta = {"kind": self.kind, "format": _FORMAT, "formulation": self.formulation, "guide": self.guide,
                "rho": self.rho, "steps": self.steps, "settings": self.settings,
                "clients": [c.name for c in self.clients], "num_rows": int(self.server.num_rows),
                "y": {"tuple": isinstance(self.server.y, tuple),
                      "shapes": [list(np.shape(a)) for a in leaves], "dtypes": [str(np.asarray(a).dtype) for a in leaves]},
                "communication": self.communication}
        params = {"clients": self.state["clients"], "server": self.state["server"]}
        checkpoint.save(path, {"params": params, "elbo": np.asarray(self.elbo)}, meta, hmac_key=hmac_key)

    @classmethod
    def load(cls, path, clients, likelihood, hmac_key: bytes | None = None) -> "VFLResult":
        """Load a saved VFL fit: ``clients`` are the same ``VFLClient`` s (their sub-models; their
        columns ``x`` may be any rows of the right shape, e.g. new ones) and ``likelihood`` the same
        likelihood function (code is never stored)."""
        return load(path, (clients, likelihood), hmac_key)

    @classmethod
    def from_saved(cls, arrays, meta, model, path="the file") -> "VFLResult":
        from .fit import build_parties  # a cycle: fit builds and returns results; results rebuilds parties

        if meta.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a saved VFLResult (format {_FORMAT})")
        if not (isinstance(model, tuple) and len(model) == 2):
            raise TypeError(f"loading the VFL fit {path} needs model=(clients, likelihood): the VFLClient s "
                            "(names and sub-models) and the likelihood function")
        clients, likelihood = model
        if [c.name for c in clients] != meta["clients"]:
            raise ValueError(f"{path} was fitted with clients {meta['clients']}, got {[c.name for c in clients]}")
        n = meta["num_rows"]
        clients = [c.with_x(jax.tree_util.tree_map(lambda a: jnp.zeros((n,) + np.shape(a)[1:], np.asarray(a).dtype),
                                                     c.x)) for c in clients]
        ys = [jnp.zeros(shape, dtype) for shape, dtype in zip(meta["y"]["shapes"], meta["y"]["dtypes"])]
        y = tuple(ys) if meta["y"]["tuple"] else ys[0]
        settings = meta["settings"]
        parties, server = build_parties(clients, y, likelihood, formulation=meta["formulation"], guide=meta["guide"],
                                        rho=meta["rho"], amortised_hidden=settings["amortised_hidden"],
                                        init_scale=settings["init_scale"], stl=settings["stl"],
                                        rng_key=jax.random.key(0))
        template = {"clients": [p.init(jax.random.key(0)) for p in parties], "server": server.init()}
        saved = checkpoint.unflatten_like({"params": template, "elbo": np.zeros(meta["steps"], np.float32)}, arrays)
        return cls(clients=clients, likelihood=likelihood, formulation=meta["formulation"], guide=meta["guide"],
                   rho=meta["rho"], parties=parties, server=server, state=saved["params"], elbo=saved["elbo"],
                   messages=[], steps=meta["steps"], settings=settings, communication=meta["communication"])


_FORMAT = "numpyro_dppvi.VFLResult/1"


def _log_predictive_density(parties, server, rho, model, num_samples, xs, y, state, rng_key):
    def one_draw(key):
        k_server, *k_clients = jax.random.split(key, len(parties) + 1)
        gamma_u, _ = server.sample_gamma(state["server"], k_server)
        eta = 0.0
        for party, params, x, k in zip(parties, state["clients"], xs, k_clients):
            k_theta, k_z = jax.random.split(k)
            guide = party.theta_guide
            u, _ = guide.sample(params["theta"], guide.noise_like(k_theta))
            _, _, g = run_program(party.client.scoped_submodel, (x,), party.layout, u,
                                  params["point"])
            if model == "augmented":
                g = g + rho * jax.random.normal(k_z, g.shape)
            eta = eta + g
        return log_lik_rows(server.likelihood, (eta, y), server.layout, gamma_u, {})

    return jax.vmap(one_draw)(jax.random.split(rng_key, num_samples))  # [S, n]
