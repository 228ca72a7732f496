"""``VIPSResult``: the fitted variational posterior of a conjugate model, its history and ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dppvi import checkpoint
from numpyro_dppvi.privacy import NotPrivate, PrivacyLedger
from numpyro_dppvi.results import Result, resolve_key
from numpyro_dppvi.vips.detect import SiteLayout
from numpyro_dppvi.vips.engine import ConjugateModelBase, is_conjugate_model, model_from_config

_FORMAT = "numpyro_dppvi.VIPSResult/3"


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


def _params_template(model, arrays) -> dict:
    """The prior's pytree, plus a noise-aware mixture (``BayesianLinearRegression.noise_aware_params``) shaped as
    saved."""
    template = model.prior_params()
    names = ("weights", "means", "scale_tril")
    mixture = {name: np.zeros(arrays[f"['params']['mixture']['{name}']"].shape,
                              arrays[f"['params']['mixture']['{name}']"].dtype)
               for name in names if f"['params']['mixture']['{name}']" in arrays}
    return {**template, "mixture": mixture} if mixture else template


def _model_classes() -> dict:
    """``{name: class}`` of the package's conjugate models (every subclass of ``ConjugateModelBase``)."""
    found, todo = {}, [ConjugateModelBase]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("numpyro_dppvi."):
                found[sub.__name__] = sub
            todo.append(sub)
    return found


@dataclass
class VIPSResult(Result):
    """Output of :func:`numpyro_dppvi.fit_vips` and of federated VIPS (the
    :class:`~numpyro_dppvi.results.Result` protocol).

    Attributes:
        model: the :class:`~numpyro_dppvi.vips.engine.ConjugateModel` that was fitted.
        params: final global variational parameters (natural parameters and, where the model
            has them, hyperparameter posteriors); ``model.expected_natural_params(params)``
            gives ``n̄`` (Eq. 19).
        history: one dict per step (``{"step", "rho"}``, the step size) or, federated, per
            round (``{"round", "communications", "epsilon"}``). Nothing data-dependent and unnoised
            (the realised batch size, the number of clipped records) is kept: they would reveal a
            record (docs/privacy.md).
        privacy: the :class:`~numpyro_dppvi.privacy.PrivacyLedger` of the fit, or
            :class:`~numpyro_dppvi.privacy.NotPrivate`.
        noise_multiplier: noise std / joint clip norm actually used (``None`` without privacy).
        numpyro_model: the NumPyro model the conjugate model was detected from, if any.
        site_map: for a detected model, how posterior draws map to the model's sites.
        info: the fit's public settings and facts (JSON-like): e.g. ``num_data``, ``batch_size``,
            ``iterations``, ``tau0``, ``kappa`` and ``joint_clip`` for :func:`~numpyro_dppvi.fit_vips`;
            ``federated``, ``schedule``, ``damping`` and ``trusted_aggregator`` for federated VIPS; the
            observed site's name (``observed``) for a detected model; ``noise_aware`` and the release noise's
            variance for either.
        params_fitted: with a noise-aware fit (``fit_vips(noise_aware=...)``), the parameters as fitted, before the
            noise-aware step made ``params`` account for the release noise; ``None`` otherwise.
    """

    kind = "VIPSResult"

    model: Any
    params: Any
    history: list
    privacy: Any = None
    noise_multiplier: float | None = None
    numpyro_model: Callable | None = None
    site_map: Callable | None = None
    info: dict = field(default_factory=dict)
    params_fitted: Any = None

    def __post_init__(self):
        if self.privacy is None:
            self.privacy = NotPrivate()

    @property
    def noise_aware(self) -> bool:
        """Whether ``params`` account for the release noise (``params_fitted`` holds them as fitted)."""
        return self.params_fitted is not None

    @property
    def epsilon(self) -> float | None:
        """Total epsilon at the ledger's delta (``None`` for a non-private fit)."""
        return float(self.privacy.epsilon) if self.is_private else None

    def expected_natural_params(self):
        return self.model.expected_natural_params(self.params)

    def sample(self, num_samples: int = 1000, rng_key=None) -> dict:
        """Draws from ``q``: ``{name: array [num_samples, ...]}``, the NumPyro model's site names for a
        detected fit, the conjugate model's parameter names otherwise."""
        samples = self.model.sample_posterior(self.params, resolve_key(rng_key), int(num_samples))
        if self.site_map is not None:
            samples = self.site_map(samples)
        return {name: np.asarray(value) for name, value in samples.items()}

    posterior_samples = sample  # the earlier name

    def predictive_model(self):
        if self.numpyro_model is None:
            raise TypeError(f"this VIPS fit of a {type(self.model).__name__} has no NumPyro model: predict "
                            "with result.predict(...) (the model's own predictive), or fit the NumPyro model "
                            "with fit_vips(numpy_model, data) to use Predictive and log_predictive_density")
        return self.numpyro_model

    def predict(self, *inputs, num_samples: int = 1000, rng_key=None, return_sites=None, **kwargs):
        """Posterior predictive.

        For a detected NumPyro model: ``numpyro.infer.Predictive`` with ``num_samples`` draws
        from ``q``, called as ``model(*inputs, **kwargs)``; returns ``{site: draws}``.
        For a model class: its own predictive (``predict_proba`` for classifiers,
        ``predict_mean`` for regressions, ``predict`` otherwise) at the inputs.
        """
        if self.numpyro_model is not None:
            return super().predict(*inputs, num_samples=num_samples, rng_key=rng_key, return_sites=return_sites,
                                   **kwargs)
        for method in ("predict_proba", "predict_mean", "predict"):
            if hasattr(self.model, method):
                return getattr(self.model, method)(self.params, *inputs, **kwargs)
        raise TypeError(f"{type(self.model).__name__} defines no predictive "
                        "(predict_proba / predict_mean / predict).")

    @property
    def observed_name(self) -> str:
        return self.info.get("observed", "y")

    # ----- saving ----------------------------------------------------------------------------
    def save(self, path, hmac_key: bytes | None = None) -> None:
        """Publish the fit to ``path`` (``.npz`` + JSON, no pickle): parameters, public history, ledger,
        the model's constructor arguments and, for a detected fit, the site layout.

        With ``hmac_key`` the file is authenticated (see :mod:`numpyro_dppvi.checkpoint`). The
        NumPyro model of a detected fit is code and is not stored: pass it to ``load``.
        """
        if not isinstance(self.model, ConjugateModelBase):
            raise TypeError("VIPSResult.save stores the model by its constructor arguments, which needs one of "
                            "numpyro_dppvi.vips's models (a ConjugateModelBase)")
        meta = {"kind": self.kind, "format": _FORMAT, "model": self.model.init_config(),
                "history": _jsonable(self.history), "privacy": self.privacy.to_dict() if self.is_private else None,
                "noise_multiplier": self.noise_multiplier, "info": _jsonable(self.info),
                "site_map": None if self.site_map is None else {
                    "names": list(self.site_map.names), "shapes": [list(s) for s in self.site_map.shapes],
                    "source": self.site_map.source}}
        arrays = {"params": self.params, **({} if self.params_fitted is None else {"params_fitted": self.params_fitted})}
        checkpoint.save(path, arrays, meta, hmac_key=hmac_key)

    @classmethod
    def from_saved(cls, arrays, meta, model, path="the file") -> "VIPSResult":
        """The ledger is restored exactly. ``model``: the NumPyro model of a detected fit (for
        ``predict``), or the ``ConjugateModel`` itself; by default the model is rebuilt from the saved
        constructor arguments (package models only)."""
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a saved VIPSResult (format {_FORMAT}).")
        registry = _model_classes()
        numpyro_model = None
        if model is not None and is_conjugate_model(model):
            if type(model).__name__ != meta["model"]["class"]:
                raise ValueError(f"{path} holds a {meta['model']['class']} fit, not a {type(model).__name__}")
            conjugate = model
        else:
            conjugate = model_from_config(meta["model"], registry)
            numpyro_model = model
        fitted = any(name.startswith("['params_fitted']") for name in arrays)
        template = {"params": _params_template(conjugate, arrays),
                    **({"params_fitted": conjugate.prior_params()} if fitted else {})}
        restored = checkpoint.unflatten_like(template, arrays)
        params = restored["params"]
        layout = meta["site_map"]
        site_map = None if layout is None else SiteLayout(tuple(layout["names"]),
                                                          tuple(tuple(s) for s in layout["shapes"]), layout["source"])
        ledger = None if meta["privacy"] is None else PrivacyLedger.from_dict(meta["privacy"])
        return cls(model=conjugate, params=jax.tree_util.tree_map(jnp.asarray, params), history=meta["history"],
                   privacy=ledger, noise_multiplier=meta["noise_multiplier"], numpyro_model=numpyro_model,
                   site_map=site_map, info=meta["info"],
                   params_fitted=jax.tree_util.tree_map(jnp.asarray, restored["params_fitted"]) if fitted else None)
