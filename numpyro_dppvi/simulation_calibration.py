"""Is my private posterior calibrated? Simulation-based calibration of a (private, federated) fit.

:func:`calibration_check` is the private, federated counterpart of NumPyro's
``numpyro.infer.calibration.vsbc_diagnostic``. For ``k = 1..K`` it

1. draws parameters ``theta_k``: from the model's prior (simulation-based calibration, Talts et al. 2018, "Validating
   Bayesian inference algorithms with simulation-based calibration", arXiv 1804.06788), or from a released posterior
   (the parametric bootstrap of Ferrando, Wang & Sheldon, AISTATS 2022, which re-runs the same private mechanism on
   data simulated from the released estimate: its spread holds the sampling and the privacy noise, and it shows the
   bias that clipping puts in the estimate);
2. simulates every client's observations from ``theta_k`` at the client's covariates (the model's observed sites,
   NumPyro's ``condition`` and ``seed`` handlers), at the clients' own sizes;
3. runs the same fit (method, family, privacy budget and every other setting) on the simulated clients;
4. scores the fitted ``q_k`` (a Gaussian on the unconstrained space, ``T^-1(theta)``) against ``theta_k``, per
   unconstrained coordinate ``c``:

       z_kc = (T^-1(theta_k)_c - mu_kc) / s_kc,     p_kc = Phi(z_kc) = Pr_q(u_c < T^-1(theta_k)_c),

   ``p`` the VSBC probability of Yao, Vehtari, Simpson & Gelman (ICML 2018, "Yes, but did it work?", eq. 3.1, exact
   for a Gaussian ``q``), and the rank of ``T^-1(theta_k)_c`` among ``L`` independent draws of ``q_k`` (Talts et
   al.'s rank statistic, uniform on ``{0..L}`` for a calibrated method). The central ``a`` interval holds the truth
   when ``|z| < Phi^-1((1 + a) / 2)``; per-coordinate transforms ``T`` are monotone, so this is the coverage of the
   constrained central interval too.

The report (:class:`CalibrationReport`) gives per-site and pooled coverage with Monte Carlo standard errors (taken
over data sets: the coordinates of one fit are not independent), the VSBC symmetry test of ``p`` against ``1 - p``
(a two-sample Kolmogorov-Smirnov test, as NumPyro's) and the uniformity test of ``p`` (one-sample KS), and, where
the intervals are too narrow, a recalibrated posterior (:meth:`CalibrationReport.recalibrate`).

**What it costs in privacy.** Nothing, when the covariates are synthetic or public: the simulated observations and
parameters are not anyone's data, so the check's fits may use a key derived from ``rng_key``, and the report is a
function of them and of the released posterior (post-processing, Dwork & Roth 2014, Prop. 2.1). When the
covariates are the clients' private rows, each of the ``K`` fits is a release about those rows (their covariates
enter every clipped gradient); the report is post-processing of all ``K`` releases, so it costs their composition:
:meth:`CalibrationReport.privacy_cost` composes every fit's events, per client, in one ledger (about ``sqrt(K)``
times one fit's epsilon for Gaussian mechanisms with small budgets, never more than ``K`` times), and the check must
then run with a secret key (``rng_key=None``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from typing import Callable, Mapping, Sequence

import jax
import numpy as np
from numpyro import handlers
from scipy import stats

from . import factors
from .diagnostics import unconstrained_coordinates
from .model_adapter import ModelAdapter
from .privacy.adaptive_clip import AdaptiveClip
from .privacy.config import Privacy
from .privacy.ledger import PrivacyLedger
from .pvi.driver import FitDiverged, NoValidUpdates
from .pvi.fit_settings import FitSettings
from .results import DPPVIResult, resolve_key

#: Coverage bars of a calibrated posterior's central 90% and 50% intervals (issue 59, ``benchmarks/coverage.py``).
BARS = {0.9: (0.85, 0.95), 0.5: (0.42, 0.58)}

#: ``result.config`` keys that are ``fit_dppvi`` options of the same name (:func:`fit_options`).
_SAME_NAME = ("method", "schedule", "local_steps", "batch_size", "num_samples", "damping", "server_steps",
              "privacy_unit", "client_rate", "trusted_aggregator", "invalid", "precision_floor", "tail_average",
              "family", "rank", "noise_aware")


def fit_options(result: DPPVIResult) -> dict:
    """The keyword options of :func:`~numpyro_dppvi.fit_dppvi` that run ``result``'s fit again on other clients.

    Read from ``result.config`` (the settings the fit resolved, defaults included, so a default chosen from the
    traced model comes back as the same explicit value): the method, schedule, rounds planned, local steps, batch
    size, damping, family, noise awareness, shards, aggregator, privacy unit and the privacy request (``epsilon``,
    ``delta``, the clip the fit used, sampling, neighbouring relation, accountant, adaptive clipping, the declared
    public sizes and ``epsilon_max``). The noise multiplier is not passed: the same request on clients of the same
    public sizes calibrates the same noise. A non-private fit run until convergence gives ``rounds=None`` (again
    until convergence).

    Not in a result: an ``optimizer`` the caller passed (optax transformations are code, not settings). The options
    then name none and the fit takes the method's default; pass the same optimizer yourself (``calibration_check``'s
    ``options``)."""
    if not isinstance(result, DPPVIResult):
        raise TypeError(f"fit_options needs a DPPVIResult (what fit_dppvi returns), got {type(result).__name__}")
    config = result.config
    options = {name: config[name] for name in _SAME_NAME if name in config}
    options["rounds"] = config.get("planned_rounds")
    shards = config.get("shards")
    if shards is not None:
        options["shards"] = shards if isinstance(shards, str) else tuple(int(k) for k in shards)
    p = config.get("privacy")
    if p is not None:
        adaptive = p.get("adaptive_clip")
        options["privacy"] = Privacy(
            epsilon=p["epsilon"], delta=p["delta"], clip=float(p["clip"]), sampling=p["sampling"],
            neighbouring=p["neighbouring"], accountant=p["accountant"],
            epsilon_max=None if p.get("epsilon_max") is None else list(p["epsilon_max"]),
            adaptive_clip=None if adaptive is None else AdaptiveClip(**adaptive),
            public_sizes=p.get("public_sizes"))
    if options.get("rank") is None:
        options.pop("rank", None)
    return options


def observation_names(model: Callable, covariates: Sequence) -> list[str]:
    """The observation sites of ``model`` run on one client's ``covariates`` (without the observations, so that
    NumPyro samples them): the sample sites inside a plate over the rows (a plate whose size is the covariates'
    leading size), the privacy plate's sites, in trace order. ``fit_dppvi`` allows no latent site there."""
    rows = int(np.shape(covariates[0])[0])
    trace = handlers.trace(handlers.seed(model, 0)).get_trace(*covariates)
    return [name for name, site in trace.items() if site["type"] == "sample"
            and any(frame.size == rows for frame in site.get("cond_indep_stack", ()))]


def prior_draw(model: Callable, covariates: Sequence, rng_key) -> dict:
    """One draw of every sample site of ``model(*covariates)`` from the prior (observed sites sampled too)."""
    trace = handlers.trace(handlers.seed(model, rng_key)).get_trace(*covariates)
    return {name: np.asarray(site["value"]) for name, site in trace.items() if site["type"] == "sample"}


def simulate_client(model: Callable, covariates: Sequence, values: Mapping, rng_key) -> tuple:
    """One client's data simulated from the parameters ``values``: ``(*covariates, *observations)``.

    The model runs on ``covariates`` (its arguments without the observations, which must default to None, as in
    ``def model(x, y=None)``) with the latent sites conditioned on ``values``; the observations, in the order of the
    model's observed sites, follow the covariates. A model whose arguments are laid out otherwise takes
    ``calibration_check(simulate=...)``."""
    conditioned = handlers.condition(model, data={k: v for k, v in values.items()})
    trace = handlers.trace(handlers.seed(conditioned, rng_key)).get_trace(*covariates)
    observed = [np.asarray(site["value"]) for name, site in trace.items()
                if site["type"] == "sample" and name not in values]
    rows = int(np.shape(covariates[0])[0]) if covariates else None
    for value in observed:
        if rows is not None and (np.ndim(value) == 0 or np.shape(value)[0] != rows):
            raise ValueError(f"simulate_client: an observed site gave shape {np.shape(value)}, not one value per row "
                             f"of the covariates ({rows} rows); pass calibration_check(simulate=...) for this model")
    return tuple(np.asarray(c) for c in covariates) + tuple(observed)


def _check_covariates(model, covariates) -> list[tuple]:
    if isinstance(covariates, tuple) or not isinstance(covariates, Sequence) or not len(covariates):
        raise TypeError("covariates must be a list with one entry per client: a tuple of that client's covariate "
                        "arrays (the model's arguments without the observations), e.g. [(x_1,), (x_2,), ...]")
    out = []
    for m, c in enumerate(covariates):
        c = (c,) if isinstance(c, np.ndarray) or hasattr(c, "shape") else tuple(c)
        sizes = {int(np.shape(a)[0]) for a in c}
        if len(sizes) != 1:
            raise ValueError(f"covariates[{m}]: every array needs the client's rows on its leading axis "
                             f"(got leading sizes {sorted(sizes)})")
        out.append(c)
    signature = inspect.signature(model)
    required = [p for p in signature.parameters.values()
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > len(out[0]):
        raise ValueError(f"the model requires {len(required)} positional arguments but each client's covariates hold "
                         f"{len(out[0])}: give the observations a default of None (def model(x, y=None)) so that "
                         "the check can simulate them, or pass simulate=...")
    return out


@dataclasses.dataclass
class CalibrationReport:
    """What :func:`calibration_check` found (module docstring for the definitions).

    Attributes:
      sites: the latent sites, in the fit's layout.
      z: ``{site: [K, size]}`` standardised errors ``(u_true - mu) / s`` on the unconstrained space.
      probabilities: ``{site: [K, size]}`` VSBC probabilities ``Phi(z)``.
      ranks: ``{site: [K, size]}`` ranks of the truth among ``num_draws`` draws of each ``q``.
      num_draws: ``L``, the draws behind the ranks (ranks lie in ``0..L``).
      truths: the ``K`` parameter draws (constrained, ``{site: value}``).
      results: the ``K`` fitted results (on simulated data: public when the covariates are); None for a fit that raised.
      data: the ``K`` simulated data sets, each a list of client tuples (the check's fits ran on them).
      failures: ``[(data set, error)]`` of the fits that raised (``FitDiverged``, ...): they count as not covering.
      warnings: ``{warning class name: number of fits that gave it}`` over the ``K`` fits.
      parameters: ``"prior"`` or ``"posterior"`` (where ``theta`` was drawn from).
      options: the fit's keyword options, as run.
    """

    sites: list
    z: dict
    probabilities: dict
    ranks: dict
    num_draws: int
    truths: list
    results: list
    data: list
    failures: list
    warnings: dict
    parameters: str
    options: dict

    @property
    def num_datasets(self) -> int:
        """``K``, the data sets simulated (fits that raised included)."""
        return len(self.truths)

    def errors(self, sites=None) -> np.ndarray:
        """``[K, coordinates]`` z of ``sites`` (all by default); a failed fit's row is ``inf`` (never covers)."""
        names = self.sites if sites is None else list(sites)
        return np.concatenate([self.z[s] for s in names], axis=1)

    def coverage(self, level: float = 0.9, site: str | None = None) -> tuple[float, float]:
        """``(coverage, standard error)`` of the central ``level`` intervals: the share of (data set, coordinate)
        pairs whose interval holds the truth, pooled over the coordinates of ``site`` (all sites when None), and
        its Monte Carlo standard error over the data sets (``sd of the per-data-set shares / sqrt(K)``)."""
        if not 0.0 < level < 1.0:
            raise ValueError(f"level must lie strictly between 0 and 1, got {level}")
        z = self.errors(None if site is None else [site])
        per_set = (np.abs(z) < stats.norm.ppf((1.0 + level) / 2.0)).mean(axis=1)
        se = per_set.std(ddof=1) / math.sqrt(len(per_set)) if len(per_set) > 1 else float("nan")
        return float(per_set.mean()), float(se)

    def ks(self, site: str | None = None) -> dict:
        """Per coordinate of ``site`` (all sites when None): ``{"vsbc_statistic", "vsbc_pvalue"}`` of the VSBC
        symmetry test (two-sample KS of ``p`` against ``1 - p``, Yao et al. 2018, section 3.2; NumPyro's
        ``vsbc_diagnostic``) and ``{"uniform_statistic", "uniform_pvalue"}`` of the one-sample KS test of ``p``
        against the uniform (simulation-based calibration). Arrays ``[coordinates]``; failed fits left out."""
        p = np.concatenate([self.probabilities[s] for s in (self.sites if site is None else [site])], axis=1)
        p = p[np.all(np.isfinite(p), axis=1)]
        out = {k: np.full(p.shape[1], np.nan) for k in ("vsbc_statistic", "vsbc_pvalue", "uniform_statistic",
                                                         "uniform_pvalue")}
        if len(p) < 2:
            return out
        for c in range(p.shape[1]):
            sym = stats.ks_2samp(p[:, c], 1.0 - p[:, c], method="asymp")
            uni = stats.kstest(p[:, c], "uniform")
            out["vsbc_statistic"][c], out["vsbc_pvalue"][c] = sym.statistic, sym.pvalue
            out["uniform_statistic"][c], out["uniform_pvalue"][c] = uni.statistic, uni.pvalue
        return out

    @property
    def calibrated(self) -> bool:
        """Whether the pooled central 90% and 50% intervals cover within :data:`BARS`, allowing two Monte Carlo
        standard errors (a coverage whose interval ``coverage +- 2 se`` overlaps the bar is not called
        miscalibrated), with no fit that raised."""
        if self.failures:
            return False
        for level, (low, high) in BARS.items():
            cover, se = self.coverage(level)
            if cover + 2.0 * se < low or cover - 2.0 * se > high:
                return False
        return True

    def _check_result(self, result, what: str) -> None:
        if not isinstance(result, DPPVIResult):
            raise TypeError(f"{what} needs a DPPVIResult, got {type(result).__name__}")
        if [s.name for s in result.adapter.sites] != list(self.sites):
            raise ValueError(f"the result's sites {[s.name for s in result.adapter.sites]} are not the check's "
                             f"{list(self.sites)}: {what} a fit of the model the check ran")

    def widening(self, level: float | None = None) -> dict:
        """``{site: k}``: the factor by which the check's errors exceed the reported sds, over the site's (data set,
        coordinate) pairs (failed fits left out), at least 1 (the check only widens):

        * ``level=None``: ``k = sqrt(mean z^2)``, the parametric-bootstrap estimate of ``sd(error) / s`` (its mean
          square includes a bias, so it widens for a biased estimate too); a calibrated site's ``k`` is about 1,
          within the Monte Carlo error ``1 / sqrt(2 K D)``;
        * ``level=a``: ``k = Q_a(|z|) / Phi^-1((1 + a) / 2)``, the widening that makes the central ``a`` intervals
          cover ``a`` of the check's truths (robust to a few fits far off, which dominate ``mean z^2``).

        One per site: a site's coordinates share a role in the model, and ``K`` data sets alone give a noisy
        per-coordinate estimate."""
        if level is not None and not 0.0 < level < 1.0:
            raise ValueError(f"level must be None or lie strictly between 0 and 1, got {level}")
        out = {}
        for s in self.sites:
            z = self.z[s][np.all(np.isfinite(self.z[s]), axis=1)]
            if not z.size:
                out[s] = float("nan")
            elif level is None:
                out[s] = float(max(1.0, math.sqrt(np.mean(z ** 2))))
            else:
                out[s] = float(max(1.0, np.quantile(np.abs(z), level) / stats.norm.ppf((1.0 + level) / 2.0)))
        return out

    def recalibrate(self, result: DPPVIResult, level: float | None = None) -> DPPVIResult:
        """``result`` with its posterior widened by :meth:`widening` (at ``level``): the same means, each site's coordinates' sds
        multiplied by its ``k`` (``Sigma' = K Sigma K`` with ``K = diag(k)``: correlations kept; a low-rank ``q``
        comes back full-rank). Post-processing of the released ``q`` and of the check (which touched no private data
        unless its covariates were private, :meth:`privacy_cost`), so it costs nothing more. The returned result's
        ``config["recalibrated"]`` and ``calibration["recalibrated"]`` hold the factors and ``calibration["check"]`` the
        check's :meth:`verdict`; its ``calibrated`` is None (the widened posterior is not itself checked: a check whose
        ``fit`` recalibrates each simulated fit measures it); its ``q_fitted`` is the fit's own.

        The widening is what the check measured on its simulated data sets: it transfers to ``result`` when those
        resemble the real one (the same covariates or their distribution, parameters drawn near the real ones:
        ``parameters="posterior"`` draws them from ``result`` itself)."""
        self._check_result(result, "recalibrate")
        widen = self.widening(level)
        k = np.concatenate([np.full(s.size, widen[s.name]) for s in result.adapter.sites])
        q = result.q
        if factors.is_low_rank(q):
            q = factors.to_full_rank(q)
        eta1, eta2 = np.asarray(q.eta1, np.float64), np.asarray(q.eta2, np.float64)
        if eta2.ndim == eta1.ndim + 1:  # full rank: Lambda' = K^-1 Lambda K^-1, eta1' = Lambda' mu
            mean = np.linalg.solve(-2.0 * eta2, eta1)
            eta2 = eta2 / np.outer(k, k)
            eta1 = -2.0 * eta2 @ mean
        else:  # mean-field: s' = k s with the same mean
            eta1, eta2 = eta1 / k ** 2, eta2 / k ** 2
        dtype = np.asarray(result.q.eta1).dtype
        widened = factors.Gaussian(eta1.astype(dtype), eta2.astype(dtype))
        config = dict(result.config, recalibrated={"widening": widen, "level": level, "parameters": self.parameters,
                                                   "num_datasets": self.num_datasets})
        calibration = dict(result.calibration or {}, calibrated=None, check=self.verdict(), recalibrated=widen)
        return DPPVIResult(result.adapter, widened, result.history, result.method, result.schedule,
                           result.privacy if result.is_private else None, config, result.rounds,
                           result.convergence, q_fitted=result.q_fitted, calibration=calibration)

    def verdict(self) -> dict:
        """The check in a few public numbers (JSON): ``calibrated``, the pooled 50% and 90% coverage with their
        standard errors, ``num_datasets``, ``parameters``, ``failures`` (how many fits raised) and the method."""
        c50, se50 = self.coverage(0.5)
        c90, se90 = self.coverage(0.9)
        return {"calibrated": self.calibrated, "cover50": c50, "se50": se50, "cover90": c90, "se90": se90,
                "num_datasets": self.num_datasets, "parameters": self.parameters, "failures": len(self.failures),
                "method": self.options.get("method", "pvi")}

    def annotate(self, result: DPPVIResult) -> DPPVIResult:
        """``result`` (the same posterior) with the check's :meth:`verdict` in ``result.calibration["check"]`` and
        ``result.calibrated`` set to :attr:`calibrated`: the check of ``result``'s own settings (``settings=result``,
        at its public sizes) says whether its intervals can be read at face value. Saved with the result (public: a
        function of the released posterior and of simulated data when the covariates are public)."""
        self._check_result(result, "annotate")
        verdict = self.verdict()
        return DPPVIResult(result.adapter, result.q, result.history, result.method, result.schedule,
                           result.privacy if result.is_private else None, result.config, result.rounds,
                           result.convergence, q_fitted=result.q_fitted,
                           calibration=dict(result.calibration or {}, calibrated=verdict["calibrated"], check=verdict))

    def summary(self):
        """A ``pandas.DataFrame``, one row per site and one for all: coordinates, 50% and 90% coverage with their
        standard errors, the smallest VSBC and uniformity p-values over the site's coordinates, and the widening."""
        import pandas as pd

        rows, widen = [], self.widening()
        for site in [*self.sites, None]:
            c50, se50 = self.coverage(0.5, site)
            c90, se90 = self.coverage(0.9, site)
            tests = self.ks(site)
            rows.append({"site": "(all)" if site is None else site,
                         "coordinates": self.errors(None if site is None else [site]).shape[1],
                         "cover50": c50, "se50": se50, "cover90": c90, "se90": se90,
                         "min_vsbc_pvalue": float(np.nanmin(tests["vsbc_pvalue"], initial=np.nan)),
                         "min_uniform_pvalue": float(np.nanmin(tests["uniform_pvalue"], initial=np.nan)),
                         "widening": widen.get(site, max(widen.values(), default=float("nan")))})
        return pd.DataFrame(rows).set_index("site")

    def privacy_cost(self, delta: float | None = None) -> PrivacyLedger | None:
        """The composition of every fit's releases, per client, in one ledger (at ``delta``, by default the fits'):
        what the check costs when its covariates are the clients' private rows (module docstring). None for
        non-private fits. With synthetic or public covariates the check costs nothing and this ledger is only what
        the same fits would cost on private ones."""
        ledgers = [r.privacy for r in self.results if r is not None and r.is_private]
        if not ledgers:
            return None
        first = ledgers[0]
        out = PrivacyLedger(first.num_clients, first.delta if delta is None else delta, first.neighbouring,
                            first.accountant, first.trusted_aggregator, seed=first.seed, sizes=first.sizes)
        for ledger in ledgers:
            for client in range(ledger.num_clients):
                for event in ledger.events(client):
                    out.record(client, event)
        return out

    def plot(self, ax=None, sites: Sequence[str] | None = None):
        """The coverage of the central intervals against their level (pooled, and per site when ``sites`` are named),
        with two standard errors (:func:`numpyro_dppvi.plots.plot_calibration_check`)."""
        from .plots import plot_calibration_check

        return plot_calibration_check(self, ax=ax, sites=sites)

    def __repr__(self) -> str:
        c90, se90 = self.coverage(0.9)
        c50, se50 = self.coverage(0.5)
        method = self.options.get("method", "pvi")
        return (f"CalibrationReport(method={method!r}, datasets={self.num_datasets}, parameters={self.parameters!r}, "
                f"cover90={c90:.3f} +- {se90:.3f}, cover50={c50:.3f} +- {se50:.3f}, calibrated={self.calibrated}, "
                f"failures={len(self.failures)})")


def _standardised(result: DPPVIResult, truth_u: np.ndarray, rng, num_draws: int):
    """``(z, p, ranks)`` of the truth ``truth_u`` (flat, unconstrained) under ``result.q``: ``[D]`` each."""
    loc, log_scale = unconstrained_coordinates(result.q)
    scale = np.exp(log_scale)
    z = (truth_u - loc) / scale
    eps = rng.standard_normal((num_draws,) + loc.shape)
    draws = np.asarray(factors.draws(result.q, eps.astype(np.asarray(result.q.eta1).dtype)), np.float64)
    ranks = np.sum(draws < truth_u[None], axis=0)
    return z, stats.norm.cdf(z), ranks


def calibration_check(model: Callable, covariates: Sequence, settings: DPPVIResult | FitSettings | Mapping, *,
                      num_datasets: int = 20, parameters: str = "prior", rng_key=None,
                      simulate: Callable | None = None, fit: Callable | None = None, num_draws: int = 99,
                      options: Mapping | None = None, progress: bool = False) -> CalibrationReport:
    """Run the same fit on ``num_datasets`` data sets simulated from known parameters and report whether its
    intervals cover them (module docstring: the method, the statistics, what it costs in privacy).

    Args:
      model: the NumPyro model of the fit (``def model(x, y=None)``: observations last, defaulting to None).
      covariates: one tuple per client of the covariate arrays the model takes (its arguments without the
        observations), e.g. ``[(x_1,), (x_2,)]``; synthetic or public rows at the clients' public sizes (the check
        then touches no private data). Each simulated data set has these covariates and new observations.
      settings: the fit to check: a result of :func:`~numpyro_dppvi.fit_dppvi` (its settings, read by
        :func:`fit_options`), a :class:`~numpyro_dppvi.FitSettings`, or a dict of ``fit_dppvi`` keyword options
        (``{"method": "dp_optimisation", "batch_size": 100, "privacy": Privacy(...)}``).
      num_datasets: ``K``. The standard error of a coverage near 0.9 is about ``0.3 / sqrt(K)`` for one coordinate
        a data set and smaller for many; 20 gives about 0.02-0.07.
      parameters: ``"prior"`` (simulation-based calibration over the prior: every parameter the prior allows) or
        ``"posterior"`` (the parametric bootstrap around a released fit: draws from ``settings``, which must then be
        a result; the widening it finds is the one that applies to that fit).
      rng_key: the check's key (parameter draws, simulated observations, and the simulated fits' keys, folded in
        per data set). None: a fresh key from the operating system; it must be None when ``covariates`` are
        private rows.
      simulate: ``simulate(rng_key, values, covariates_m) -> client data tuple`` for a model whose arguments are not
        ``(*covariates, *observations)`` (default :func:`simulate_client`).
      fit: ``fit(clients, rng_key=..., **options) -> DPPVIResult``; default :func:`~numpyro_dppvi.fit_dppvi` with
        ``model``. Give ``functools.partial(fit_global_vi, model)`` and its options to check another fit function.
      num_draws: ``L``, draws of each ``q`` behind the rank statistics.
      options: keyword options that replace those of ``settings`` (e.g. an ``optimizer`` a result does not hold).
      progress: print one line per data set.

    Returns:
      a :class:`CalibrationReport`.

    The simulated fits share their compiled programs with the fit that made ``settings`` (same model, shapes and
    settings: a second fit compiles nothing), so ``K`` fits cost about ``K`` second fits.
    """
    from .fit import fit_dppvi

    if parameters not in ("prior", "posterior"):
        raise ValueError(f"parameters must be 'prior' or 'posterior', got {parameters!r}")
    if int(num_datasets) != num_datasets or num_datasets < 2:
        raise ValueError(f"num_datasets must be an integer of at least 2 (a standard error needs two), got "
                         f"{num_datasets}")
    if parameters == "posterior" and not isinstance(settings, DPPVIResult):
        raise TypeError("parameters='posterior' draws from a released posterior: pass the fit's result as settings")
    if isinstance(settings, DPPVIResult):
        run_options = fit_options(settings)
    elif isinstance(settings, FitSettings):
        run_options = settings.options()
    elif isinstance(settings, Mapping):
        run_options = dict(settings)
    else:
        raise TypeError(f"settings must be a DPPVIResult, a FitSettings or a dict of fit_dppvi options, got "
                        f"{type(settings).__name__}")
    run_options.update(options or {})
    run_options.pop("rng_key", None)
    for name in ("checkpoint", "resume", "eval_data", "callback"):
        if run_options.pop(name, None) is not None:
            raise ValueError(f"calibration_check runs fits on simulated data: leave {name!r} out of its options")
    clients_x = _check_covariates(model, covariates)
    simulate = simulate or (lambda key, values, cov: simulate_client(model, cov, values, key))
    fit = fit or (lambda clients, **kw: fit_dppvi(model, clients, **kw))
    key = resolve_key(rng_key)
    observed = set(observation_names(model, clients_x[0]))
    sites, truths, results, data, failures, counted = None, [], [], [], [], {}
    z, p, ranks = [], [], []
    rng = np.random.default_rng(np.asarray(jax.random.key_data(jax.random.fold_in(key, 0x5BC))).ravel().tolist())
    for k in range(int(num_datasets)):
        k_theta, k_data, k_fit = jax.random.split(jax.random.fold_in(key, k), 3)
        if parameters == "prior":
            values = {n: v for n, v in prior_draw(model, clients_x[0], k_theta).items() if n not in observed}
        else:
            values = {n: np.asarray(v[0]) for n, v in settings.sample(1, k_theta).items()}
        clients = [simulate(jax.random.fold_in(k_data, m), values, cov) for m, cov in enumerate(clients_x)]
        if sites is None:  # the layout of the latents, from the first simulated client
            adapter = ModelAdapter(model, clients[0])
            sites = [s.name for s in adapter.sites]
        values = {s: values[s] for s in sites}
        truth_u = np.asarray(adapter.unconstrain(values), np.float64)
        truths.append(values)
        data.append(clients)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = fit(clients, rng_key=k_fit, **run_options)
            except (FitDiverged, NoValidUpdates) as error:
                result = None
                failures.append((k, f"{type(error).__name__}: {error}"))
        for name in {type(w.message).__name__ for w in caught if issubclass(w.category, Warning)}:
            counted[name] = counted.get(name, 0) + 1
        results.append(result)
        if result is None:
            inf = np.full(truth_u.shape, np.inf)
            z.append(inf), p.append(np.full(truth_u.shape, np.nan)), ranks.append(np.full(truth_u.shape, -1))
        else:
            zk, pk, rk = _standardised(result, truth_u, rng, int(num_draws))
            z.append(zk), p.append(pk), ranks.append(rk)
        if progress:
            print(f"calibration_check: data set {k + 1}/{num_datasets}"
                  f"{' failed' if result is None else ''}", flush=True)
    z, p, ranks = np.stack(z), np.stack(p), np.stack(ranks)
    split = lambda a: {s.name: a[:, s.offset:s.offset + s.size] for s in adapter.sites}
    return CalibrationReport(sites=sites, z=split(z), probabilities=split(p), ranks=split(ranks),
                             num_draws=int(num_draws), truths=truths, results=results, data=data, failures=failures,
                             warnings=counted, parameters=parameters, options=run_options)
