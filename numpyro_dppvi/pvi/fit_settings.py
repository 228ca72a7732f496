"""A fit's settings as one value: :class:`FitSettings` (the options as given), resolved by
:meth:`FitSettings.resolve` into :class:`ResolvedSettings` (the method's defaults filled in, every combination
checked), and completed by :meth:`ResolvedSettings.for_model` once the model is traced (the defaults that depend on
its latent dimension).

``FitSettings`` is frozen and holds only data-independent settings; ``fit_dppvi``'s keywords build it, and
``result.settings`` (:func:`numpyro_dppvi.simulation_calibration.fit_options` of its ``config``) gives it back, so
that one value runs the same fit again. :class:`~numpyro_dppvi.pvi.driver.DPPVI` takes its attributes from the
resolved value; the options and the errors are those documented on ``DPPVI``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from .. import factors
from ..optim import Newton, PrivateNewton
from ..privacy import Privacy
from .defaults import (DEFAULT_LOCAL_STEPS, DEFAULT_OPTIMIZER, DEFAULT_ROUNDS, METHOD_DEFAULTS, METHODS,
                       NEWTON_MAX_DIM, PRIVACY_UNITS, PRIVATE_NEWTON_DEFAULTS, UPDATE_METHODS,
                       VIRTUAL_FULL_RANK_DEFAULTS, default_schedule, did_you_mean, shards_of_batch)
from .server import SCHEDULES
from .shards import ROWS
from .update_perturbation import INVALID_RULES


class Combination(NamedTuple):
    """The options the refusals read (:data:`REFUSALS`): as given, but the family, schedule and privacy filled in
    (mean-field, the method's schedule, ``Privacy.resolved``); ``optimizer`` as given (None: the method's)."""

    method: str
    family: str
    optimizer: Any
    schedule: str
    privacy: Privacy | None
    privacy_unit: str
    trusted_aggregator: bool
    rank: int | None
    noise_aware: bool | None
    batch_size: int | None
    shards: Any
    auto_local_step: bool


class Refusal(NamedTuple):
    """One combination of options a fit refuses: ``when(c)`` of the :class:`Combination`, the exception class, and
    its message (a string, or a function of ``c``), which names the fix."""

    when: Callable[[Combination], bool]
    error: type
    message: str | Callable[[Combination], str]


def noise_aware_available(c: Combination) -> bool:
    """Whether a noise-aware posterior exists for these options: private DP optimisation with a mean-field or
    full-rank ``q`` and private Newton steps (given, or the default the model may choose), and private virtual
    clients with a mean-field or full-rank ``q``, each client releasing its own update."""
    newton = c.method == "dp_optimisation" and c.family in ("mean_field", "full_rank") \
        and (c.auto_local_step or isinstance(c.optimizer, PrivateNewton))
    release = c.method == "virtual_clients" and c.family in ("mean_field", "full_rank") \
        and not c.trusted_aggregator and c.privacy_unit == "example"
    return c.privacy is not None and (newton or release)


def _not_noise_aware(c: Combination) -> str:
    return (f"noise_aware=True is available for method='dp_optimisation' with family 'mean_field' or 'full_rank' "
            f"and optim.PrivateNewton local steps, and for method='virtual_clients' with family 'mean_field' or "
            f"'full_rank', each client releasing its own update (got method={c.method!r}, family={c.family!r}, "
            f"optimizer={type(c.optimizer).__name__ if c.optimizer is not None else None}"
            f"{', trusted_aggregator=True' if c.trusted_aggregator else ''}"
            f"{', privacy_unit=' + repr(c.privacy_unit) if c.privacy_unit != 'example' else ''}"
            f"{'' if c.privacy is not None else ', no privacy'}); leave noise_aware out (None) to use it where it "
            "is available, or pass optimizer=optim.PrivateNewton()")


#: The combinations of options a fit refuses, in the order they are checked: the one table the simulation
#: (``fit_dppvi``, ``DPPVI``) and the Flower nodes (``LocalSettings.check_method``) decide by.
REFUSALS = (
    Refusal(lambda c: c.rank is not None and c.family != "low_rank", ValueError,
            lambda c: f"rank= sets the rank of family='low_rank'; family={c.family!r} has none"),
    Refusal(lambda c: c.method == "dp_optimisation" and isinstance(c.optimizer, Newton), ValueError,
            "method='dp_optimisation' takes an optax optimizer on the privatised gradients (optim.Newton needs the "
            "Hessians of the data, which DP-SGD does not release); with family='full_rank' it moves the mean and the "
            "Cholesky factor of the covariance"),
    Refusal(lambda c: c.family == "low_rank" and c.method == "virtual_clients", ValueError,
            "family='low_rank' is not available with virtual clients: a virtual factor written in the shared rank-r "
            "basis loses its own directions, and its cavity double-counts them; kept in a basis of its own, the part "
            "of its change outside the shared basis is released again every round (measured at negligible noise on "
            "a 0.95-correlated regression, rank 1: sds 2-4x and 1.3-2x the exact ones, means 4-140 sd off); take "
            "family='full_rank' or 'mean_field', or method='local_averaging'"),
    Refusal(lambda c: c.family in ("full_rank", "low_rank") and c.method != "dp_optimisation"
            and c.optimizer is not None and not isinstance(c.optimizer, Newton), ValueError,
            lambda c: f"family={c.family!r} takes Newton steps with exact expected Hessians: pass "
                      "optimizer=optim.Newton(precision_step=...) or leave optimizer out (optax transformations act "
                      "on the (loc, log_scale) of a mean-field q)"),
    Refusal(lambda c: c.family == "mean_field" and isinstance(c.optimizer, Newton), ValueError,
            "optim.Newton is the local step of family='full_rank'; pass family='full_rank' or an optax optimizer"),
    Refusal(lambda c: isinstance(c.optimizer, PrivateNewton) and (c.method != "dp_optimisation"
                                                                 or c.family == "low_rank"), ValueError,
            "optim.PrivateNewton is the local step of method='dp_optimisation' with family 'mean_field' or "
            "'full_rank'; leave optimizer out for the method's default"),
    Refusal(lambda c: bool(c.noise_aware) and not noise_aware_available(c), ValueError, _not_noise_aware),
    Refusal(lambda c: c.method == "dp_optimisation" and c.privacy is None, TypeError,
            "method='dp_optimisation' needs privacy=dppvi.Privacy(...) (a budget or a noise multiplier)"),
    Refusal(lambda c: c.method == "dp_optimisation" and c.batch_size is None, ValueError,
            "method='dp_optimisation' needs a batch_size (the expected batch of each DP-SGD step, e.g. "
            "batch_size=100: its sampling rate batch_size / n_m enters the accounting)"),
    Refusal(lambda c: c.method == "dp_optimisation" and c.trusted_aggregator, ValueError,
            "a trusted aggregator does not help DP optimisation (each step's noise is local); use an "
            "update-perturbation method or trusted_aggregator=False"),
    Refusal(lambda c: c.privacy is not None and c.privacy.adaptive_clip is not None
            and c.method != "dp_optimisation", ValueError,
            "adaptive clipping applies to per-example gradient clipping: use method='dp_optimisation' or a fixed clip"),
    Refusal(lambda c: c.method == "pvi" and c.privacy is not None and c.privacy_unit != "client", ValueError,
            "method='pvi' is not private at the example level; use method='dp_optimisation' or an "
            "update-perturbation method, or privacy_unit='client' for client-level DP"),
    Refusal(lambda c: c.privacy_unit == "client" and (c.method != "pvi" or c.privacy is None
                                                      or c.schedule != "synchronous"), ValueError,
            "client-level DP needs method='pvi', schedule='synchronous' and privacy=Privacy(...)"),
    Refusal(lambda c: c.trusted_aggregator and (c.method not in UPDATE_METHODS or c.schedule != "synchronous"
                                                or c.privacy is None), ValueError,
            f"trusted_aggregator=True needs a private update-perturbation method {UPDATE_METHODS} with "
            "schedule='synchronous'"),
    Refusal(lambda c: c.method == "local_averaging" and c.shards is None and c.batch_size is None, ValueError,
            "method='local_averaging' needs shards= (\"rows\", an int, or a function of the client size) or a "
            "batch_size (then each client has ceil(n_m / batch_size) shards)"),
    Refusal(lambda c: c.method == "parameter_perturbation" and c.shards not in (None, 1)
            and not (isinstance(c.shards, tuple) and set(c.shards) == {1}), ValueError,
            "parameter perturbation uses one shard; use local_averaging for more"),
)


@dataclass(frozen=True)
class FitSettings:
    """The options of a DP-PVI fit as given; ``None`` leaves an option to the method's default.

    The fields are the options of :func:`~numpyro_dppvi.fit_dppvi` and :class:`~numpyro_dppvi.pvi.driver.DPPVI` (the
    room of their defaults and refusals); ``rounds`` is the planned number of rounds.

    Args:
      method: ``"pvi"`` (non-private local steps, the default), ``"dp_optimisation"`` (DP-SGD in the local step),
          ``"local_averaging"``, ``"virtual_clients"`` or ``"parameter_perturbation"`` (privacy by
          perturbing model updates; without ``privacy`` they run without clipping or noise).
      schedule: ``"sequential" | "synchronous" | "asynchronous"``; default sequential for ``"pvi"`` and
          ``"dp_optimisation"``, synchronous for the update-perturbation methods, a trusted aggregator
          and client-level DP (:data:`~numpyro_dppvi.pvi.defaults.METHOD_DEFAULTS`).
      optimizer: an optax ``GradientTransformation`` for the local steps, or
          :class:`~numpyro_dppvi.optim.Newton` (``"full_rank"`` and ``"low_rank"`` families) or
          :class:`~numpyro_dppvi.optim.PrivateNewton` (DP optimisation). Default: ``optim.cvi()`` for ``"pvi"``,
          ``natural_gradient(0.5)`` for virtual clients, ``optim.Newton()`` for the full-rank and low-rank
          families (but DP optimisation), for DP optimisation ``optim.PrivateNewton()`` on models of up to
          :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent dimensions (mean-field or full-rank ``q``,
          ``noise_aware`` not False) and ``adam(1e-2)`` above, ``adam(1e-2)`` otherwise.
      local_steps: optimiser steps per client (per shard for update perturbation) per round (default
          20 for ``"pvi"`` and for DP optimisation's private Newton steps, 10 otherwise).
      batch_size: rows per local step (``None``: the client's whole data). DP optimisation requires it: the
          expected Poisson batch (or the fixed batch without replacement), whose sampling rate ``batch_size / n_m``
          the accounting amplifies by, so that it trades noise per step against steps per budget and is yours to
          choose (100-200 rows on the benchmarks' clients of 200-6,700 rows, docs/guide.md §4). Local averaging
          without ``shards`` splits each client into ``ceil(n_m / batch_size)`` shards.
      num_samples: Monte Carlo draws of ``q`` per step, shared across the batch. Default 10.
      damping: ``rho`` in ``t_m <- t_m + rho (q_new - q)``, in ``(0, 1]``. Default 1, but 0.5 for DP optimisation
          with an optax optimizer, 0.1 for virtual clients (0.25 with their noise-aware full-rank factors).
      server_steps: steps of the server's prior-factor refinement per round (non-Gaussian priors). Default 50.
      privacy: a :class:`~numpyro_dppvi.privacy.Privacy`; None (the default): not private. Required by
          ``"dp_optimisation"`` and client-level DP; not allowed with ``"pvi"`` at the example level.
      rounds: the planned number of rounds; needed to calibrate the noise to a budget, and the default of
          :meth:`DPPVI.run <numpyro_dppvi.pvi.driver.DPPVI.run>`'s ``rounds``.
      shards: local partitions per client for update perturbation: ``"rows"`` (one record per
          shard; the default of ``virtual_clients``), an int, ``f(n_m) -> int``, or one int per client (records are
          assigned by a keyed hash of their own values, see :mod:`numpyro_dppvi.pvi.shards`). Parameter
          perturbation uses one shard.
      invalid: rule for noisy updates with a non-positive precision (update perturbation, client-level DP):
          ``"reject"`` (the update is not applied) or ``"floor"`` (every precision of the proposal raised to at
          least ``precision_floor``). Default ``"floor"`` for virtual clients and local averaging, ``"reject"``
          otherwise.
      precision_floor: the precision floor of ``invalid="floor"``. Default 1 (a standard-normal prior's
          precision) for virtual clients and local averaging, 1e-3 otherwise.
      trusted_aggregator: synchronous update perturbation where each participating client adds a
          share of the noise and only the sum is revealed, so that the noise of the sum is that of one
          client's release (needs a private update-perturbation method). Default False.
      privacy_unit: ``"example"`` (default) or ``"client"`` (client-level DP, synchronous,
          ``method="pvi"`` local steps; clients sampled with probability ``client_rate``).
      client_rate: client-level DP: the probability, in ``(0, 1]``, with which each client takes part in a
          round (Poisson sampling of clients, which needs ``Privacy(sampling="poisson")`` below 1). Default 1:
          every client every round.
      tail_average: the share, in ``[0, 1)``, of the last local iterates whose mean is the client's answer (default
          0.5 for ``"pvi"`` and for DP optimisation's private Newton steps, 0 otherwise;
          :func:`~numpyro_dppvi.pvi.local.optimise`).
      family: the Gaussian family of ``q`` and of every factor:

          * ``"mean_field"`` (independent coordinates, ``O(D)`` per factor) is the default. Left out, non-private
            PVI (``method="pvi"`` without ``privacy``) without an ``optimizer`` takes ``"full_rank"`` with
            :class:`~numpyro_dppvi.optim.Newton` steps once the model is traced if it has at most
            :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent dimensions (mean-field understates
            correlated sds and crosses their ridges slowly; docs/guide.md §3); private virtual clients without an
            ``optimizer``, each client releasing its own update (no trusted
            aggregator, example-level privacy) with a noise-aware posterior, take ``"full_rank"`` once the
            model is traced if it has at most :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent
            dimensions, and with it damping 0.25, 20 planned rounds when ``fit_dppvi`` chose the rounds
            (:data:`~numpyro_dppvi.pvi.defaults.VIRTUAL_FULL_RANK_DEFAULTS`) and, unless ``Privacy.clip`` is
            given, a clip from the calibrated noise and the planned shards
            (:func:`~numpyro_dppvi.pvi.defaults.virtual_clip`); options you set are kept.
          * ``"full_rank"``: a full precision matrix, ``O(D^2)`` memory per client and ``O(D^3)`` per step; local
            steps by :class:`~numpyro_dppvi.optim.Newton`, :mod:`~numpyro_dppvi.pvi.full_rank`. Mean-field
            under-states the sds of correlated posteriors (docs/guide.md, "Choosing the family").
            ``"full_rank"`` is available without privacy (``method="pvi"``, :func:`fit_global_vi`, :func:`fit_bcm`)
            and with every private method: update perturbation (with or without a trusted aggregator) and
            client-level DP release a clipped change of the whole precision matrix with symmetric noise
            (:func:`~numpyro_dppvi.pvi.update_perturbation.release_change`); DP optimisation moves the mean and
            the Cholesky factor of the covariance with an optax optimizer
            (:func:`~numpyro_dppvi.factors.to_params`). A private release has ``D (D + 3) / 2`` noise
            coordinates (mean-field ``2 D``).
          * ``"low_rank"`` with ``rank=r``: a diagonal plus rank-``r`` precision in one public basis shared by
            ``q`` and every factor (:mod:`~numpyro_dppvi.pvi.low_rank`); ``method="pvi"`` (Newton steps),
            ``"dp_optimisation"`` (parameters ``(loc, log s, W)``, ``2 D + D r`` noise coordinates), parameter
            perturbation and local averaging (with or without a trusted aggregator) and client-level DP
            (releases in the public basis, ``2 D + r (r + 1) / 2 + (D - r) r`` noise coordinates),
            :func:`fit_global_vi`, :func:`fit_bcm` and the Flower deployment; not virtual clients. ``r = D`` is
            the full-rank fit.
      rank: the rank ``r`` of ``family="low_rank"``, a positive integer (default ``round(sqrt(D))``); only with
          that family.
      noise_aware: whether the result's ``q`` accounts for the uncertainty the privacy noise leaves in the fit
          (post-processing of the releases, no privacy cost; ``result.q_fitted`` is ``q`` as fitted). None (the
          default): wherever it is available, that is private DP optimisation with a mean-field or full-rank
          ``q`` and :class:`~numpyro_dppvi.optim.PrivateNewton` local steps (the default without an
          ``optimizer`` up to :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent dimensions;
          :mod:`~numpyro_dppvi.pvi.noise_aware`), and private virtual clients with a mean-field or full-rank
          ``q``, each client releasing its own update (:mod:`~numpyro_dppvi.pvi.release_noise`). True: insist
          (an error where it is not available). False: ``q`` as fitted, and DP optimisation without an
          ``optimizer`` takes the optax step.
    """

    method: str = "pvi"
    schedule: str | None = None
    optimizer: Any = None
    local_steps: int | None = None
    batch_size: int | None = None
    num_samples: int = 10
    damping: float | None = None
    server_steps: int = 50
    privacy: Privacy | None = None
    rounds: int | None = None
    shards: Any = None
    invalid: str | None = None
    precision_floor: float | None = None
    trusted_aggregator: bool = False
    privacy_unit: str = "example"
    client_rate: float = 1.0
    tail_average: float | None = None
    family: str | None = None
    rank: int | None = None
    noise_aware: bool | None = None

    def __post_init__(self):
        self.resolve()  # a value that cannot be resolved is refused where it is made, with the error that names the fix

    def options(self) -> dict:
        """These settings as keyword options of :func:`~numpyro_dppvi.fit_dppvi` (``rounds`` included)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def replace(self, **changes) -> "FitSettings":
        """A copy with ``changes`` (``settings.replace(rounds=20)``), checked as a new value is."""
        unknown = set(changes) - {field.name for field in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"FitSettings has no option(s) {sorted(unknown)}; its options are "
                            f"{[field.name for field in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    def resolve(self) -> "ResolvedSettings":
        """These settings with the method's defaults filled in (:data:`~.defaults.METHOD_DEFAULTS`), after checking
        every value and then every combination (:data:`REFUSALS`, in order; the errors name the fix). The
        defaults that depend on the traced model are left to :meth:`ResolvedSettings.for_model`."""
        method, schedule, optimizer, local_steps = self.method, self.schedule, self.optimizer, self.local_steps
        batch_size, num_samples, damping, server_steps = self.batch_size, self.num_samples, self.damping, self.server_steps
        privacy, rounds, shards, invalid, precision_floor = self.privacy, self.rounds, self.shards, self.invalid, \
            self.precision_floor
        trusted_aggregator, privacy_unit, client_rate = self.trusted_aggregator, self.privacy_unit, self.client_rate
        tail_average, family, rank, noise_aware = self.tail_average, self.family, self.rank, self.noise_aware
        if isinstance(shards, list):  # one count per client (a result's config), kept hashable
            shards = tuple(shards)
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}{did_you_mean(method, METHODS)}; choose one of {METHODS}")
        # virtual clients and non-private PVI without a family or optimizer: the family is chosen by the model's
        # dimension once the model is traced (ResolvedSettings.for_model); mean-field until then and for every
        # other method
        auto_family = family is None and optimizer is None and (
            method == "virtual_clients" or (method == "pvi" and privacy is None))
        family = "mean_field" if family is None else family
        factors.check_family(family, "DPPVI")
        if rank is not None and (int(rank) != rank or rank < 1 or isinstance(rank, bool)):
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        schedule = default_schedule(method, trusted_aggregator, privacy_unit) if schedule is None else schedule
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}{did_you_mean(schedule, SCHEDULES)}; choose one of {SCHEDULES}")
        if privacy_unit not in PRIVACY_UNITS:
            raise ValueError(f"unknown privacy_unit {privacy_unit!r}; choose one of {PRIVACY_UNITS}")
        if privacy is not None and not isinstance(privacy, Privacy):
            raise TypeError("privacy must be dppvi.Privacy(...) or None")
        if privacy is not None:  # adaptive_clip="auto": adaptive where per-example gradients are clipped
            privacy = privacy.resolved(per_example=method == "dp_optimisation")
        # DP optimisation with a mean-field or full-rank q and no optimizer: the local step is chosen by the model's
        # dimension once the model is traced (dp_optimisation_local_step)
        auto_local_step = method == "dp_optimisation" and optimizer is None and family in ("mean_field", "full_rank")
        combination = Combination(method, family, optimizer, schedule, privacy, privacy_unit, trusted_aggregator,
                                  rank, noise_aware, batch_size, shards, auto_local_step)
        for refusal in REFUSALS:
            if refusal.when(combination):
                raise refusal.error(refusal.message(combination) if callable(refusal.message) else refusal.message)
        defaults = METHOD_DEFAULTS.get(method, {})
        if family in ("full_rank", "low_rank") and optimizer is None and method != "dp_optimisation":
            optimizer = Newton()
        if isinstance(optimizer, PrivateNewton):
            defaults = dict(defaults, **PRIVATE_NEWTON_DEFAULTS)
        optimizer = defaults.get("optimizer", DEFAULT_OPTIMIZER) if optimizer is None else optimizer
        local_steps = defaults.get("local_steps", DEFAULT_LOCAL_STEPS) if local_steps is None else local_steps
        damping = defaults.get("damping", 1.0) if damping is None else damping
        invalid = defaults.get("invalid", "reject") if invalid is None else invalid
        precision_floor = defaults.get("precision_floor", 1e-3) if precision_floor is None else precision_floor
        tail_average = defaults.get("tail_average", 0.0) if tail_average is None else tail_average
        if invalid not in INVALID_RULES:
            raise ValueError(f"unknown invalid-update rule {invalid!r}; choose one of {INVALID_RULES}")
        if method == "virtual_clients" and shards is None:
            shards = ROWS
        if method == "local_averaging" and shards is None:
            shards = functools.partial(shards_of_batch, int(batch_size))
        if method == "parameter_perturbation":
            shards = 1
        positive = lambda k: isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 1
        if shards is not None and not (shards == ROWS or callable(shards) or positive(shards)
                                       or (isinstance(shards, tuple) and shards and all(map(positive, shards)))):
            raise ValueError(f"shards must be 'rows', a positive int, a function n_m -> int or one positive int per "
                             f"client, got {shards!r}")
        if rounds is not None and (int(rounds) != rounds or rounds < 1):
            raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
        if not (0.0 < float(damping) <= 1.0):
            raise ValueError(f"damping must be in (0, 1], got {damping}")
        for name, value in (("local_steps", local_steps), ("num_samples", num_samples), ("server_steps", server_steps)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= float(tail_average) < 1.0:
            raise ValueError(f"tail_average must be in [0, 1) (the share of the last local iterates averaged), "
                             f"got {tail_average}")
        if batch_size is not None and (int(batch_size) != batch_size or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        supported = noise_aware_available(combination)
        return ResolvedSettings(
            given=self, method=method, schedule=schedule, optimizer=optimizer, local_steps=int(local_steps),
            batch_size=None if batch_size is None else int(batch_size), num_samples=int(num_samples),
            damping=float(damping), server_steps=int(server_steps), privacy=privacy,
            planned_rounds=None if rounds is None else int(rounds), shards=shards, invalid=invalid,
            precision_floor=float(precision_floor), trusted_aggregator=bool(trusted_aggregator),
            privacy_unit=privacy_unit, client_rate=float(client_rate), tail_average=float(tail_average),
            family=family, rank=None if rank is None else int(rank),
            noise_aware=supported if noise_aware is None else bool(noise_aware), auto_family=auto_family,
            auto_local_step=auto_local_step)


@dataclass(frozen=True)
class ResolvedSettings:
    """A fit's settings with every default the options decide filled in (:meth:`FitSettings.resolve`).

    The fields are :class:`~numpyro_dppvi.pvi.driver.DPPVI`'s attributes of the same names; ``given`` is the
    :class:`FitSettings` they were resolved from; ``auto_family`` and ``auto_local_step`` say that the family or DP
    optimisation's local step are still to be chosen by the model's dimension (:meth:`for_model`).
    """

    given: FitSettings
    method: str
    schedule: str
    optimizer: Any
    local_steps: int
    batch_size: int | None
    num_samples: int
    damping: float
    server_steps: int
    privacy: Privacy | None
    planned_rounds: int | None
    shards: Any
    invalid: str
    precision_floor: float
    trusted_aggregator: bool
    privacy_unit: str
    client_rate: float
    tail_average: float
    family: str
    rank: int | None
    noise_aware: bool
    auto_family: bool
    auto_local_step: bool

    @property
    def virtual_full_rank(self) -> bool:
        """Virtual clients with full-rank factors and a noise-aware posterior: the fits
        :data:`~.defaults.VIRTUAL_FULL_RANK_DEFAULTS` and :func:`~.defaults.virtual_clip` are measured for."""
        return self.method == "virtual_clients" and self.family == "full_rank" and self.noise_aware

    def for_model(self, dim: int, auto_rounds: bool = False) -> "ResolvedSettings":
        """These settings completed by the traced model's latent dimension ``D``: DP optimisation's local step
        (:func:`dp_optimisation_local_step`), virtual clients' family, damping and rounds
        (:func:`virtual_clients_defaults`; ``auto_rounds``: ``fit_dppvi`` left the rounds to the method) and
        non-private PVI's family (:func:`pvi_family`). Options the caller set are kept."""
        out = self
        if out.auto_local_step:
            out = dp_optimisation_local_step(out, dim)
        if out.method == "virtual_clients":
            out = virtual_clients_defaults(out, dim, auto_rounds)
        if out.method == "pvi":
            out = pvi_family(out, dim)
        return out


def virtual_clients_defaults(s: ResolvedSettings, dim: int, auto_rounds: bool) -> ResolvedSettings:
    """Virtual clients' defaults by the model's dimension ``D`` (issue 23). Without a family or optimizer, up to
    :data:`~.defaults.NEWTON_MAX_DIM` latents, each client releasing its own update and the posterior noise-aware:
    full-rank factors with Newton steps (the full precision holds the curvature whose lack makes mean-field
    intervals miss, ``pvi.release_noise`` eq. 3); above it, with a trusted aggregator or ``noise_aware=False``,
    mean-field with the method's defaults. A noise-aware full-rank fit then takes
    :data:`~.defaults.VIRTUAL_FULL_RANK_DEFAULTS` (20 rounds when ``fit_dppvi`` chose the rounds, damping 0.25) and,
    unless ``Privacy.clip`` was given, :func:`~.defaults.virtual_clip` (set once the shards are laid out)."""
    if s.auto_family and dim <= NEWTON_MAX_DIM and s.noise_aware:
        s = dataclasses.replace(s, family="full_rank", optimizer=Newton())
    if s.virtual_full_rank and s.given.damping is None:
        s = dataclasses.replace(s, damping=float(VIRTUAL_FULL_RANK_DEFAULTS["damping"]))
    if auto_rounds and s.planned_rounds is None:
        s = dataclasses.replace(s, planned_rounds=int(VIRTUAL_FULL_RANK_DEFAULTS["rounds"]) if s.virtual_full_rank
                                else DEFAULT_ROUNDS)
    return s


def pvi_family(s: ResolvedSettings, dim: int) -> ResolvedSettings:
    """Non-private PVI's family by the model's dimension ``D`` (issue 59): without a family or optimizer,
    full-rank factors with :class:`~numpyro_dppvi.optim.Newton` steps up to :data:`~.defaults.NEWTON_MAX_DIM`
    latents, mean-field (:data:`~.defaults.LOCAL_OPTIMIZER`) above. A mean-field ``q`` states a correlated
    posterior's marginal sds as ``1 / sqrt(diag(Lambda))`` and crosses its ridges one coordinate at a time: on the
    calibration zoo's non-centred hierarchical Poisson regression (13 latents, 2,000 rows, 5 clients) mean-field
    fits ended 0.45-3.1 NUTS sd from NUTS with sds 4-65% of NUTS's, two of five still drifting after 100 rounds;
    full-rank fits of the same data converged in 20-28 rounds, 0.15-0.29 NUTS sd from NUTS, sds 28-91% of NUTS's;
    over the zoo's nine models the worst gap went from 3.15 to 0.26 NUTS sd (benchmarks/results/calibration_zoo.json,
    its pvi cells against ``pvi_mean_field_before_issue_59``). Above ``NEWTON_MAX_DIM`` the ``O(|B| D^2)`` Hessians
    of a step cost more than the rounds they save (Adult's 110 coordinates: 97-287 s a fit)."""
    if s.auto_family and dim <= NEWTON_MAX_DIM:
        return dataclasses.replace(s, family="full_rank", optimizer=Newton())
    return s


def dp_optimisation_local_step(s: ResolvedSettings, dim: int) -> ResolvedSettings:
    """DP optimisation's local step when no optimizer is given, by the model's dimension ``D``
    (:data:`~.defaults.NEWTON_MAX_DIM`): :class:`~numpyro_dppvi.optim.PrivateNewton` with the noise-aware answer
    (damping 1, :mod:`.noise_aware`) up to it; above it, or with ``noise_aware=False``, the optax default with
    damping 0.5 and the last iterate as the answer (the method's defaults), ``q`` as fitted. (Newton points of the
    plain, unshrunk factor estimates are thrown about by the noise: measured on the coverage study at epsilon 1,
    2,000 rows, a posterior mean's RMSE of 12 against 0.22 noise-aware and 0.32 with the optax step,
    benchmarks/results/coverage.json.)"""
    given = s.given
    newton = dim <= NEWTON_MAX_DIM and given.noise_aware is not False
    if given.noise_aware and not newton:
        raise ValueError(f"noise_aware=True needs optim.PrivateNewton local steps, which are the default up to "
                         f"{NEWTON_MAX_DIM} latent dimensions (this model has {dim}): pass "
                         "optimizer=optim.PrivateNewton() to use them anyway, or leave noise_aware out")
    chosen = PRIVATE_NEWTON_DEFAULTS if newton else METHOD_DEFAULTS["dp_optimisation"]
    changes = {"optimizer": PrivateNewton() if newton else DEFAULT_OPTIMIZER}
    if given.damping is None:
        changes["damping"] = float(chosen["damping"])
    if given.tail_average is None:
        changes["tail_average"] = float(chosen["tail_average"])
    if given.local_steps is None:
        changes["local_steps"] = int(chosen.get("local_steps", DEFAULT_LOCAL_STEPS))
    if given.noise_aware is None:
        changes["noise_aware"] = newton and s.privacy is not None
    return dataclasses.replace(s, **changes)
