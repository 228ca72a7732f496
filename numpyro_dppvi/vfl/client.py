"""A vertical-federated client: its own columns and a NumPyro sub-model.

Client ``j`` holds the columns ``x_j`` of the same ``n`` rows as every other client and a sub-model
``submodel(x_j)`` that samples its own parameters ``theta_j`` with ``numpyro.sample`` (and may own
point parameters through ``numpyro.param``) and returns its per-row contribution
``g_j(x_j, theta_j)`` of shape ``[n]`` to the linear predictor ``eta = sum_j g_j`` (paper eq. 5).

Site names are namespaced per client with ``numpyro.handlers.scope``: a site ``"beta"`` of client
``"bank"`` is called ``"bank/beta"`` in every model, guide and result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers


@dataclass(frozen=True)
class VFLClient:
    """One client of a vertical split.

    Args:
        name: unique name, used as the scope prefix of the client's sites.
        x: the client's columns: an array ``[n, p_j]`` or any pytree of arrays whose leading axis
            is the row (e.g. ``(x_j, group_index)``).
        submodel: ``submodel(x_j) -> g_j`` with ``g_j`` of shape ``[n]``.
    """

    name: str
    x: Any
    submodel: Callable

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(
                f"VFLClient name must be a non-empty string without '/', got {self.name!r}"
            )
        if not callable(self.submodel):
            raise TypeError(f"VFLClient {self.name!r}: submodel must be callable as submodel(x_j)")
        leaves = jax.tree_util.tree_leaves(self.x)
        if not leaves:
            raise ValueError(f"VFLClient {self.name!r}: x is empty; pass the client's columns")
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return  # rebuilt inside a compiled program: checked when the fit started
        n = np.shape(leaves[0])[0] if np.ndim(leaves[0]) else None
        for leaf in leaves:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != n:
                raise ValueError(
                    f"VFLClient {self.name!r}: every array in x needs the row on its leading "
                    f"axis with the same number of rows; got shapes "
                    f"{[np.shape(a) for a in leaves]}"
                )
            arr = np.asarray(leaf)
            if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
                raise ValueError(
                    f"VFLClient {self.name!r}: x contains NaN or inf; impute or drop those rows "
                    "on every client"
                )
        if n == 0:
            raise ValueError(f"VFLClient {self.name!r}: x has no rows")

    @property
    def num_rows(self) -> int:
        return int(np.shape(jax.tree_util.tree_leaves(self.x)[0])[0])

    def with_x(self, x) -> "VFLClient":
        """The same client holding other rows (e.g. test rows) of its columns."""
        return VFLClient(self.name, x, self.submodel)

    def scoped_submodel(self, x):
        """Run the sub-model on ``x`` with site names prefixed by ``name + '/'``."""
        with handlers.scope(prefix=self.name):
            g = self.submodel(x)
        return jnp.asarray(g)


def rows(x, index):
    """Rows ``index`` of every array of the pytree ``x``."""
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a)[index], x)


def check_clients(clients: Sequence[VFLClient], y=None) -> int:
    """Validate a vertical split and return the common number of rows ``n``."""
    if not isinstance(clients, (list, tuple)) or not clients:
        raise ValueError("clients must be a non-empty list of VFLClient")
    for c in clients:
        if not isinstance(c, VFLClient):
            raise TypeError(f"clients must be VFLClient instances, got {type(c).__name__}")
    names = [c.name for c in clients]
    if len(set(names)) != len(names):
        raise ValueError(f"client names must be unique, got {names}")
    n = clients[0].num_rows
    for c in clients:
        if c.num_rows != n:
            raise ValueError(
                f"all clients must hold the same rows: {clients[0].name!r} has {n} rows, "
                f"{c.name!r} has {c.num_rows}; align the rows (entity resolution) first"
            )
    for y_arr in map(np.asarray, jax.tree_util.tree_leaves(y)):
        if y_arr.ndim == 0 or y_arr.shape[0] != n:
            raise ValueError(
                f"y must have the clients' {n} rows on its leading axis, got {y_arr.shape}"
            )
        if np.issubdtype(y_arr.dtype, np.floating) and not np.all(np.isfinite(y_arr)):
            raise ValueError("y contains NaN or inf; drop those rows on every client")
    return n


def split_columns(feature_names: Sequence[str], covariates: Sequence[Sequence[str]]) -> list:
    """Column indices of each client from the original covariates it holds.

    A feature belongs to covariate ``c`` when its name is ``c`` or starts with ``c + "="`` or
    ``c + "_"`` (one-hot and indicator columns). Every feature must belong to exactly one client.

    Args:
      feature_names: the names of the columns of the design matrix, in order.
      covariates: one sequence of original covariate names per client.

    Returns:
      one integer array of column indices per client.
    """
    names = list(feature_names)
    owner = {}
    for j, group in enumerate(covariates):
        for cov in group:
            hits = [i for i, f in enumerate(names)
                    if f == cov or f.startswith(cov + "=") or f.startswith(cov + "_")]
            if not hits:
                raise ValueError(f"covariate {cov!r} matches no feature in {names}")
            for i in hits:
                if i in owner and owner[i] != j:
                    raise ValueError(f"feature {names[i]!r} is claimed by two clients")
                owner[i] = j
    unassigned = [names[i] for i in range(len(names)) if i not in owner]
    if unassigned:
        raise ValueError(f"features {unassigned} belong to no client; assign their covariates")
    return [np.array([i for i in range(len(names)) if owner[i] == j])
            for j in range(len(covariates))]
