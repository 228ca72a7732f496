"""numpyro_dppvi: differentially private, federated Bayesian inference for NumPyro.

Public names: the model decorator and adapter, data partitioning and loaders, the privacy
configuration and ledger, DP-PVI (``fit_dppvi``, ``DPPVI``) and its baselines, the calibration check of a fit
(``calibration_check``), VIPS (``fit_vips``)
and vertical federated learning (``fit_vfl``).
"""

from . import datasets, diagnostics, factors, optim, privacy, vfl, vips
from .persistent_cache import enable_compilation_cache
from .data import pad_clients, partition, partition_by, validate_clients
from .fit import fit_dppvi
from .model_adapter import ModelAdapter, model
from .privacy import NotPrivate, Privacy, PrivacyLedger
from .pvi import DPPVI, FitDiverged, FitSettings, NoValidUpdates, PVIState, fit_bcm, fit_global_vi
from .results import DPPVIResult, Result, load
from .simulation_calibration import CalibrationReport, calibration_check
from .vfl import VFLClient, VFLResult, fit_vfl
from .vips import VIPSResult, fit_vips

__version__ = "0.1.0"

__all__ = [
    "CalibrationReport", "DPPVI", "DPPVIResult", "FitDiverged", "FitSettings", "NoValidUpdates", "ModelAdapter", "NotPrivate", "PVIState", "Privacy", "PrivacyLedger",
    "Result", "VFLClient", "VFLResult", "VIPSResult",
    "calibration_check", "datasets", "diagnostics", "enable_compilation_cache", "factors", "fit_bcm", "fit_dppvi", "fit_global_vi", "fit_vfl",
    "fit_vips", "load", "model", "optim", "pad_clients", "partition", "partition_by", "privacy",
    "validate_clients", "vfl", "vips",
]
