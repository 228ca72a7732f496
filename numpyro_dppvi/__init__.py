"""numpyro_dppvi: differentially private, federated Bayesian inference for NumPyro."""

from . import datasets, factors
from .data import pad_clients, partition, partition_by, validate_clients
from .model import ModelAdapter, model
from .pvi import DPPVI, PVIState, fit_bcm, fit_dppvi, fit_global_vi
from .results import DPPVIResult

load = DPPVIResult.load

__version__ = "0.1.0"

__all__ = [
    "DPPVI", "DPPVIResult", "ModelAdapter", "PVIState", "datasets", "factors", "fit_bcm", "fit_dppvi",
    "fit_global_vi", "load", "model", "pad_clients", "partition", "partition_by", "validate_clients",
]
