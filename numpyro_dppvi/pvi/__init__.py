"""Partitioned variational inference: local rules, server schedules, baselines, the driver."""

from .baselines import fit_bcm, fit_global_vi
from .driver import DPPVI, FitDiverged, NoValidUpdates
from .fit import fit_dppvi
from .fit_settings import FitSettings
from .server import PVIState

__all__ = ["DPPVI", "FitDiverged", "FitSettings", "NoValidUpdates", "PVIState", "fit_bcm", "fit_dppvi", "fit_global_vi"]
