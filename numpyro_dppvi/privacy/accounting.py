"""Privacy accounting: events, accountant backends, the per-client ledger and noise calibration.

One concept per file, gathered here under the name the architecture uses:

* :mod:`.events` — :class:`GaussianEvent` (a Gaussian release with its noise multiplier relative
  to the sensitivity of the released sum) and :func:`sensitivity`;
* :mod:`.backends` — epsilon of a composition of events with dp_accounting PLD / RDP or autodp,
  each library's unit convention translated and pinned by golden-value tests;
* :mod:`.ledger` — :class:`PrivacyLedger`, per-client bookkeeping with parallel composition;
* :mod:`.calibration` — :func:`calibrate_noise`, the smallest noise multiplier meeting a budget.
"""

from .backends import BACKENDS, epsilon as epsilon_of_events
from .calibration import calibrate_noise, plan_epsilon
from .events import (
    NEIGHBOURING_RELATIONS,
    SAMPLING_SCHEMES,
    GaussianEvent,
    merge_events,
    sensitivity,
)
from .ledger import PrivacyLedger

__all__ = [
    "BACKENDS",
    "NEIGHBOURING_RELATIONS",
    "SAMPLING_SCHEMES",
    "GaussianEvent",
    "PrivacyLedger",
    "calibrate_noise",
    "epsilon_of_events",
    "merge_events",
    "plan_epsilon",
    "sensitivity",
]
