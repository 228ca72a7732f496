"""numpyro_dppvi: differentially private, federated Bayesian inference for NumPyro."""

from . import factors
from .data import pad_clients, partition, partition_by
from .model import ModelAdapter, model
from .pvi import DPPVI, PVIState, fit_dppvi
from .results import DPPVIResult

load = DPPVIResult.load

__version__ = "0.1.0"

__all__ = [
    "DPPVI", "DPPVIResult", "ModelAdapter", "PVIState", "factors", "fit_dppvi", "load",
    "model", "pad_clients", "partition", "partition_by",
]
