"""``fit_dppvi``, the one entry point of federated fits: (DP-)PVI, and federated VIPS.

``method="vips"`` runs federated VIPS for conjugate-exponential models (a ``ConjugateModel`` or a
NumPyro model matching a supported pattern): exact local steps, each client releasing its clipped,
noised expected sufficient statistics once per round, returning a ``VIPSResult``
(:func:`numpyro_dppvi.vips.federated_fit.fit_federated_vips`). Every other method is (DP-)PVI
(:func:`numpyro_dppvi.pvi.fit.fit_dppvi`). This module wires the two families together, so that
neither ``pvi`` nor ``vips`` imports the other.
"""

from __future__ import annotations

import functools

from .pvi.fit import fit_dppvi as _fit_pvi
from .vips.federated_fit import fit_federated_vips

_VIPS_OPTIONS = {"trusted_aggregator", "detect_options", "noise_aware"}


@functools.wraps(_fit_pvi)
def fit_dppvi(model, clients, *, method: str = "pvi", **kwargs):
    if method != "vips":
        return _fit_pvi(model, clients, method=method, **kwargs)
    accepted = {"privacy", "rounds", "schedule", "damping", "rng_key"} | _VIPS_OPTIONS
    unknown = set(kwargs) - accepted
    if unknown:
        raise TypeError(f"fit_dppvi(method='vips') does not take {sorted(unknown)}; it takes {sorted(accepted)}")
    return fit_federated_vips(model, clients, **kwargs)
