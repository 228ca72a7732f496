"""Accountant backends: epsilon of a composition of :class:`GaussianEvent` at a given delta.

Our events carry ``noise_multiplier = std / Delta`` with ``Delta`` the sensitivity of the released
sum under the ledger's relation (``C`` add/remove, ``2C`` substitute for DP-SGD sums). The
libraries use other units; each translation below is pinned by golden-value tests
(``tests/privacy/test_accounting.py``):

* ``dp_accounting`` PLD, relation ``REPLACE_ONE``: models the pair
  ``(1-q) N(0, s^2) + q N(-1, s^2)`` vs ``(1-q) N(0, s^2) + q N(+1, s^2)``, i.e. its unit is *half*
  the replace-one sensitivity (``C``). We pass ``2 * noise_multiplier``.
  ``ADD_OR_REMOVE_ONE``: unit ``Delta = C``; passed unchanged.
* ``dp_accounting`` RDP: unit is the sensitivity under the chosen relation (for sampling without
  replacement with ``REPLACE_ONE`` that is ``2C``); passed unchanged.
* ``autodp`` RDP (``anaRDPacct`` with ``RDP_gaussian``): unit is the sensitivity; passed unchanged.

Support (anything else raises a ValueError naming a backend that can do it):

===================  ==================  =====================  ==========================
backend              sampling="none"     "poisson"              "without_replacement"
===================  ==================  =====================  ==========================
pld (default)        both relations      both relations         no (use rdp / autodp)
rdp                  both relations      add_remove only        substitute only
autodp               both relations      add_remove only        substitute only, not mixed
                                                                with Poisson on one client
===================  ==================  =====================  ==========================
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Iterable, Sequence

from . import accounting_memo
from .events import GaussianEvent, check_neighbouring, merge_events

BACKENDS = ("pld", "rdp", "autodp")

#: PLD discretisation of the privacy loss (dp_accounting's default). Pessimistic rounding keeps
#: the PLD epsilon an upper bound whatever the interval.
PLD_DISCRETIZATION = 1e-4

#: RDP orders: dp_accounting's defaults from 2 up. Orders in (1, 2) only matter for delta close
#: to 1, and for subsampled Gaussians they fail to converge in dp_accounting (dropped with a
#: warning per order); leaving them out can only raise the reported epsilon, never lower it.
RDP_ORDERS = tuple(
    [2 + x / 10.0 for x in range(0, 90)] + list(range(11, 64)) + [128, 256, 512, 1024]
)


def check_backend(backend: str) -> str:
    """``backend`` when it is one of :data:`BACKENDS` (an accountant's name), else a ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"accountant={backend!r} is not known; use one of {BACKENDS}.")
    return backend


def check_delta(delta) -> float:
    """``delta`` as a float strictly between 0 and 1: a TypeError for a bool or a non-number, a
    ValueError outside ``(0, 1)``."""
    if isinstance(delta, bool):
        raise TypeError("delta must be a float in (0, 1), got a bool.")
    try:
        delta = float(delta)
    except (TypeError, ValueError):
        raise TypeError(f"delta must be a float in (0, 1), got {delta!r}.") from None
    if not (0.0 < delta < 1.0):
        raise ValueError(
            f"delta must lie strictly between 0 and 1, got {delta}; a usual choice is "
            "delta < 1/n (e.g. 1e-5)."
        )
    return delta


def check_supported(events: Iterable[GaussianEvent], neighbouring: str, backend: str) -> None:
    """Raise a ValueError (naming an alternative) if ``backend`` cannot account ``events``."""
    check_neighbouring(neighbouring)
    check_backend(backend)
    # a "subsampled" release at rate 1 is the plain Gaussian mechanism
    kinds = {e.sampling if e.rate < 1.0 else "none" for e in events}
    if "without_replacement" in kinds and neighbouring != "substitute":
        raise ValueError(
            "sampling without replacement is accounted under the substitute relation only "
            "(the batch size b = rate * n is public); set neighbouring='substitute', or use "
            "sampling='poisson' with neighbouring='add_remove'."
        )
    if backend == "pld" and "without_replacement" in kinds:
        raise ValueError(
            "the 'pld' backend (dp_accounting PLD) has no accountant for sampling without "
            "replacement; use accountant='rdp' (or 'autodp'), or sampling='poisson' which the "
            "PLD accounts tightly."
        )
    if backend in ("rdp", "autodp") and "poisson" in kinds and neighbouring == "substitute":
        raise ValueError(
            f"the {backend!r} backend cannot account Poisson sampling under the substitute "
            "relation; use accountant='pld', or neighbouring='add_remove'."
        )
    if backend == "autodp" and {"poisson", "without_replacement"} <= kinds:
        raise ValueError(
            "autodp cannot compose Poisson and without-replacement sampling on one client; use "
            "accountant='rdp'."
        )


def epsilon(
    events: Sequence[GaussianEvent],
    delta: float,
    neighbouring: str,
    backend: str = "pld",
    pld_discretization: float = PLD_DISCRETIZATION,
) -> float:
    """Epsilon at ``delta`` of the composition of ``events`` (0.0 for no events).

    Args:
      events: the :class:`~numpyro_dppvi.privacy.GaussianEvent` s of one client (merged by mechanism first).
      delta: the target delta in (0, 1).
      neighbouring: the relation the events' noise multipliers refer to: ``"add_remove"`` or ``"substitute"``.
      backend: the accountant: ``"pld"`` (dp_accounting PLD, default), ``"rdp"`` (dp_accounting RDP) or
        ``"autodp"`` (autodp RDP).
      pld_discretization: the PLD's discretisation interval (PLD only); coarser values are faster and remain
        upper bounds (pessimistic rounding), slightly less tight; the ledger always uses the default.

    Results are memoised per (events, delta, relation, backend, grid) in the process (and across
    processes in a signed file once :func:`numpyro_dppvi.enable_compilation_cache` is on:
    :mod:`.accounting_memo`; the same float either way), and PLD
    builds the PLD of one release once per (noise, sampling, rate, relation, grid) and composes it
    for each count exactly as ``dp_accounting``'s accountant does (bit-identical epsilons): a
    ledger, a budget stop rule and a calibration asking the same question pay for it once.
    """
    delta = check_delta(delta)
    events = merge_events(events)
    check_supported(events, neighbouring, backend)
    if not events:
        return 0.0
    key = tuple((e.noise_multiplier, e.sampling, e.rate, e.count) for e in events)
    return _epsilon(key, delta, neighbouring, backend, float(pld_discretization))


@functools.lru_cache(maxsize=4096)
def _epsilon(events: tuple, delta: float, neighbouring: str, backend: str, discretization: float) -> float:
    question = repr(("epsilon", tuple((float(z), s, float(q), int(c)) for z, s, q, c in events), float(delta),
                     neighbouring, backend, float(discretization)))
    kept = accounting_memo.load(question)  # an earlier process's answer (signed; opt-in)
    if kept is not None:
        return kept
    if backend == "pld":
        value = _pld_epsilon(events, delta, neighbouring, discretization)
    elif backend == "rdp":
        value = _rdp_epsilon([_event(*e) for e in events], delta, neighbouring)
    else:
        value = _autodp_epsilon([_event(*e) for e in events], delta)
    value = max(float(value), 0.0)
    accounting_memo.store(question, value)
    return value


def _event(noise_multiplier, sampling, rate, count) -> GaussianEvent:
    return GaussianEvent(noise_multiplier, sampling, rate, count)


def _dp_accounting_relation(neighbouring: str):
    import dp_accounting  # the accountant libraries load on first use: slow to import, idle in non-private fits

    rel = dp_accounting.NeighboringRelation
    return rel.ADD_OR_REMOVE_ONE if neighbouring == "add_remove" else rel.REPLACE_ONE


#: The largest PLD grid (points of one release's privacy-loss distribution) the accountant builds: ~80 MB
#: of float64, ~1.8 GB of memory at the peak (measured at 7.9e6 points). ``Privacy(noise_multiplier=1e-3)`` asked for a grid of
#: ~2e9 points and the process died allocating 38 GiB (issue 23).
MAX_PLD_POINTS = 1e7


def pld_grid_points(noise_multiplier: float, neighbouring: str, discretization: float) -> float:
    """An upper estimate of the points of one Gaussian release's PLD: its privacy loss
    ``(x - 1/2) / s^2`` (``s`` the noise std in units of the sensitivity) over ``x`` within 10 sds of either
    mean spans ``20 / s + 1 / s^2``, divided by the grid's ``discretization``."""
    inverse = 1.0 / (_unit(neighbouring) * noise_multiplier)  # inf for a subnormal s, 0 for a huge one: no overflow
    return (20.0 * inverse + inverse * inverse) / discretization


def check_pld_size(events, neighbouring: str, discretization: float) -> None:
    """A clear error, instead of an allocation of many GiB, for a noise multiplier too small for the PLD
    accountant on its grid."""
    for noise_multiplier, sampling, rate, count in events:
        z = noise_multiplier if sampling == "poisson" and rate < 1.0 else noise_multiplier / math.sqrt(count)
        points = pld_grid_points(z, neighbouring, discretization)
        if points > MAX_PLD_POINTS:
            raise ValueError(
                f"noise multiplier {noise_multiplier:g} is too small for the PLD accountant: its privacy-loss "
                f"distribution needs ~{points:.1e} grid points (~{points * 8 / 2**30:.1f} GiB, several times that "
                f"while composing; at most {MAX_PLD_POINTS:.0e}). Such a release gives epsilon far above any "
                "meaningful budget: use a noise multiplier of at least ~0.05, or Privacy(accountant='rdp'), "
                "which handles any noise multiplier.")


def _pld_epsilon(events: tuple, delta, neighbouring, discretization=PLD_DISCRETIZATION) -> float:
    """``dp_accounting``'s ``PLDAccountant`` composition, with the release PLDs cached: for each
    event ``identity.compose(release.self_compose(count))`` (Poisson) or the Gaussian PLD at
    ``sigma / sqrt(count)`` (no sampling), in order, as the accountant composes them."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    check_pld_size(events, neighbouring, discretization)

    total = pld.identity(value_discretization_interval=discretization)
    for noise_multiplier, sampling, rate, count in events:
        if sampling == "poisson" and rate < 1.0:
            release = _subsampled_gaussian_pld(noise_multiplier, rate, neighbouring, discretization)
            total = total.compose(release.self_compose(count))
        else:
            total = total.compose(_gaussian_pld(noise_multiplier / math.sqrt(count), neighbouring, discretization))
    return total.get_epsilon_for_delta(delta)


# dp_accounting's REPLACE_ONE Gaussian unit is C = half the replace-one sensitivity.
def _unit(neighbouring: str) -> float:
    return 1.0 if neighbouring == "add_remove" else 2.0


@functools.lru_cache(maxsize=256)
def _subsampled_gaussian_pld(noise_multiplier, rate, neighbouring, discretization):
    from dp_accounting.pld import privacy_loss_distribution as pld

    return pld.from_gaussian_mechanism(
        standard_deviation=_unit(neighbouring) * noise_multiplier, value_discretization_interval=discretization,
        sampling_prob=rate, neighboring_relation=_dp_accounting_relation(neighbouring))


@functools.lru_cache(maxsize=256)
def _gaussian_pld(noise_multiplier, neighbouring, discretization):
    from dp_accounting.pld import privacy_loss_distribution as pld

    return pld.from_gaussian_mechanism(
        standard_deviation=_unit(neighbouring) * noise_multiplier, value_discretization_interval=discretization,
        neighboring_relation=_dp_accounting_relation(neighbouring))


class _DropUnconvergedOrders(logging.Filter):
    """Drops dp_accounting's "failed to converge ... Excluding this order" warnings (one per order and
    event, dozens per call for large noise multipliers at high sampling rates). Excluding an order is
    sound: epsilon is a minimum over orders, and a minimum over fewer orders can only be larger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def _quiet_rdp_orders():
    absl_logger = logging.getLogger("absl")
    dropper = _DropUnconvergedOrders()
    absl_logger.addFilter(dropper)
    try:
        yield
    finally:
        absl_logger.removeFilter(dropper)


def _rdp_epsilon(events, delta, neighbouring) -> float:
    with _quiet_rdp_orders():
        return _rdp_epsilon_of(events, delta, neighbouring)


def _rdp_epsilon_of(events, delta, neighbouring) -> float:
    import dp_accounting
    from dp_accounting import rdp

    accountant = rdp.RdpAccountant(
        orders=RDP_ORDERS, neighboring_relation=_dp_accounting_relation(neighbouring)
    )
    for e in events:
        gaussian = dp_accounting.GaussianDpEvent(e.noise_multiplier)
        if e.rate == 1.0:
            event = gaussian
        elif e.sampling == "poisson":
            event = dp_accounting.PoissonSampledDpEvent(e.rate, gaussian)
        else:
            # q = sample_size / source_dataset_size exactly equals the float rate.
            sample_size, source_size = e.rate.as_integer_ratio()
            event = dp_accounting.SampledWithoutReplacementDpEvent(
                source_size, sample_size, gaussian
            )
        accountant.compose(event, e.count)
    return accountant.get_epsilon(delta)


def _autodp_epsilon(events, delta) -> float:
    from autodp import rdp_acct, rdp_bank

    accountant = rdp_acct.anaRDPacct()
    for e in events:
        # bind sigma now: a closure over the loop variable would share the last event's value
        def rdp_of_order(alpha, sigma=e.noise_multiplier):
            return rdp_bank.RDP_gaussian({"sigma": sigma}, alpha)

        if e.rate == 1.0:
            accountant.compose_mechanism(rdp_of_order, coeff=e.count)
        elif e.sampling == "poisson":
            accountant.compose_poisson_subsampled_mechanisms(rdp_of_order, e.rate, coeff=e.count)
        else:
            accountant.compose_subsampled_mechanism(
                rdp_of_order, e.rate, coeff=e.count, improved_bound_flag=True
            )
    value = accountant.get_eps(delta)
    return math.inf if value is None else value
