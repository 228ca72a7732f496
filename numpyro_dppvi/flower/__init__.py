"""DP-PVI across machines on Flower (``pip install numpyro_dppvi[flower]``; docs/deploy.md).

The same local rules (:mod:`numpyro_dppvi.pvi.local`), privacy plans and :class:`PrivacyLedger`
as ``fit_dppvi``, run as a Flower ``ServerApp`` (the server: ``q``, the factors as it has seen them,
the schedule) and a ``ClientApp`` (a data holder: its data, its factor, its noise seed, its budget
and its ledger, all on its own disk). Modules:

* :mod:`.schema`: the versioned messages (records of natural parameters and flat configs);
* :mod:`.settings`: what the server proposes (local settings) and what a node decides (node config);
* :mod:`.client_store`: a client's private state file (0600, atomic, fsynced, HMAC when keyed);
* :mod:`.local_update`: one client's plan, rule, keys and update, reusing ``pvi``;
* :mod:`.client_app`: the ``ClientApp`` (``numpyro_dppvi.flower.client_app:app``);
* :mod:`.coordinator`, :mod:`.exchange`, :mod:`.schedules`: the server's state, message
  exchange and schedules; :mod:`.server_app`: the ``ServerApp``;
* :mod:`.inprocess`: a ``Grid`` that runs many clients in this process (no Ray, no network);
* :mod:`.federation`, :mod:`.demo`: local SuperLink and SuperNode processes; ``dppvi deploy demo``.

Nothing outside this package imports it, and it needs ``flwr`` (checked here, with the fix named).
"""

from __future__ import annotations

try:
    import flwr  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "numpyro_dppvi.flower needs Flower: install the extra with `pip install numpyro_dppvi[flower]` "
        "(flwr>=1.41,<1.43)") from exc

from .schema import SCHEMA_VERSION, SchemaError

__all__ = ["SCHEMA_VERSION", "SchemaError"]
