"""Results of a fit: the posterior, draws, ArviZ output, prediction, the history, and publishing.

A result holds **only what may be published** (docs/privacy.md, "What a saved result holds"): the
posterior ``q``, the privacy ledger, data-independent settings, and a history of values that are
themselves accounted or computed from released values. Keys, client factors, per-shard and
optimiser states, clip counts and the client sample live only in the fit's private checkpoint
(``fit_dppvi(checkpoint=...)``), which is for resuming and must never be published.

For (DP-)PVI the posterior is the mean-field Gaussian ``q(u) = N(mu, diag(s^2))`` on the flat
unconstrained vector; constrained samples are ``T(u)`` with ``T = biject_to(site.support)``.
"""

from __future__ import annotations

import secrets
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

from numpyro.infer import Predictive
from numpyro.infer.util import log_likelihood

from . import checkpoint, factors
from .arviz_compat import from_groups
from .evaluation import evaluate, log_predictive_density
from .model_adapter import ModelAdapter
from .privacy.ledger import NotPrivate, PrivacyLedger

RESULT_FORMAT = "numpyro_dppvi.DPPVIResult/2"


def resolve_key(rng_key) -> jax.Array:
    """``rng_key``, or when it is None a fresh key from the operating system's entropy: draws without a key
    are new on every call, as those of an unseeded ``numpy.random.default_rng()``; pass a key to reproduce
    them."""
    return jax.random.key(secrets.randbits(63)) if rng_key is None else rng_key


class Result:
    """What every ``fit_*`` returns: one protocol for DP-PVI, VIPS and VFL results.

    * ``sample(num_samples, rng_key)``: posterior draws ``{site: [num_samples, *shape]}`` keyed by
      the model's own site names (constrained values);
    * ``predict(*data, num_samples, rng_key)``: posterior predictive draws through NumPyro's
      ``Predictive``; ``log_predictive_density(*data)``: per-row ``log p(x_i | data)``;
    * ``to_arviz(num_samples, rng_key, eval_data)`` and ``summary(...)`` (ArviZ);
    * ``privacy``: the :class:`~numpyro_dppvi.privacy.PrivacyLedger`, or
      :class:`~numpyro_dppvi.privacy.NotPrivate` whose ``report()`` says so; ``is_private``;
    * ``history``: a list of per-round (per-iteration) dicts;
    * ``save(path, hmac_key=None)`` and ``numpyro_dppvi.load(path, model)``, which chooses the class
      from the file (``.npz`` + JSON through :mod:`numpyro_dppvi.checkpoint`, never pickle).

    Subclasses (``DPPVIResult`` here, ``VIPSResult`` and ``VFLResult`` beside their engines)
    implement :meth:`sample`, :meth:`pointwise_log_likelihood` (``[S, n]``), ``save`` and a
    ``from_saved`` class method; they register under the ``kind`` of their files.
    """

    kind: str = ""
    _registry: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.kind:
            Result._registry[cls.kind] = cls

    @property
    def is_private(self) -> bool:
        return isinstance(self.privacy, PrivacyLedger)

    #: What is known of the calibration of the result's intervals (a dict, see :attr:`calibrated`; None where nothing
    #: is recorded).
    calibration = None

    @property
    def converged(self) -> bool | None:
        """Whether the fit reached its fixed point and can vouch for the posterior (``convergence["converged"]``,
        :func:`numpyro_dppvi.diagnostics.convergence`; False beside intervals the fit flags as not calibrated);
        None for a result that records no convergence summary, or whose fit ran too few rounds for a verdict (a
        non-private fit of 3 rounds: its first step, out of the prior, is not judged)."""
        convergence = getattr(self, "convergence", None)
        return None if not convergence else convergence.get("converged")

    @property
    def calibrated(self) -> bool | None:
        """What is known of this fit's credible intervals: ``True`` or ``False`` on a result that
        :meth:`CalibrationReport.annotate <numpyro_dppvi.simulation_calibration.CalibrationReport.annotate>` returned
        (the pooled 50% and 90% coverage of :func:`numpyro_dppvi.calibration_check` within their bars, or not);
        ``False`` from the fit itself when it cannot vouch for them (a noise-aware DP optimisation fit whose
        posterior could not use the clients' curvature estimates, :func:`numpyro_dppvi.pvi.noise_aware.calibration`,
        or a private fit whose posterior does not account for the noise,
        :func:`numpyro_dppvi.pvi.noise_aware.not_noise_aware`, or a virtual-clients fit whose releases show that the
        clip held its factors back or whose precision the floor rule set,
        :func:`numpyro_dppvi.pvi.release_saturation.calibration`: its ``convergence["converged"]`` is then False too, and a
        :class:`~numpyro_dppvi.diagnostics.CalibrationWarning` says what to do); ``None`` otherwise, or for a
        posterior that a check's widening changed since (``report.recalibrate``). A fit that does not flag itself
        is not thereby calibrated: the check measures that on your model."""
        return None if self.calibration is None else self.calibration.get("calibrated")

    @classmethod
    def load(cls, path, model=None, hmac_key: bytes | None = None) -> "Result":
        """:func:`load`, refusing a file that holds another kind of result. ``model``: the NumPyro model
        of the fit (code is never stored; a VIPS ``ConjugateModel`` is rebuilt from the file when
        omitted)."""
        result = load(path, model, hmac_key)
        if not isinstance(result, cls):
            raise ValueError(f"{path} holds a {type(result).__name__}, not a {cls.__name__}")
        return result

    def sample(self, num_samples: int = 1000, rng_key=None) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def predictive_model(self):
        """The NumPyro model ``predict`` runs (``model(*data)``)."""
        raise NotImplementedError(f"{type(self).__name__} has no NumPyro model to predict with")

    def predict(self, *data, num_samples: int = 1000, rng_key=None, return_sites: Sequence[str] | None = None,
                **kwargs) -> dict:
        """Posterior predictive draws through ``numpyro.infer.Predictive``: ``{site: [num_samples, ...]}``.

        Pass the model's data arguments without the observations (e.g. ``predict(x_test)``).
        """
        k_post, k_pred = jax.random.split(resolve_key(rng_key))
        predictive = Predictive(self.predictive_model(), posterior_samples=self.sample(num_samples, k_post),
                                return_sites=list(return_sites) if return_sites else None)
        return {k: np.asarray(v) for k, v in predictive(k_pred, *data, **kwargs).items()}

    def pointwise_log_likelihood(self, *data, num_samples: int = 100, rng_key=None) -> np.ndarray:
        """``log p(x_i | theta_s)`` for ``num_samples`` posterior draws and the rows of ``data``:
        ``[num_samples, n]`` (the observed sites of a row summed)."""
        per_site = log_likelihood(self.predictive_model(), self.sample(num_samples, resolve_key(rng_key)), *data)
        return np.asarray(sum(jnp.reshape(v, (v.shape[0], v.shape[1], -1)).sum(-1) for v in per_site.values()))

    def log_predictive_density(self, *data, num_samples: int = 100, rng_key=None) -> np.ndarray:
        """Per-row log predictive density ``log (1/S) sum_s p(x_i | theta_s)``, ``[n]``."""
        ll = self.pointwise_log_likelihood(*data, num_samples=num_samples, rng_key=rng_key)
        return np.asarray(logsumexp(ll, axis=0) - np.log(ll.shape[0]))

    def to_arviz(self, num_samples: int = 1000, rng_key=None, eval_data: Sequence | None = None,
                 num_chains: int = 4):
        """ArviZ data (``InferenceData``; a ``DataTree`` with ArviZ 1.x).

        * ``posterior``: ``num_samples`` independent draws of ``q`` (site names and shapes) split into
          ``num_chains`` chains of ``num_samples / num_chains``. ArviZ's ``r_hat`` and ``ess`` are then the
          Monte Carlo diagnostics of independent draws (``r_hat`` about 1, ``ess`` about ``num_samples``):
          they say how precisely the draws give ``q``'s summaries, **not** whether the fit converged or
          ``q`` is close to the posterior (the fit's ``convergence`` and ``history`` say the former;
          ``benchmarks/fidelity.py`` and ``benchmarks/coverage.py`` measure the latter).
        * given ``eval_data`` (the model's arguments with the observations): ``log_likelihood`` (one value
          per row and draw, for ``az.loo`` / ``az.compare``) and ``observed_data``. Without it there is no
          ``log_likelihood`` group (a fit keeps no rows), and ``az.loo`` / ``az.waic`` stop with ArviZ's "log
          likelihood not found": pass the rows to score, e.g. ``eval_data=(x_test, y_test)``.

        ``rng_key=None`` draws fresh randomness (:func:`resolve_key`)."""
        if int(num_chains) != num_chains or num_chains < 1 or num_samples % num_chains:
            raise ValueError(f"to_arviz: num_samples ({num_samples}) must be a positive multiple of num_chains "
                             f"({num_chains}); e.g. num_samples={max(num_chains, num_samples - num_samples % num_chains)}")
        chains = lambda v: np.reshape(np.asarray(v), (num_chains, num_samples // num_chains) + np.shape(v)[1:])
        rng_key = resolve_key(rng_key)
        groups = {"posterior": {k: chains(v) for k, v in self.sample(num_samples, rng_key).items()}}
        if eval_data is not None:
            ll = self.pointwise_log_likelihood(*eval_data, num_samples=num_samples, rng_key=rng_key)
            groups["log_likelihood"] = {self.observed_name: chains(ll)}
            groups["observed_data"] = self.observed_values(eval_data)
        return from_groups(groups)

    observed_name = "y"

    def observed_values(self, eval_data: Sequence) -> dict:
        """ArviZ's ``observed_data``: the observations in ``eval_data`` under :attr:`observed_name` (the name
        of the ``log_likelihood`` group): the model's observed sites traced on ``eval_data``, their rows
        side by side when there are several."""
        import numpyro

        trace = numpyro.handlers.trace(numpyro.handlers.seed(self.predictive_model(), 0)).get_trace(*eval_data)
        observed = [np.asarray(site["value"]) for site in trace.values()
                    if site["type"] == "sample" and site.get("is_observed")]
        if not observed:
            return {}
        rows = observed[0].shape[0]
        flat = [np.reshape(v, (rows, -1)) if v.ndim != 1 else v for v in observed]
        return {self.observed_name: flat[0] if len(flat) == 1 else np.concatenate(
            [np.reshape(v, (rows, -1)) for v in flat], axis=1)}

    def summary(self, num_samples: int = 1000, rng_key=None, **kwargs):
        """``arviz.summary`` of :meth:`to_arviz`; the statistics only by default (``kind="all"`` adds
        ``r_hat`` and ``ess``, the Monte Carlo diagnostics of the independent draws, see :meth:`to_arviz`)."""
        import arviz as az  # ArviZ is imported on use: it is slow to import

        kwargs.setdefault("kind", "stats")
        return az.summary(self.to_arviz(num_samples, rng_key), **kwargs)


def load(path, model=None, hmac_key: bytes | None = None) -> Result:
    """Load any saved result: the class (``DPPVIResult``, ``VIPSResult``, ``VFLResult``) is chosen
    from the file.

    Args:
      path: the ``.npz`` file written by ``result.save(path)``. A private checkpoint is refused (resume it
        with ``fit_dppvi(..., resume=path)``).
      model: the NumPyro model of the fit (code is never stored); for VFL the ``(clients, likelihood)``
        pair (see ``VFLResult.load``); for VIPS the ``ConjugateModel`` may be left out (a package model is
        rebuilt from the file).
      hmac_key: the bytes the file was saved with (``result.save(path, hmac_key=...)``); required for a file
        saved with a key, refused for one saved without. Default None.

    Returns:
      the saved result, of the class the file names.
    """
    arrays, meta = checkpoint.load(path, hmac_key=hmac_key)
    if meta.get("private"):
        raise ValueError(f"{path} is a private checkpoint (it holds the fit's secret key and client states); "
                         "resume it with fit_dppvi(..., resume=path), and publish result.save(...) instead")
    cls = Result._registry.get(meta.get("kind"))
    if cls is None:
        raise ValueError(f"{path} does not hold a numpyro_dppvi result (kind {meta.get('kind')!r}; known: "
                         f"{sorted(Result._registry)})")
    return cls.from_saved(arrays, meta, model, path)


class DPPVIResult(Result):
    """What ``fit_dppvi`` / ``fit_global_vi`` / ``fit_bcm`` return.

    The fit functions build it; the constructor's arguments are its attributes of the same names.

    Attributes:
      adapter: the :class:`~numpyro_dppvi.ModelAdapter` of the fitted model (its sites, shapes and
        transforms; no data rows).
      q: the posterior, a Gaussian in natural parameters on the flat unconstrained vector. For a noise-aware
        private fit (``config["noise_aware"]``) the fitted ``q`` widened by the uncertainty the privacy noise
        leaves in it (:mod:`numpyro_dppvi.pvi.noise_aware`).
      history: one dict per round: round, communications, participation, seconds, held-out metrics, counts of
        invalid or failed updates, and ``change``, the largest move of ``q`` in the round in posterior-sd units.
      method: the fit's method (``"pvi"``, ``"dp_optimisation"``, ..., ``"global_vi"``, ``"bcm_same"``, ...).
      schedule: the server schedule (``"sequential"``, ``"synchronous"``, ``"asynchronous"``), or None
        (global VI, BCM).
      privacy: the :class:`~numpyro_dppvi.privacy.PrivacyLedger` of a private fit; None (the default) is stored
        as :class:`~numpyro_dppvi.privacy.NotPrivate`.
      config: the data-independent settings of the fit (JSON; ``{}`` when None).
      rounds: rounds completed. Default 0.
      convergence: how far ``q`` was from its fixed point when the fit stopped
        (:func:`numpyro_dppvi.diagnostics.convergence`), or None.
      q_fitted: ``q`` as fitted, before the noise-aware step; None (the default) makes it ``q`` itself.
      calibration: private ``fit_dppvi`` and ``fit_global_vi`` fits: ``{"calibrated": None or False,
        "precision_rule": ...}`` (virtual clients: ``{"calibrated", "clip_saturation", "clip_saturation_se",
        "floored_share", "reason"}``, :func:`numpyro_dppvi.pvi.release_saturation.calibration`); a check's verdict
        once annotated (:attr:`calibrated`). None otherwise.
      updates: for a fit just run, per client the rounds it took part in and its valid updates (``{"taken_part":
        [...], "valid": [...]}``; None under client-level DP, and not saved).
    """

    kind = "DPPVIResult"

    def __init__(self, adapter: ModelAdapter, q: factors.Gaussian, history: list, method: str,
                 schedule: str | None, privacy=None, config: dict | None = None, rounds: int = 0,
                 convergence: dict | None = None, q_fitted: factors.Gaussian | None = None,
                 calibration: dict | None = None):
        self.adapter = adapter
        self.q = jax.tree.map(np.asarray, q)
        self.q_fitted = self.q if q_fitted is None or q_fitted is q else jax.tree.map(np.asarray, q_fitted)
        self.history = history
        self.method = method
        self.schedule = schedule
        self.privacy = NotPrivate() if privacy is None else privacy
        self.config = dict(config or {})
        self.rounds = int(rounds)
        self.convergence = convergence
        self.calibration = calibration
        self.updates = None

    def __repr__(self) -> str:
        privacy = (f"epsilon={self.privacy.epsilon:.4g}, delta={self.privacy.delta_total:.3g}" if self.is_private
                   else "private=False")
        return (f"DPPVIResult(method={self.method!r}, family={self.family!r}, rounds={self.rounds}, "
                f"converged={self.converged}, {privacy}, calibrated={self.calibrated})")

    def _rows(self, data: tuple) -> tuple:
        """Evaluation rows as the model's arrays: ``f(x, y)``, or ``f((x, y))`` as ``fit_dppvi(eval_data=...)``
        takes them."""
        if len(data) == 1 and isinstance(data[0], (tuple, list)):
            data = tuple(data[0])
        return self.adapter.validate_data(data, "evaluation data")

    @property
    def settings(self):
        """The fit's settings as one value, :class:`~numpyro_dppvi.pvi.fit_settings.FitSettings`, read from
        ``config`` (:func:`~numpyro_dppvi.simulation_calibration.fit_options`): ``fit_dppvi(model, clients,
        settings=result.settings)`` runs the same fit on other clients (the defaults the model decided come back as
        the values they took). An ``optimizer`` the caller passed is not in a result (code, not a setting)."""
        from .pvi.fit_settings import FitSettings
        from .simulation_calibration import fit_options

        return FitSettings(**fit_options(self))

    @property
    def noise_aware(self) -> bool:
        """Whether ``q`` accounts for the uncertainty the privacy noise adds (:mod:`numpyro_dppvi.pvi.noise_aware`)."""
        return bool(self.config.get("noise_aware", False))

    def summary(self, num_samples: int = 1000, rng_key=None, **kwargs):
        """``arviz.summary`` of :meth:`to_arviz`, with a ``family`` column (the Gaussian family of ``q``:
        ``mean_field`` under-states the sds of correlated posteriors), a ``noise_aware`` column for a private fit
        (whether the sds include the uncertainty the privacy noise adds), the fit's convergence
        (``result.convergence``) in the table's ``attrs`` and, when it is known, a ``converged`` column
        (the same for every row: PVI converges as a whole)."""
        table = super().summary(num_samples, rng_key, **kwargs)
        table["family"] = self.family
        table.attrs["family"] = self.family
        if self.is_private:
            table["noise_aware"] = self.noise_aware
            table.attrs["noise_aware"] = self.noise_aware
        if self.convergence is not None:
            table.attrs["convergence"] = dict(self.convergence)
            if self.convergence.get("converged") is not None:
                table["converged"] = bool(self.convergence["converged"])
        return table

    @property
    def model(self):
        return self.adapter.model

    def predictive_model(self):
        return self.adapter.model

    @property
    def observed_name(self) -> str:
        return self.adapter.observed[0]

    @property
    def posterior(self) -> dict:
        """``{site: {"loc": ..., "scale": ...}}`` of ``q`` on the unconstrained space, in site shapes (a
        full-rank ``q``: its marginal sds; ``q`` itself has the correlations)."""
        loc, scale = factors.to_loc_scale(self.q)
        locs, scales = self.adapter.unflatten(loc), self.adapter.unflatten(scale)
        return {s.name: {"loc": np.asarray(locs[s.name]), "scale": np.asarray(scales[s.name])}
                for s in self.adapter.sites}

    @property
    def family(self) -> str:
        """``"mean_field"``, ``"full_rank"`` or ``"low_rank"``: the Gaussian family of ``q``."""
        return factors.family_of(self.q)

    def _draws(self, num_samples: int, rng_key):
        return factors.draws(self.q, jax.random.normal(rng_key, (int(num_samples),) + self.q.eta1.shape))

    def sample(self, num_samples: int = 1000, rng_key=None) -> dict:
        """Constrained posterior samples ``{site: [num_samples, *shape]}`` (post-processing of ``q``);
        ``rng_key=None``: fresh draws on every call (:func:`resolve_key`)."""
        u = self._draws(num_samples, resolve_key(rng_key))
        return {k: np.asarray(v) for k, v in jax.vmap(self.adapter.constrain)(u).items()}

    def predict(self, *data, num_samples: int = 1000, rng_key=None, return_sites: Sequence[str] | None = None,
                **kwargs) -> dict:
        """Posterior predictive draws of the observed sites (or ``return_sites``) through
        ``numpyro.infer.Predictive``: ``{site: [num_samples, n, ...]}``. Pass the model's data
        arguments without the observations (e.g. ``predict(x_test)``)."""
        return super().predict(*data, num_samples=num_samples, rng_key=rng_key,
                               return_sites=return_sites or list(self.adapter.observed), **kwargs)

    def pointwise_log_likelihood(self, *data, num_samples: int = 100, rng_key=None) -> np.ndarray:
        """``log p(x_i | theta_s)``: ``[num_samples, n]`` (one compiled program per model)."""
        arrays = self._rows(data)
        u = self._draws(num_samples, resolve_key(rng_key))
        return np.asarray(jax.lax.map(lambda u_s: self.adapter.log_lik_rows(u_s, arrays), u))

    def log_predictive_density(self, *data, num_samples: int = 100, rng_key=None) -> np.ndarray:
        """Per-row log predictive density ``log (1/S) sum_s p(x_i | theta_s)``, ``[n]``."""
        arrays = self._rows(data)
        return log_predictive_density(self.adapter, self.q, arrays,
                                      resolve_key(rng_key), num_samples)

    def evaluate(self, *data, num_samples: int = 100, rng_key=None) -> dict:
        """Mean log predictive density (and accuracy for Bernoulli observations) on held-out rows: ``evaluate(x, y)``
        or ``evaluate((x, y))``, the model's arrays with the observations."""
        arrays = self._rows(data)
        return evaluate(self.adapter, self.q, arrays, resolve_key(rng_key), num_samples)

    # -- publishing ----------------------------------------------------------------------------
    def public_meta(self) -> dict:
        """The metadata of a published result (every field documented in docs/privacy.md)."""
        return {
            "kind": self.kind, "format": RESULT_FORMAT, "method": self.method, "schedule": self.schedule,
            "history": self.history, "config": self.config, "rounds": self.rounds,
            "convergence": self.convergence,
            "calibration": self.calibration,
            "privacy": self.privacy.to_dict() if self.is_private else None,
            "data_shapes": [list(a.shape[1:]) for a in self.adapter.example_row],
            "data_dtypes": [str(a.dtype) for a in self.adapter.example_row],
        }

    def save(self, path, hmac_key: bytes | None = None) -> None:
        """Publish the result to ``path`` (``.npz``): ``q``, the ledger, the settings and the history.

        Holds nothing private (no key, no client state); see docs/privacy.md. With ``hmac_key`` the
        file is authenticated (a file edited without the key is refused by :func:`load`); without,
        its checksum detects damage only.
        """
        tree = {"q": self.q} if self.q_fitted is self.q else {"q": self.q, "q_fitted": self.q_fitted}
        checkpoint.save(path, tree, self.public_meta(), hmac_key=hmac_key)

    @classmethod
    def from_saved(cls, arrays, meta, model, path="the file") -> "DPPVIResult":
        """``model`` is the same NumPyro model function (code is never stored); it is re-traced on
        zeros shaped like one data row (no data rows are stored)."""
        if model is None:
            raise TypeError(f"loading {path} needs the model: numpyro_dppvi.load(path, model)")
        if meta.get("format") != RESULT_FORMAT:
            raise ValueError(f"{path} does not hold a published DPPVIResult (format {RESULT_FORMAT})")
        adapter = ModelAdapter.for_shapes(model, meta["data_shapes"], meta["data_dtypes"])
        def read(name):
            if f"['{name}'].eta2.basis" in arrays:  # low-rank: diagonal, core and the public basis
                return factors.Gaussian(arrays[f"['{name}'].eta1"], factors.LowRank(
                    *(arrays[f"['{name}'].eta2.{field}"] for field in factors.LowRank._fields)))
            return factors.Gaussian(arrays[f"['{name}'].eta1"], arrays[f"['{name}'].eta2"])

        q = read("q")
        q_fitted = read("q_fitted") if "['q_fitted'].eta1" in arrays else None
        privacy = None if meta.get("privacy") is None else PrivacyLedger.from_dict(meta["privacy"])
        return cls(adapter, q, meta["history"], meta["method"], meta["schedule"], privacy, meta["config"],
                   meta.get("rounds", len(meta["history"])), meta.get("convergence"), q_fitted=q_fitted,
                   calibration=meta.get("calibration"))
