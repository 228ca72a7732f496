"""Models a node can name in its node config (``model="numpyro_dppvi.flower.models:..."``).

A node fits only the model its data holder names, imported from the node's own installed code: the
server sends the name, never code. Any importable ``"package.module:function"`` works the same way;
these are the ones the package ships (:mod:`numpyro_dppvi.example_models`; used by ``dppvi deploy demo``
and the tests).
"""

from __future__ import annotations

from ..example_models import logistic_regression

__all__ = ["logistic_regression"]
