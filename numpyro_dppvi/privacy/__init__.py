"""Differential privacy core: events, accountants, the per-client ledger, noise calibration,
samplers that match their accounting, Gaussian mechanisms, adaptive clipping and audits.

This package never imports from ``pvi``, ``vips`` or ``vfl``. See ``docs/privacy.md``.
"""

from .adaptive_clip import (
    AdaptiveClip,
    AdaptiveClipState,
    adaptive_clip_events,
    adaptive_clip_init,
    adaptive_clip_update,
    centred_count,
    clipped_share,
    count_sensitivity,
    joint_noise_multiplier,
    split_noise_multiplier,
)
from .audit import AuditResult, audit, clopper_pearson_upper, epsilon_lower_bound
from .backends import BACKENDS
from .backends import epsilon as epsilon_of_events
from .calibration import calibrate_noise, plan_epsilon
from .config import Privacy
from .events import (
    NEIGHBOURING_RELATIONS,
    SAMPLING_SCHEMES,
    GaussianEvent,
    merge_events,
    sensitivity,
)
from .ledger import NotPrivate, PrivacyLedger
from .mechanisms import (
    add_frobenius_symmetric_noise,
    add_gaussian_noise,
    add_symmetric_noise,
    aggregator_noise_share,
    aggregator_noise_shares,
    clip_per_example,
    clipped_sum,
    clip_update,
    gaussian_noise_like,
    per_example_norms,
    project_psd,
    symmetric_gaussian_noise,
    tree_norm,
)
from .sizes import SizeDisclosureWarning, declared_sizes, public_client_sizes
from .sampling import (
    inclusion_threshold,
    poisson_batch,
    poisson_overflow_probability,
    poisson_pad_size,
    without_replacement_batch,
)

__all__ = [
    "AdaptiveClip", "AdaptiveClipState", "adaptive_clip_events", "adaptive_clip_init",
    "adaptive_clip_update", "centred_count", "clipped_share", "count_sensitivity", "joint_noise_multiplier",
    "split_noise_multiplier",
    "AuditResult", "audit", "clopper_pearson_upper", "epsilon_lower_bound",
    "BACKENDS", "epsilon_of_events", "calibrate_noise", "plan_epsilon",
    "Privacy", "SizeDisclosureWarning", "declared_sizes", "public_client_sizes",
    "NEIGHBOURING_RELATIONS", "SAMPLING_SCHEMES", "GaussianEvent", "merge_events", "sensitivity",
    "NotPrivate", "PrivacyLedger",
    "add_frobenius_symmetric_noise", "add_gaussian_noise", "add_symmetric_noise",
    "aggregator_noise_share", "aggregator_noise_shares", "clip_per_example", "clip_update", "clipped_sum",
    "gaussian_noise_like", "per_example_norms", "project_psd", "symmetric_gaussian_noise",
    "tree_norm",
    "inclusion_threshold", "poisson_batch", "poisson_overflow_probability", "poisson_pad_size",
    "without_replacement_batch",
]
