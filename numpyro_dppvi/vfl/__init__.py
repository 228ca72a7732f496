"""Bayesian vertical federated learning (Hassan et al.).

Clients hold different columns of the same rows; each declares a NumPyro sub-model returning its
contribution ``g_j`` to the linear predictor; the server holds ``y`` and the likelihood.
"""

from .client import VFLClient, split_columns
from .fit import fit_vfl
from .models import augmented_model, centralised_model, power_likelihood_model
from .protocol import Channel, Message
from .results import VFLResult
from .split_nn import mlp_submodel

__all__ = [
    "VFLClient",
    "VFLResult",
    "Channel",
    "Message",
    "augmented_model",
    "centralised_model",
    "fit_vfl",
    "mlp_submodel",
    "power_likelihood_model",
    "split_columns",
]
