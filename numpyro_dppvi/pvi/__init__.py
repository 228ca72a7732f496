"""Partitioned variational inference: local rules, server schedules, baselines, the driver."""

from .baselines import fit_bcm, fit_global_vi
from .fit import DPPVI, FitDiverged, NoValidUpdates, fit_dppvi
from .server import PVIState

__all__ = ["DPPVI", "FitDiverged", "NoValidUpdates", "PVIState", "fit_bcm", "fit_dppvi", "fit_global_vi"]
