"""``VIPSResult``: the fitted variational posterior of a conjugate model, its history and ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

_FORMAT = "numpyro_dppvi.VIPSResult/1"


@dataclass
class VIPSResult:
    """Output of :func:`numpyro_dppvi.fit_vips`.

    Attributes:
        model: the :class:`~numpyro_dppvi.vips.engine.ConjugateModel` that was fitted.
        params: final global variational parameters (natural parameters and, where the model
            has them, hyperparameter posteriors); ``model.expected_natural_params(params)``
            gives ``n̄`` (Eq. 19).
        history: per-iteration arrays: ``rho`` (step size), ``batch_size`` (records in the
            batch), ``num_clipped`` (records with a clipped ESS block; 0 without privacy).
        privacy: the :class:`~numpyro_dppvi.privacy.PrivacyLedger` of the fit (one client), or
            ``None`` for a non-private fit.
        noise_multiplier: noise std / joint clip norm actually used (``None`` without privacy).
        numpyro_model: the NumPyro model the conjugate model was detected from, if any.
        site_map: for a detected model, how posterior draws map to the model's sites:
            a function ``samples_of_conjugate_model -> {site: draws}``.
    """

    model: Any
    params: Any
    history: dict
    privacy: Any = None
    noise_multiplier: float | None = None
    numpyro_model: Callable | None = None
    site_map: Callable | None = None
    info: dict = field(default_factory=dict)

    @property
    def epsilon(self) -> float | None:
        """Total epsilon at the ledger's delta (``None`` for a non-private fit)."""
        return None if self.privacy is None else float(self.privacy.epsilon)

    def expected_natural_params(self):
        return self.model.expected_natural_params(self.params)

    def posterior_samples(self, num_samples: int = 1000, rng_key=None) -> dict:
        """Draws from ``q``: ``{name: array [num_samples, ...]}``; site names for a detected model."""
        if rng_key is None:
            rng_key = jax.random.key(0)
        samples = self.model.sample_posterior(self.params, rng_key, int(num_samples))
        if self.site_map is not None:
            samples = self.site_map(samples)
        return {name: np.asarray(value) for name, value in samples.items()}

    def to_arviz(self, num_samples: int = 1000, rng_key=None):
        """ArviZ ``InferenceData`` with a ``posterior`` group (one chain of ``num_samples`` draws)."""
        from numpyro_dppvi.arviz_compat import from_groups

        samples = self.posterior_samples(num_samples, rng_key)
        return from_groups({"posterior": {name: value[None] for name, value in samples.items()}})

    def summary(self, num_samples: int = 1000, rng_key=None, **kwargs):
        import arviz as az

        return az.summary(self.to_arviz(num_samples, rng_key), kind="stats", **kwargs)

    def save(self, path) -> None:
        """Write the fit (model, parameters, history, ledger) to ``path`` (a pickle file).

        The NumPyro model of a detected fit is stored by reference (importable module-level
        functions only); pass it again to :meth:`load` if it cannot be pickled.
        """
        import pickle

        state = {"format": _FORMAT, "model": self.model,
                 "params": jax.tree_util.tree_map(np.asarray, self.params),
                 "history": self.history, "privacy": None if self.privacy is None else self.privacy.to_dict(),
                 "noise_multiplier": self.noise_multiplier, "site_map": self.site_map, "info": self.info}
        try:
            numpyro_model = pickle.dumps(self.numpyro_model)
        except (pickle.PicklingError, AttributeError, TypeError):
            numpyro_model = None
        state["numpyro_model"] = numpyro_model
        with open(path, "wb") as handle:
            pickle.dump(state, handle)

    @classmethod
    def load(cls, path, numpyro_model=None) -> "VIPSResult":
        """Read a fit written by :meth:`save` (the ledger is restored exactly)."""
        import pickle

        from numpyro_dppvi.privacy import PrivacyLedger

        with open(path, "rb") as handle:
            state = pickle.load(handle)
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a saved VIPSResult.")
        if numpyro_model is None and state["numpyro_model"] is not None:
            numpyro_model = pickle.loads(state["numpyro_model"])
        ledger = None if state["privacy"] is None else PrivacyLedger.from_dict(state["privacy"])
        return cls(model=state["model"], params=jax.tree_util.tree_map(jax.numpy.asarray, state["params"]),
                   history=state["history"], privacy=ledger, noise_multiplier=state["noise_multiplier"],
                   numpyro_model=numpyro_model, site_map=state["site_map"], info=state["info"])

    def predict(self, *inputs, num_samples: int = 500, rng_key=None, **kwargs):
        """Posterior predictive.

        For a detected NumPyro model: ``numpyro.infer.Predictive`` with ``num_samples`` draws
        from ``q``, called as ``model(*inputs, **kwargs)``; returns ``{site: draws}``.
        For a model class: its own predictive (``predict_proba`` for classifiers,
        ``predict_mean`` for regressions, ``predict`` otherwise) at the inputs.
        """
        if self.numpyro_model is not None:
            from numpyro.infer import Predictive

            if rng_key is None:
                rng_key = jax.random.key(1)
            key_q, key_pred = jax.random.split(rng_key)
            samples = self.posterior_samples(num_samples, key_q)
            predictive = Predictive(self.numpyro_model, posterior_samples=samples)
            return {k: np.asarray(v) for k, v in predictive(key_pred, *inputs, **kwargs).items()}
        for method in ("predict_proba", "predict_mean", "predict"):
            if hasattr(self.model, method):
                return getattr(self.model, method)(self.params, *inputs, **kwargs)
        raise TypeError(f"{type(self.model).__name__} defines no predictive "
                        "(predict_proba / predict_mean / predict).")
