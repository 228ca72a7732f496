"""calibrate_noise: the smallest noise multiplier whose planned releases meet an (epsilon, delta)
budget.

Epsilon of a composition of Gaussian releases is strictly decreasing in the noise multiplier, so
the answer is the root of ``epsilon(sigma) = target``, found by secant steps on ``log epsilon`` vs
``log sigma`` (nearly linear, so a handful of accountant calls suffice) until the bracket's
relative width is below ``rtol``. With the PLD backend the search runs on coarse grids first
(1e-2, then 1e-3: upper bounds, 10-20x cheaper) and ends with one evaluation on the ledger's grid
(1e-4), which the ledger's report then reuses (memoised in ``backends``). The upper end is
returned: its epsilon, computed with the chosen backend on the ledger's grid, is ``<= target``, and
``sigma / (1 + rtol)`` exceeds the target. Solutions are memoised per plan in the process.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Sequence, Union

from . import accounting_memo, backends
from .events import GaussianEvent, check_neighbouring
from .ledger import extra_mass

Plan = Union[Sequence[GaussianEvent], Callable[[float], Sequence]]

SIGMA_MIN = 1e-2
SIGMA_MAX = 1e4
#: PLD grids used while searching (the final check uses the ledger's grid).
ROUGH_PLD_DISCRETIZATION = 1e-2
COARSE_PLD_DISCRETIZATION = 1e-3
#: Solved calibrations of this process, keyed by the plan's events at two noise levels and the
#: budget: a second fit with the same plan (the same fit again, a resume) does not search again.
_SOLVED: OrderedDict = OrderedDict()
_MAX_SOLVED = 256


def _plan_function(plan: Plan) -> Callable[[float], list[tuple[GaussianEvent, ...]]]:
    """Normalise ``plan`` to ``sigma -> [events of client 1, events of client 2, ...]``."""
    if callable(plan):
        def per_client(sigma):
            events = list(plan(sigma))
            if events and all(isinstance(e, GaussianEvent) for e in events):
                return [tuple(events)]
            if all(not isinstance(e, GaussianEvent) for e in events):
                return [tuple(client) for client in events]
            raise TypeError("plan(sigma) must return GaussianEvents or lists of GaussianEvents.")
        return per_client
    templates = tuple(plan)
    if not all(isinstance(e, GaussianEvent) for e in templates):
        raise TypeError("plan must be a list of GaussianEvent templates or a callable.")
    return lambda sigma: [tuple(e.with_noise_multiplier(sigma) for e in templates)]


def plan_charges(plan: Plan) -> float:
    """The largest over clients of the plan's :func:`~numpyro_dppvi.privacy.ledger.extra_mass` (the
    probabilities charged to delta do not depend on the noise multiplier)."""
    return max((extra_mass(events) for events in _plan_function(plan)(1.0)), default=0.0)


def plan_epsilon(plan: Plan, noise_multiplier: float, delta: float, neighbouring: str,
                 backend: str = "pld", pld_discretization: float = backends.PLD_DISCRETIZATION
                 ) -> float:
    """Epsilon of ``plan`` at ``noise_multiplier`` (max over clients if the plan has several).

    Args:
      plan: the planned releases, as :func:`calibrate_noise` takes them: a list of
        :class:`~numpyro_dppvi.privacy.GaussianEvent` templates, or a callable ``sigma -> events`` (one client)
        or ``sigma -> list of events per client``.
      noise_multiplier: the noise multiplier ``sigma`` of the releases (std / sensitivity under
        ``neighbouring``).
      delta: the target delta in (0, 1).
      neighbouring: ``"add_remove"`` or ``"substitute"``.
      backend: the accountant: ``"pld"`` (default), ``"rdp"`` or ``"autodp"``.
      pld_discretization: the PLD's discretisation interval (PLD only; coarser is faster and still an upper
        bound).
    """
    values = {}
    for events in _plan_function(plan)(noise_multiplier):
        key = tuple(sorted(e.mechanism + (e.count,) for e in events))
        if key not in values:
            values[key] = backends.epsilon(
                events, delta, neighbouring, backend, pld_discretization
            )
    return max(values.values(), default=0.0)


def _supports(plan_fn, neighbouring, backend) -> bool:
    try:
        for events in plan_fn(1.0):
            backends.check_supported(events, neighbouring, backend)
    except ValueError:
        return False
    return True


def calibrate_noise(
    epsilon: float,
    delta: float,
    plan: Plan,
    neighbouring: str = "add_remove",
    backend: str = "pld",
    rtol: float = 1e-3,
) -> float:
    """Smallest noise multiplier (within ``rtol``) such that the planned releases are
    ``(epsilon, delta)``-DP under ``neighbouring``, accounted by ``backend``.

    Args:
      epsilon: target epsilon > 0.
      delta: target delta in (0, 1).
      plan: either a list of :class:`GaussianEvent` templates that all share the noise
        multiplier being solved for (their own ``noise_multiplier`` is ignored), or a callable
        ``sigma -> list[GaussianEvent]`` (one client) or ``sigma -> list[list[GaussianEvent]]``
        (several clients: the budget must hold for each, i.e. for the max, by parallel
        composition). The noise multiplier is in event units: std / sensitivity of the released
        sum under ``neighbouring``.
      neighbouring: ``"add_remove"`` (default) or ``"substitute"``.
      backend: the accountant: ``"pld"`` (default), ``"rdp"`` or ``"autodp"``.
      rtol: relative width of the final bracket.

    Returns:
      ``sigma`` with ``epsilon(sigma) <= epsilon`` (checked with ``backend``) and
      ``epsilon(sigma / (1 + rtol)) > epsilon``.

    Raises:
      ValueError: bad inputs, an empty plan, a backend that cannot account the plan, a budget
        needing more than ``SIGMA_MAX`` noise (impossible in practice) or met even at
        ``SIGMA_MIN`` (no meaningful protection: pass the noise multiplier directly).
    """
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise TypeError(f"epsilon must be a float, got {type(epsilon).__name__}.")
    if not math.isfinite(epsilon) or epsilon <= 0:
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon}.")
    delta = backends.check_delta(delta)
    check_neighbouring(neighbouring)
    backends.check_backend(backend)
    if not (0 < rtol < 0.5):
        raise ValueError(f"rtol must lie in (0, 0.5), got {rtol}.")
    plan_fn = _plan_function(plan)
    if not any(plan_fn(1.0)):
        raise ValueError("the plan has no releases: any noise multiplier meets the budget.")
    for events in plan_fn(1.0):
        backends.check_supported(events, neighbouring, backend)
    memo_key = _memo_key(epsilon, delta, plan_fn, neighbouring, backend, rtol)
    if memo_key in _SOLVED:
        _SOLVED.move_to_end(memo_key)
        return _SOLVED[memo_key]
    sigma = _from_disk(memo_key)
    if sigma is None or plan_epsilon(plan_fn, sigma, delta, neighbouring, backend) > epsilon:
        sigma = _calibrate(epsilon, delta, plan_fn, neighbouring, backend, rtol)
        _to_disk(memo_key, sigma)
    _SOLVED[memo_key] = sigma
    while len(_SOLVED) > _MAX_SOLVED:
        _SOLVED.popitem(last=False)
    return sigma


def _memo_key(epsilon, delta, plan_fn, neighbouring, backend, rtol) -> tuple:
    """What a calibration's answer depends on: the plan's events at two noise levels (not the overflow
    or the noise dimension, which are delta's) and the budget."""
    signature = tuple(tuple((e.noise_multiplier, e.sampling, e.rate, e.count) for e in client)
                      for sigma in (1.0, 2.0) for client in plan_fn(sigma))
    return (signature, float(epsilon), float(delta), neighbouring, backend, float(rtol))


def is_solved(epsilon: float, delta: float, plan: Plan, neighbouring: str = "add_remove", backend: str = "pld",
              rtol: float = 1e-3) -> bool:
    """Whether :func:`calibrate_noise` with these arguments would answer without a search: solved earlier in
    this process, or kept by an earlier process in the signed memo (:mod:`.accounting_memo`). A fit asks
    this to decide whether compiling its programs while the accountant searches is worth a thread."""
    key = _memo_key(epsilon, delta, _plan_function(plan), neighbouring, backend, rtol)
    return key in _SOLVED or _from_disk(key) is not None


def clear_memo() -> None:
    """Forget every memoised calibration and accountant result of this process (for timing a cold
    start; the persistent file, if any, is left alone)."""
    _SOLVED.clear()
    backends._epsilon.cache_clear()
    backends._subsampled_gaussian_pld.cache_clear()
    backends._gaussian_pld.cache_clear()


def _from_disk(memo_key) -> float | None:
    """A calibration solved by an earlier process (:mod:`.accounting_memo`, signed). Still checked
    against the budget by the caller before it is used."""
    value = accounting_memo.load(repr(("calibration", memo_key)))
    return value if value is not None and value > 0 else None


def _to_disk(memo_key, sigma: float) -> None:
    accounting_memo.store(repr(("calibration", memo_key)), float(sigma))


def _calibrate(epsilon, delta, plan_fn, neighbouring, backend, rtol) -> float:
    """The search of :func:`calibrate_noise` (validated inputs, no memo)."""

    def eps_of(sigma, which, discretization=backends.PLD_DISCRETIZATION, fn=plan_fn):
        return plan_epsilon(fn, sigma, delta, neighbouring, which, discretization)

    # Several clients: search on the client that is worst at sigma = 1 (more steps or a higher
    # rate is worse at every sigma in practice); the final check below covers all clients.
    search_fn = plan_fn
    clients = plan_fn(1.0)
    if len({tuple(c) for c in clients}) > 1:
        worst = max(range(len(clients)), key=lambda m: backends.epsilon(
            clients[m], delta, neighbouring, "rdp" if _supports(plan_fn, neighbouring, "rdp")
            else backend))

        def search_fn(sigma):
            return [plan_fn(sigma)[worst]]

    if backend != "pld":
        sigma = _solve(lambda s: eps_of(s, backend, fn=search_fn), epsilon, 1.0, rtol)
    else:
        # PLD at three resolutions, each an upper bound (pessimistic rounding) and each ~2-10x
        # cheaper than the next: a 1e-2 grid finds the root within 2%, a 1e-3 grid within rtol
        # from there, and the answer is checked, and if need be raised, on the ledger's grid.
        rough = _solve(lambda s: eps_of(s, backend, ROUGH_PLD_DISCRETIZATION, fn=search_fn), epsilon, 1.0, 2e-2)
        sigma = _solve(
            lambda s: eps_of(s, backend, COARSE_PLD_DISCRETIZATION, fn=search_fn),
            epsilon, rough, rtol,
        )
    while eps_of(sigma, backend) > epsilon:
        sigma *= 1.0 + rtol
    return sigma


def _too_much_noise(epsilon, delta):
    return (
        f"the budget epsilon={epsilon}, delta={delta} needs a noise multiplier above "
        f"{SIGMA_MAX:g}: raise epsilon or delta, or plan fewer releases / a smaller sampling rate."
    )


def _too_little_noise(epsilon):
    return (
        f"the budget epsilon={epsilon} is met even with noise multiplier {SIGMA_MIN:g}: such a "
        "budget gives no meaningful protection; pass noise_multiplier directly if you mean it."
    )


def _solve(eps_fn, target, start, rtol):
    """Root of ``log eps(sigma) = log target`` in ``x = log sigma``, returned from the safe side.

    Epsilon of Gaussian compositions scales roughly like ``1/sigma``, so the first step assumes
    slope -1 in log-log; later steps are secants through the last two points until the root is
    bracketed, then :func:`_refine` closes the bracket.
    """
    def g(x):
        if x > math.log(SIGMA_MAX):
            raise ValueError(_too_much_noise(target, "given"))
        if x < math.log(SIGMA_MIN):
            raise ValueError(_too_little_noise(target))
        value = eps_fn(math.exp(x))
        return math.inf if not value > 0 else math.log(value) - math.log(target)

    x0 = math.log(start)
    g0 = g(x0)
    x1 = x0 + (min(g0, 2.0) if math.isfinite(g0) else 1.0)  # slope -1 guess, step <= e^2
    g1 = g(x1)
    while (g0 > 0) == (g1 > 0):
        if math.isfinite(g0) and math.isfinite(g1) and g1 != g0:
            step = -g1 * (x1 - x0) / (g1 - g0)
        else:
            step = 1.0 if g1 > 0 else -1.0
        # overshoot 10% so the next point lands across the root; at most a factor e^2
        step = max(min(1.1 * step, 2.0), -2.0)
        x0, g0 = x1, g1
        x1 = x1 + step
        g1 = g(x1)
    (x_lo, g_lo), (x_hi, g_hi) = sorted([(x0, g0), (x1, g1)])
    return _refine(eps_fn, target, math.exp(x_lo), math.exp(x_hi), rtol, g_lo, g_hi)


def _refine(eps_fn, target, lo, hi, rtol, g_lo=None, g_hi=None):
    """Shrink ``[lo, hi]`` (with ``eps(lo) > target >= eps(hi)``) until ``hi / lo <= 1 + rtol``;
    return ``hi``.

    Secant steps on ``g(x) = log eps(e^x) - log target`` (nearly linear in ``x = log sigma``),
    each aimed ``0.45 * log(1 + rtol)`` past the root towards the end that did not move last, so
    that both ends close in on the root; steps stay 5% of the bracket away from its ends, which
    guarantees progress even where ``g`` is far from linear.
    """
    def g(sigma):
        value = eps_fn(sigma)
        return math.inf if not value > 0 else math.log(value) - math.log(target)

    ltol = math.log1p(rtol)
    x_lo, x_hi = math.log(lo), math.log(hi)
    g_lo = g(lo) if g_lo is None else g_lo
    g_hi = g(hi) if g_hi is None else g_hi
    last = 0
    while x_hi - x_lo > ltol:
        width = x_hi - x_lo
        if math.isfinite(g_lo) and math.isfinite(g_hi) and g_lo != g_hi:
            x = x_hi - g_hi * width / (g_hi - g_lo) + 0.45 * ltol * last
            x = min(max(x, x_lo + 0.05 * width), x_hi - 0.05 * width)
        else:
            x = 0.5 * (x_lo + x_hi)
        gx = g(math.exp(x))
        if gx > 0:
            x_lo, g_lo, last = x, gx, 1
        else:
            x_hi, g_hi, last = x, gx, -1
    return math.exp(x_hi)
