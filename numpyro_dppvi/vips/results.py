"""``VIPSResult``: the fitted variational posterior of a conjugate model, its history and ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

_FORMAT = "numpyro_dppvi.VIPSResult/2"


def _jsonable(value):
    """History / info values in JSON types (arrays become lists)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    array = np.asarray(value)
    return array.tolist() if array.ndim else array.item()


def _arrays_back(history):
    if isinstance(history, dict):
        return {k: np.asarray(v) if isinstance(v, list) and k != "rounds" else v for k, v in history.items()}
    return history


@dataclass
class VIPSResult:
    """Output of :func:`numpyro_dppvi.fit_vips`.

    Attributes:
        model: the :class:`~numpyro_dppvi.vips.engine.ConjugateModel` that was fitted.
        params: final global variational parameters (natural parameters and, where the model
            has them, hyperparameter posteriors); ``model.expected_natural_params(params)``
            gives ``n̄`` (Eq. 19).
        history: per-iteration arrays: ``rho`` (step size). Nothing data-dependent and unnoised
            (the realised batch size, the number of clipped records) is kept: they would reveal a
            record (docs/privacy.md).
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

    def save(self, path, hmac_key: bytes | None = None) -> None:
        """Publish the fit to ``path`` (``.npz`` + JSON, no pickle): parameters, public history, ledger,
        the model's constructor arguments and, for a detected fit, the site layout.

        With ``hmac_key`` the file is authenticated (see :mod:`numpyro_dppvi.checkpoint`). The
        NumPyro model of a detected fit is code and is not stored: pass it to :meth:`load`.
        """
        from numpyro_dppvi import checkpoint
        from numpyro_dppvi.vips.engine import ConjugateModelBase

        if not isinstance(self.model, ConjugateModelBase):
            raise TypeError("VIPSResult.save stores the model by its constructor arguments, which needs one of "
                            "numpyro_dppvi.vips's models (a ConjugateModelBase)")
        meta = {"kind": "VIPSResult", "format": _FORMAT, "model": self.model.init_config(),
                "history": _jsonable(self.history), "privacy": None if self.privacy is None else self.privacy.to_dict(),
                "noise_multiplier": self.noise_multiplier, "info": _jsonable(self.info),
                "site_map": None if self.site_map is None else {
                    "names": list(self.site_map.names), "shapes": [list(s) for s in self.site_map.shapes],
                    "source": self.site_map.source}}
        checkpoint.save(path, {"params": self.params}, meta, hmac_key=hmac_key)

    @classmethod
    def load(cls, path, model=None, hmac_key: bytes | None = None) -> "VIPSResult":
        """Read a fit written by :meth:`save` (the ledger is restored exactly). ``model``: the NumPyro
        model of a detected fit (for ``predict``), or the ``ConjugateModel`` itself; by default the
        model is rebuilt from the saved constructor arguments (package models only)."""
        from numpyro_dppvi import checkpoint, vips
        from numpyro_dppvi.privacy import PrivacyLedger
        from numpyro_dppvi.vips.detect import SiteLayout
        from numpyro_dppvi.vips.engine import ConjugateModelBase, is_conjugate_model, model_from_config

        arrays, meta = checkpoint.load(path, hmac_key=hmac_key)
        if meta.get("kind") != "VIPSResult" or meta.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a saved VIPSResult (format {_FORMAT}).")
        registry = {name: obj for name, obj in vars(vips).items()
                    if isinstance(obj, type) and issubclass(obj, ConjugateModelBase)}
        numpyro_model = None
        if model is not None and is_conjugate_model(model):
            if type(model).__name__ != meta["model"]["class"]:
                raise ValueError(f"{path} holds a {meta['model']['class']} fit, not a {type(model).__name__}")
            conjugate = model
        else:
            conjugate = model_from_config(meta["model"], registry)
            numpyro_model = model
        params = checkpoint.unflatten_like({"params": conjugate.prior_params()}, arrays)["params"]
        layout = meta["site_map"]
        site_map = None if layout is None else SiteLayout(tuple(layout["names"]),
                                                          tuple(tuple(s) for s in layout["shapes"]), layout["source"])
        ledger = None if meta["privacy"] is None else PrivacyLedger.from_dict(meta["privacy"])
        return cls(model=conjugate, params=jax.tree_util.tree_map(jax.numpy.asarray, params),
                   history=_arrays_back(meta["history"]), privacy=ledger, noise_multiplier=meta["noise_multiplier"],
                   numpyro_model=numpyro_model, site_map=site_map, info=meta["info"])

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
