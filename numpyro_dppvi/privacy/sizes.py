"""Client sizes a private fit may publish: declared public bounds, or the observed sizes.

Every setting a private fit derives from a client's size — the Poisson rate ``b / N_m``, the
sampler's charged deviation, the number of shards, the objective's scale, the padded shape, the
arrival weights of the asynchronous server — is published with the result (its ledger events and
settings) or shapes what is. Under ``neighbouring="add_remove"`` neighbouring data sets differ in
size, so a setting computed from the observed size ``n_m`` tells ``D`` from ``D`` plus one record with
certainty (issue 24, finding 1: the published rate gave ``n = 200.000`` against ``201.000``).

``Privacy(public_sizes=N)`` declares a public **upper bound** ``N_m`` per client (one int for all, or
one per client): "this hospital holds at most 5,000 patients". Every size-derived setting is then
computed from ``N_m`` alone, so the mechanism, its accounting and everything published are the same
for every data set of 1 to ``N_m`` rows, and the guarantee holds between any two of them that are
neighbours: ``D`` and ``D`` plus one record when that one fits, ``n_m + 1 <= N_m`` (an empty client is
refused). A client holding more rows than its bound is refused before anything is computed (in a fit the
error stays with the data holder; a Flower node's settings error reaches the server: a configuration outside
the guarantee's domain). Client-level DP derives nothing from a size; its declared bounds are checked and
published as declared.
The estimators stay unbiased: a Poisson batch at rate ``q_m = b / N_m`` holds ``q_m n_m <= b`` rows on
average and its sum is scaled by ``1 / q_m``; shard methods average over ``N_m``-derived shard counts,
empty shards adding nothing (a loose bound shrinks those changes by ``n_m / N_m``: declare a tight one).

Without declared sizes the observed ones are used. Under ``neighbouring="substitute"`` that is exact:
neighbours have equal sizes, the size is public by definition. Under add/remove the published settings
then disclose each client's size (the guarantee covers the records' values given the sizes): such a fit
warns with :class:`SizeDisclosureWarning`, naming both fixes.
"""

from __future__ import annotations

from numbers import Integral
from typing import Sequence

import numpy as np


class SizeDisclosureWarning(UserWarning):
    """A private fit under add/remove whose published settings are derived from the observed client sizes."""


def validated_public_sizes(value):
    """``None``, a positive int, or a non-empty sequence of positive ints (returned as a tuple)."""
    if value is None:
        return None
    if isinstance(value, Integral) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"public_sizes must be positive, got {value}.")
        return int(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence | np.ndarray):
        raise TypeError("public_sizes must be an int (every client's bound), a sequence of ints (one per client) "
                        f"or None, got {type(value).__name__}.")
    values = tuple(value)
    if not values or any(isinstance(v, bool) or not isinstance(v, Integral) or v < 1 for v in values):
        raise ValueError(f"public_sizes needs one positive int per client, got {list(values)[:10]}.")
    return tuple(int(v) for v in values)


def declared_sizes(public_sizes, observed, caller: str = "fit") -> np.ndarray:
    """The declared bounds ``N_m`` for clients holding ``observed`` rows (``[M]`` int); a client above
    its bound, or a list of the wrong length, is a ``ValueError`` naming the fix.

    Args:
      public_sizes: ``Privacy.public_sizes``: one int for all clients, or one bound per client.
      observed: ``[M]``: the number of rows each client holds.
      caller: the name of the public function the error messages start with. Default ``"fit"``.
    """
    observed = np.asarray(observed, np.int64)
    if isinstance(public_sizes, int):
        bounds = np.full(observed.shape, public_sizes, np.int64)
    else:
        bounds = np.asarray(public_sizes, np.int64)
        if bounds.shape != observed.shape:
            raise ValueError(f"{caller}: Privacy(public_sizes=...) has {bounds.size} values for {observed.size} "
                             "client(s); give one bound per client, or one int for all.")
    over = np.flatnonzero(observed > bounds)
    if over.size:
        raise ValueError(
            f"{caller}: client(s) {over.tolist()[:10]} hold {observed[over].tolist()[:10]} rows, more than their "
            f"declared public sizes {bounds[over].tolist()[:10]}. Declare an upper bound of what each client may "
            "hold (the guarantee covers every data set up to it), e.g. Privacy(public_sizes=...) with larger values.")
    return bounds


def public_client_sizes(privacy, observed, caller: str = "fit") -> np.ndarray:
    """The sizes every size-derived setting of a private fit is computed from: the declared bounds, else
    the observed sizes (with a :class:`SizeDisclosureWarning` under add/remove; module docstring).

    Args:
      privacy: the fit's :class:`~numpyro_dppvi.privacy.Privacy`, or None (the observed sizes, no warning).
      observed: ``[M]``: the number of rows each client holds.
      caller: the name of the public function the warning and error messages start with. Default ``"fit"``.
    """
    if privacy is None:
        return np.asarray(observed, np.int64)
    if privacy.public_sizes is not None:
        bounds = declared_sizes(privacy.public_sizes, observed, caller)
        if privacy.sampling == "without_replacement" and np.any(bounds != np.asarray(observed)):
            raise ValueError(
                f"{caller}: sampling='without_replacement' draws exactly b of a client's n_m rows, at rate b / n_m "
                "whatever bound is declared; under neighbouring='substitute' (which it needs) the sizes are public: "
                "leave public_sizes out, or use sampling='poisson' (whose rate b / N_m a bound sets).")
        return bounds
    if privacy.neighbouring == "add_remove":
        import warnings

        from ..diagnostics import user_stacklevel
        warnings.warn(
            f"{caller}: client sizes are not declared public, so the published settings (sampling rates, "
            "noise multipliers, shard counts) are derived from the observed sizes and disclose them: under "
            "neighbouring='add_remove' that tells a data set from the same one plus a record. Declare an upper "
            "bound per client, Privacy(public_sizes=...), or use neighbouring='substitute' (sizes public by "
            "definition). See docs/privacy.md, 'Client sizes'.", SizeDisclosureWarning, stacklevel=user_stacklevel())
    return np.asarray(observed, np.int64)


def fit_sizes(privacy, observed, privacy_unit: str = "example", caller: str = "fit") -> tuple:
    """``(declared, sizes)`` of a fit: the declared bounds checked against the clients (None without them; checked
    and published whatever the unit), and the sizes every size-derived setting (rates, charges, shard counts,
    scales, shapes, arrival weights) comes from: :func:`public_client_sizes`, or the observed sizes without privacy
    and under client-level DP, which derives nothing from a size (a client's rows stay inside its clipped change).

    Args:
      privacy: the fit's :class:`~numpyro_dppvi.privacy.Privacy`, or None.
      observed: ``[M]``: the number of rows each client holds.
      privacy_unit: ``"example"`` or ``"client"``. Default ``"example"``.
      caller: the name of the public function the warning and error messages start with. Default ``"fit"``.
    """
    declared = None if privacy is None or privacy.public_sizes is None else \
        declared_sizes(privacy.public_sizes, observed, caller)
    if privacy is None or privacy_unit == "client":
        return declared, np.asarray(observed, np.int64)
    return declared, public_client_sizes(privacy, observed, caller)
