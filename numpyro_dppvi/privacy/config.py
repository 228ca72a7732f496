"""Privacy: what the user asks for, and the conversions the engine needs.

Give a budget and the noise is calibrated for the planned run::

    Privacy(epsilon=1.0, delta=1e-5, clip=1.0)

or give the noise and read epsilon from the fit's ledger::

    Privacy(noise_multiplier=1.1, delta=1e-5, clip=1.0)

``noise_multiplier`` is always the user-facing DP-SGD convention **noise std / clip** (``C``).
Internally, events carry std / sensitivity, which is the same under add/remove and half of it
under substitution (a replaced record moves a clipped sum by ``2C``); :meth:`Privacy.to_event`
and :meth:`Privacy.from_event` convert.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Real
from typing import Callable, Sequence

import numpy as np

from . import backends
from .adaptive_clip import AdaptiveClip, count_sensitivity, split_noise_multiplier
from .calibration import calibrate_noise, is_solved, plan_charges, plan_epsilon
from .events import GaussianEvent, check_neighbouring, sensitivity
from .ledger import PrivacyLedger
from .sizes import validated_public_sizes

_SAMPLERS = ("poisson", "without_replacement")


def _optional_positive(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number or None, got {type(value).__name__}.")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}.")
    return value


class _DefaultClip(float):
    """The clip a :class:`Privacy` holds when ``clip`` is left out: 1.0 for every purpose, and recognisable as not
    chosen (:attr:`Privacy.clip_chosen`), so that a method with a rule of its own (virtual clients with full-rank
    factors, :func:`~numpyro_dppvi.pvi.defaults.virtual_clip`) may replace it before anything is released."""

    def __repr__(self):
        return "1.0"

    def __reduce__(self):
        return (_DefaultClip, (float(self),))


#: ``Privacy.clip`` when it is left out (1.0).
DEFAULT_CLIP = _DefaultClip(1.0)


#: The clipping of per-example gradients when none is chosen (``Privacy(adaptive_clip="auto")``): Andrew et al.'s
#: private quantile estimate at the 0.999 quantile of the norms. First set at 0.98 on the coverage study's logistic
#: regression (``benchmarks/coverage.py``, DP optimisation): 90% intervals cover 0.82-0.92 with it and with a fixed
#: clip near the norms' 0.99 quantile (3), against 0.14-0.24 at the fixed clip 1 (0.75 of the norms below it: the
#: clipped likelihood's optimum 3-12 posterior sds away). Raised to 0.999 on the calibration zoo
#: (``benchmarks/results/auto_clip_0999.json``, same seeds): the likelihoods with heavy-tailed per-example
#: gradients (Gamma, negative binomial, censored Weibull) keep a clipping bias at 0.98 (90% coverage at 10,000 rows
#: and epsilon 8: 0.74 / 0.71 / 0.66, against 0.81 / 0.81 / 0.73 at 0.999); single-level zoo cells in the bar or
#: whose unflagged fits cover go from 9 to 12 of 20, none lost; coverage.py's DP optimisation and global DP-VI
#: cells stay at 0.867-0.907 (90%) and 0.40-0.54 (50%), with sds up to 34% wider and RMSE 5-35% larger where the
#: logistic gradients are bounded and the larger clip only adds noise. Within a fit the clip does not reach the
#: 0.999 quantile (it grows at ``0.2 x (0.999 - F(C))`` a step, ``F`` the norms' distribution): the heavy-tailed
#: intercepts stay biased. A rate of 1 reaches it and covers them, but the clip then random-walks above the quantile
#: where the norms are bounded (sds 1.2-7x on coverage.py; ``benchmarks/results/auto_clip_rate.json``): not adopted.
AUTO_CLIP = AdaptiveClip(target_quantile=0.999, noise_scaled_rate=True)

#: Share of a budget's delta kept for the charges the samplers' coupling arguments add to the
#: accountant's delta (:meth:`Privacy.accounting_delta`): 1% costs about 0.1-0.3% more noise.
DELTA_RESERVE = 0.01


def _delta_less(delta: float, kept: float) -> float:
    """``delta - kept``, rounded down so that it plus ``kept`` never exceeds ``delta`` in floating point."""
    accounting = delta - kept
    while accounting > 0.0 and accounting + kept > delta:
        accounting = math.nextafter(accounting, 0.0)
    return accounting


def budget_delta(delta: float) -> float:
    """``(1 - DELTA_RESERVE) delta``, rounded down so that it plus the reserve never exceeds ``delta``."""
    return _delta_less(delta, DELTA_RESERVE * delta)


@dataclass(frozen=True)
class Privacy:
    """Differential-privacy settings of a fit.

    Attributes:
      epsilon: total budget per client (the fit's overall guarantee is the max over clients).
        Give this *or* ``noise_multiplier`` (both: the noise is used and checked to meet it).
      delta: target delta in (0, 1).
      clip: L2 clip norm ``C`` of per-example gradients (or updates) > 0. Left out: 1.0 (:data:`DEFAULT_CLIP`),
        except for virtual clients with full-rank factors, which choose it from the noise and the planned shards
        (:func:`~numpyro_dppvi.pvi.defaults.virtual_clip`; the fit's ``config`` says which).
      noise_multiplier: noise std / ``C`` (user-facing DP-SGD convention).
      sampling: ``"poisson"`` (padded Poisson batches, default) or ``"without_replacement"``
        (fixed-size batches drawn afresh each step; needs ``neighbouring="substitute"``).
      neighbouring: ``"add_remove"`` (default) or ``"substitute"``.
      accountant: ``"pld"`` (default), ``"rdp"`` or ``"autodp"``.
      epsilon_max: per-client stop rule: a float for all clients or one value per client; a
        client whose next step would exceed it stops contributing.
      adaptive_clip: :class:`AdaptiveClip` settings, None for a fixed clip ``clip``, or ``"auto"`` (default):
        :data:`AUTO_CLIP` where the clip applies to per-example gradients (DP optimisation, global DP-VI; it
        starts at ``clip``), a fixed clip elsewhere (update perturbation, client-level DP, VIPS, Flower nodes).
        A fixed clip below most per-example norms biases the posterior and the bias does not shrink with the
        data (issue 23: a logistic regression's weights 3-12 posterior sds off at clip 1); tracking a high
        quantile keeps few clipped at a noise that follows the norms (docs/privacy.md, "Clipping").
      public_sizes: a public upper bound on each client's number of rows (one int for all, or one
        per client). Every setting derived from a size (sampling rates, the sampler's charges, shard
        counts, scales, shapes) is then computed from it, so nothing published depends on a private
        size (:mod:`~numpyro_dppvi.privacy.sizes`). None: the observed sizes (public by definition
        under substitute; disclosed, with a warning, under add/remove).

    Examples:
        A budget, with the defaults for everything else; the noise is calibrated by the fit:

        >>> from numpyro_dppvi import Privacy
        >>> privacy = Privacy(epsilon=1.0, delta=1e-5, clip=2.0)
        >>> privacy.sampling, privacy.neighbouring, privacy.accountant
        ('poisson', 'add_remove', 'pld')

        The sensitivity of a clipped sum is the clip under add/remove, twice it under substitute:

        >>> privacy.sensitivity
        2.0
        >>> Privacy(epsilon=1.0, clip=2.0, neighbouring="substitute").sensitivity
        4.0

        A fixed noise instead of a budget (epsilon is then read from the ledger); one of the two is
        required:

        >>> Privacy(noise_multiplier=1.1).epsilon is None
        True
        >>> Privacy(clip=1.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: give a budget (epsilon=...) to calibrate the noise, or a noise_multiplier ...
    """

    epsilon: float | None = None
    delta: float = 1e-5
    clip: float = DEFAULT_CLIP
    noise_multiplier: float | None = None
    sampling: str = "poisson"
    neighbouring: str = "add_remove"
    accountant: str = "pld"
    epsilon_max: float | Sequence[float] | None = None
    adaptive_clip: AdaptiveClip | None | str = "auto"
    public_sizes: int | Sequence[int] | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "epsilon", _optional_positive("epsilon", self.epsilon))
        set_(self, "noise_multiplier",
             _optional_positive("noise_multiplier", self.noise_multiplier))
        if self.epsilon is None and self.noise_multiplier is None:
            raise ValueError(
                "give a budget (epsilon=...) to calibrate the noise, or a noise_multiplier "
                "(noise std / clip) to read epsilon from the ledger."
            )
        set_(self, "delta", backends.check_delta(self.delta))
        if not isinstance(self.clip, _DefaultClip):
            set_(self, "clip", _optional_positive("clip", self.clip))
        if self.clip is None:
            raise ValueError("clip must be a finite number > 0.")
        if self.sampling not in _SAMPLERS:
            raise ValueError(f"sampling={self.sampling!r} is not known; use one of {_SAMPLERS}.")
        check_neighbouring(self.neighbouring)
        backends.check_backend(self.accountant)
        if self.sampling == "without_replacement" and self.neighbouring != "substitute":
            raise ValueError(
                "sampling='without_replacement' is accounted under neighbouring='substitute' "
                "only; set neighbouring='substitute' or use sampling='poisson'."
            )
        # fail now, not after training, if the backend cannot account this sampler
        backends.check_supported(
            [GaussianEvent(1.0, self.sampling, 0.5)], self.neighbouring, self.accountant
        )
        if self.noise_multiplier is not None and self.accountant == "pld":  # fail now, not at the report
            backends.check_pld_size([(self.noise_multiplier, "poisson", 0.5, 1)], self.neighbouring,
                                    backends.PLD_DISCRETIZATION)
        set_(self, "epsilon_max", self._validated_epsilon_max(self.epsilon_max))
        set_(self, "public_sizes", validated_public_sizes(self.public_sizes))
        if self.adaptive_clip is not None and self.adaptive_clip != "auto" and not isinstance(self.adaptive_clip,
                                                                                                  AdaptiveClip):
            raise TypeError("adaptive_clip must be an AdaptiveClip(...), None (a fixed clip) or 'auto'.")

    def resolved(self, per_example: bool) -> "Privacy":
        """This config with ``adaptive_clip="auto"`` made concrete: :data:`AUTO_CLIP` when the clip applies to
        per-example gradients (``per_example``), a fixed clip otherwise."""
        if self.adaptive_clip != "auto":
            return self
        return dataclasses.replace(self, adaptive_clip=AUTO_CLIP if per_example else None)

    @property
    def clip_chosen(self) -> bool:
        """Whether ``clip`` was given (``Privacy(clip=1.0)`` is chosen; ``Privacy()`` holds :data:`DEFAULT_CLIP`)."""
        return not isinstance(self.clip, _DefaultClip)

    @property
    def adaptive(self) -> AdaptiveClip | None:
        """The adaptive clipping in force: the settings, or None for a fixed clip (``"auto"`` not yet resolved by a
        fit counts as fixed)."""
        return self.adaptive_clip if isinstance(self.adaptive_clip, AdaptiveClip) else None

    @staticmethod
    def _validated_epsilon_max(value):
        if value is None:
            return None
        if isinstance(value, Real) and not isinstance(value, bool):
            return _optional_positive("epsilon_max", value)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence | np.ndarray):
            raise TypeError("epsilon_max must be a float, a sequence of floats or None.")
        values = tuple(_optional_positive("epsilon_max", v) for v in value)
        if not values or None in values:
            raise ValueError("epsilon_max needs one positive value per client (or one float).")
        return values

    # ------------------------------------------------------------------ units
    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of a DP-SGD clipped sum: ``C`` (add/remove) or ``2C`` (substitute)."""
        return sensitivity(self.clip, self.neighbouring, "sum_of_records")

    def to_event(self, noise_multiplier: float) -> float:
        """User noise multiplier (std / C) -> event noise multiplier (std / sensitivity)."""
        return noise_multiplier * self.clip / self.sensitivity

    def from_event(self, event_noise_multiplier: float) -> float:
        """Event noise multiplier (std / sensitivity) -> user noise multiplier (std / C)."""
        return event_noise_multiplier * self.sensitivity / self.clip

    def step_event(self, noise_multiplier: float, rate: float, count: int = 1,
                   overflow_probability: float = 0.0, dimension: int = 1) -> GaussianEvent:
        """Event of ``count`` DP-SGD steps at user noise multiplier ``noise_multiplier`` and
        sampling rate ``rate`` with this config's sampler, each drawing ``dimension`` noise
        coordinates. With adaptive clipping the noise multiplier is the total of the joint
        (gradient, count) release."""
        sampling = self.sampling if rate < 1.0 else "none"
        return GaussianEvent(self.to_event(noise_multiplier), sampling, rate, count,
                             overflow_probability if sampling == "poisson" else 0.0, dimension)

    # ------------------------------------------------------------------ noise of one step
    def split(self, noise_multiplier: float) -> tuple[float, float | None]:
        """``(gradient_nm, count_nm)`` in event units; ``count_nm`` is None without adaptive
        clipping (then ``gradient_nm`` is the whole event noise multiplier)."""
        total = self.to_event(noise_multiplier)
        if self.adaptive is None:
            return total, None
        return split_noise_multiplier(total, self.adaptive.count_budget_fraction)

    def gradient_noise_std(self, noise_multiplier: float, clip=None):
        """Std of the noise on the clipped gradient sum at clip norm ``clip`` (default: the fixed
        clip; with adaptive clipping pass the current one, it may be a traced value)."""
        clip = self.clip if clip is None else clip
        gradient_nm, _ = self.split(noise_multiplier)
        return gradient_nm * (sensitivity(1.0, self.neighbouring, "sum_of_records") * clip)

    def count_noise_std(self, noise_multiplier: float) -> float:
        """Std of the noise on the adaptive-clipping count query."""
        _, count_nm = self.split(noise_multiplier)
        if count_nm is None:
            raise ValueError("count_noise_std needs adaptive_clip=AdaptiveClip(...).")
        return count_nm * count_sensitivity(self.neighbouring)

    # ------------------------------------------------------------------ budget
    def resolve(self, plan: Callable[[float], Sequence], charges: float | None = None) -> float:
        """The noise multiplier (std / C) to use for the planned run.

        ``plan(noise_multiplier)`` returns the events the run will record, for one client (a
        list of :class:`GaussianEvent`) or for every client (a list of such lists), e.g.
        ``lambda z: [[privacy.step_event(z, b / n_m, T)] for n_m in sizes]``.

        * budget only: the smallest noise multiplier meeting ``(epsilon, delta)`` for every
          client (:func:`~numpyro_dppvi.privacy.calibration.calibrate_noise`);
        * noise only: ``noise_multiplier`` as given (the ledger then reports epsilon);
        * both: ``noise_multiplier``, after checking that it meets the budget.

        The budget is met at :meth:`accounting_delta` of ``charges`` (default: the plan's own,
        :func:`~numpyro_dppvi.privacy.calibration.plan_charges`; a fit whose clients are calibrated one
        by one passes the largest over all of them, so that one ledger delta serves every client).
        """
        charges = plan_charges(plan) if charges is None else charges
        if not callable(plan):
            raise TypeError("plan must be a callable noise_multiplier -> events.")
        if self.noise_multiplier is not None:
            if self.epsilon is not None:
                spent = plan_epsilon(plan, self.noise_multiplier, self.accounting_delta(charges),
                                     self.neighbouring, self.accountant)
                if spent > self.epsilon:
                    needed = self.resolve_budget(plan, charges)
                    raise ValueError(
                        f"noise_multiplier={self.noise_multiplier} spends epsilon={spent:.4g} "
                        f"> epsilon={self.epsilon} on this plan; use noise_multiplier >= "
                        f"{needed:.4g} or drop one of the two."
                    )
            return self.noise_multiplier
        return self.resolve_budget(plan, charges)

    def resolves_at_once(self, plan: Callable[[float], Sequence], charges: float | None = None) -> bool:
        """Whether :meth:`resolve` answers without running the accountant: a noise multiplier alone, or a
        budget whose calibration is memoised (:func:`~numpyro_dppvi.privacy.calibration.is_solved`)."""
        if self.epsilon is None:
            return True
        if self.noise_multiplier is not None:
            return False  # the budget is checked with the accountant
        charges = plan_charges(plan) if charges is None else charges
        return is_solved(self.epsilon, self.accounting_delta(charges), lambda z: plan(self.from_event(z)),
                         self.neighbouring, self.accountant)

    def resolve_budget(self, plan: Callable[[float], Sequence], charges: float | None = None) -> float:
        if self.epsilon is None:
            raise ValueError("resolve_budget needs epsilon.")
        charges = plan_charges(plan) if charges is None else charges
        event_nm = calibrate_noise(
            self.epsilon, self.accounting_delta(charges), lambda z: plan(self.from_event(z)),
            self.neighbouring, self.accountant,
        )
        return self.from_event(event_nm)

    def accounting_delta(self, charges: float = 0.0, fixed_reserve: bool = False) -> float:
        """The delta at which epsilon is calibrated, and at which the ledger reports it.

        A ledger's total delta is ``delta_acc + (1 + e^{epsilon_m}) * charges_m``: the coupling arguments
        of the Poisson sampler and of the noise sampler's float tails add their probabilities
        (:func:`~numpyro_dppvi.privacy.ledger.extra_mass`) on top of the accountant's delta. With a
        budget they are taken out of the requested delta before calibrating:

            delta_acc = delta - max(DELTA_RESERVE delta, (1 + e^epsilon) * charges),

        so that ``epsilon_m <= epsilon`` at ``delta_acc`` gives a total delta ``<= delta``: the
        ``(epsilon, delta)`` asked for is the one reported, to the last digit. ``charges``: the planned
        run's (the largest over clients). Charges within the share :data:`DELTA_RESERVE` give one fixed
        ``delta_acc`` (every client of a fit, a resume and a Flower node whose ledger spans several fits
        share it); larger ones (many padded Poisson steps) take their own. ``fixed_reserve=True`` (a
        Flower node, whose ledger delta is fixed when it is created) refuses charges past the share.
        Without a budget (a noise multiplier alone) there is nothing to keep within: ``delta`` is the
        target at which epsilon is read and the report adds the charges to it.
        """
        if self.epsilon is None:
            return self.delta
        accounting = budget_delta(self.delta)
        needed = (1.0 + math.exp(min(self.epsilon, 700.0))) * charges
        if needed <= self.delta - accounting:
            return accounting
        fix = "ask for a larger delta, or plan fewer releases (rounds, local steps)"
        if fixed_reserve:
            raise ValueError(
                f"the sampler's and the noise sampler's charges to delta, (1 + e^epsilon) * {charges:.3g} = "
                f"{needed:.3g}, exceed the {DELTA_RESERVE:g} of delta={self.delta:g} this node's ledger keeps for them: {fix}")
        accounting = _delta_less(self.delta, needed)
        if not accounting > 0.0:
            raise ValueError(f"the sampler's and the noise sampler's charges to delta, (1 + e^epsilon) * {charges:.3g} "
                             f"= {needed:.3g}, use up delta={self.delta:g}: {fix}")
        return accounting

    def epsilon_max_per_client(self, num_clients: int) -> np.ndarray:
        """Per-client stop thresholds (``inf`` where none)."""
        if self.epsilon_max is None:
            return np.full(num_clients, np.inf)
        if isinstance(self.epsilon_max, float):
            return np.full(num_clients, self.epsilon_max)
        if len(self.epsilon_max) != num_clients:
            raise ValueError(
                f"epsilon_max has {len(self.epsilon_max)} values for {num_clients} clients; "
                "give one per client or a single float."
            )
        return np.array(self.epsilon_max, dtype=float)

    def ledger(self, num_clients: int, trusted_aggregator: bool = False, seed: str = "unspecified",
               charges: float = 0.0, sizes: str | None = None) -> PrivacyLedger:
        """An empty ledger with this config's relation and accountant, at :meth:`accounting_delta` of the
        planned run's ``charges``; ``seed`` says where the noise seed came from (``"os_entropy"`` or
        ``"user_key"``); ``sizes``: what the client sizes behind the settings were (default: ``"declared"`` with
        :attr:`public_sizes`, else ``"observed"``)."""
        sizes = sizes or ("declared" if self.public_sizes is not None else "observed")
        return PrivacyLedger(num_clients, self.accounting_delta(charges), self.neighbouring, self.accountant,
                             trusted_aggregator, seed=seed, sizes=sizes)
