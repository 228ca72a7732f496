"""Partitioned variational inference: local rules, server schedules, baselines, the driver."""

from .fit import DPPVI, fit_dppvi
from .server import PVIState

__all__ = ["DPPVI", "fit_dppvi", "PVIState"]
