"""Results of a (DP-)PVI fit: posterior per site, samples, ArviZ output, prediction, history, saving.

The posterior is the mean-field Gaussian ``q(u) = N(mu, diag(s^2))`` on the flat unconstrained
vector; constrained samples are ``T(u)`` with ``T = biject_to(site.support)``.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from . import checkpoint, factors
from .evaluation import evaluate
from .model import ModelAdapter


class DPPVIResult:
    """What ``fit_dppvi`` / ``fit_global_vi`` / ``fit_bcm`` return.

    Attributes: ``state`` (the driver's state pytree), ``history`` (one dict per round: round,
    communications, participation, seconds, held-out metrics), ``privacy`` (the privacy ledger,
    ``None`` for non-private fits), ``method``, ``schedule``.
    """

    def __init__(self, adapter: ModelAdapter, state, history: list, method: str, schedule: str | None,
                 privacy=None, config: dict | None = None):
        self.adapter = adapter
        self.state = state
        self.history = history
        self.method = method
        self.schedule = schedule
        self.privacy = privacy
        self.config = dict(config or {})

    @property
    def q(self) -> factors.Gaussian:
        return self.state.q

    @property
    def posterior(self) -> dict:
        """``{site: {"loc": ..., "scale": ...}}`` of ``q`` on the unconstrained space, in site shapes."""
        loc, scale = factors.to_loc_scale(self.q)
        locs, scales = self.adapter.unflatten(loc), self.adapter.unflatten(scale)
        return {s.name: {"loc": np.asarray(locs[s.name]), "scale": np.asarray(scales[s.name])}
                for s in self.adapter.sites}

    def sample(self, num_samples: int, rng_key=None) -> dict:
        """Constrained posterior samples ``{site: [num_samples, *shape]}``."""
        rng_key = jax.random.key(1) if rng_key is None else rng_key
        loc, scale = factors.to_loc_scale(self.q)
        u = loc + scale * jax.random.normal(rng_key, (int(num_samples),) + loc.shape)
        return {k: np.asarray(v) for k, v in jax.vmap(self.adapter.constrain)(u).items()}

    def predict(self, *data, num_samples: int = 1000, rng_key=None, return_sites: Sequence[str] | None = None) -> dict:
        """Posterior predictive draws through ``numpyro.infer.Predictive``: ``{site: [num_samples, n, ...]}``.

        Pass the model's data arguments without the observations (e.g. ``predict(x_test)``).
        """
        from numpyro.infer import Predictive

        rng_key = jax.random.key(2) if rng_key is None else rng_key
        k_post, k_pred = jax.random.split(rng_key)
        samples = self.sample(num_samples, k_post)
        predictive = Predictive(self.adapter.model, posterior_samples=samples,
                                return_sites=list(return_sites) if return_sites else list(self.adapter.observed))
        return {k: np.asarray(v) for k, v in predictive(k_pred, *data).items()}

    def evaluate(self, *data, num_samples: int = 100, rng_key=None) -> dict:
        """Mean log predictive density (and accuracy for Bernoulli observations) on held-out rows."""
        arrays = self.adapter.validate_data(data, "evaluation data")
        return evaluate(self.adapter, self.q, arrays, jax.random.key(3) if rng_key is None else rng_key, num_samples)

    def to_arviz(self, num_samples: int = 1000, rng_key=None, eval_data: Sequence | None = None):
        """ArviZ data (``InferenceData``; a ``DataTree`` with ArviZ 1.x) with a ``posterior`` group (site names and shapes, one chain) and,
        given ``eval_data``, a ``log_likelihood`` group (per held-out row)."""
        from .arviz_compat import from_groups

        rng_key = jax.random.key(4) if rng_key is None else rng_key
        k_post, _ = jax.random.split(rng_key)
        samples = self.sample(num_samples, k_post)
        groups = {"posterior": {k: v[None] for k, v in samples.items()}}
        if eval_data is not None:
            arrays = self.adapter.validate_data(eval_data, "eval_data")
            loc, scale = factors.to_loc_scale(self.q)
            u = loc + scale * jax.random.normal(k_post, (int(num_samples),) + loc.shape)
            ll = jax.lax.map(lambda u_s: self.adapter.log_lik_rows(u_s, arrays), u)
            groups["log_likelihood"] = {self.adapter.observed[0]: np.asarray(ll)[None]}
        return from_groups(groups)

    def summary(self, num_samples: int = 1000, **kwargs):
        import arviz as az

        return az.summary(self.to_arviz(num_samples), **kwargs)

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the state, history, configuration and privacy ledger to ``path`` (checksummed ``.npz``)."""
        meta = {
            "kind": "DPPVIResult", "method": self.method, "schedule": self.schedule, "history": self.history,
            "config": self.config, "privacy": None if self.privacy is None else self.privacy.to_dict(),
            "data_shapes": [list(a.shape[1:]) for a in self.adapter.example_row],
            "data_dtypes": [str(a.dtype) for a in self.adapter.example_row],
        }
        checkpoint.save(path, self.state, meta)

    @classmethod
    def load(cls, path, model, template_state=None) -> "DPPVIResult":
        """Load a saved result; ``model`` is the same ``@dppvi.model`` function (code is never stored).

        The model is re-traced on zeros shaped like the data (no data rows are stored in the file).
        """
        arrays, meta = checkpoint.load(path)
        if meta.get("kind") != "DPPVIResult":
            raise ValueError(f"{path} does not hold a DPPVIResult")
        example = tuple(np.zeros((3, *shape), dtype) for shape, dtype in zip(meta["data_shapes"], meta["data_dtypes"]))
        adapter = ModelAdapter(model, example)
        if template_state is None:
            from .pvi.server import PVIState

            template_state = _state_template(arrays, PVIState)
        state = checkpoint.unflatten_like(template_state, arrays)
        privacy = None
        if meta.get("privacy") is not None:
            from .privacy import PrivacyLedger

            privacy = PrivacyLedger.from_dict(meta["privacy"])
        return cls(adapter, state, meta["history"], meta["method"], meta["schedule"], privacy, meta["config"])


def _state_template(arrays: dict, state_cls):
    """A template for a saved state whose client state is not needed (loading for analysis only)."""
    g = lambda name: factors.Gaussian(arrays[f".{name}.eta1"], arrays[f".{name}.eta2"])
    client = {k: v for k, v in arrays.items() if k.startswith(".client_state")}
    state = state_cls(q=g("q"), factors=g("factors"), server_factor=g("server_factor"), q_seen=g("q_seen"),
                      client_state=(), key=arrays[".key"], round=arrays[".round"],
                      communications=arrays[".communications"], active=arrays[".active"])
    if client:
        raise ValueError("this save holds client optimiser state: load it through the driver "
                         "(DPPVI(...).resume(path, clients)) so the state can be rebuilt")
    return state
