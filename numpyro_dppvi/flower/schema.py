"""The messages between the ServerApp and a ClientApp (version :data:`SCHEMA_VERSION`).

Pure functions between the package's objects and Flower ``RecordDict``s (no ``Message``: building
one needs a running Flower task). Flower encodes arrays with ``np.save(allow_pickle=False)``, bit
for bit; its config records are flat (``int | float | str | bytes | bool`` and lists of one of
them), so nested values travel as JSON strings.

Server -> client, ``train`` (:class:`Instruction`):

* ``"q"``: ArrayRecord ``eta1``, ``eta2`` (the global posterior, natural parameters); a low-rank Gaussian
  (``family="low_rank"``) carries ``eta2`` as three arrays ``eta2.diag``, ``eta2.core`` and ``eta2.basis``
  (``eta2 = diag(diag) + basis core basis^T``; the basis is public, :mod:`numpyro_dppvi.pvi.low_rank`);
* ``"t_m"``: ArrayRecord ``eta1``, ``eta2`` (the server's view of the client's factor; ``q`` is
  ``prior * prod_m t_m`` as the server has seen them, so the cavity ``q / t_m`` uses this view);
* ``"config"``: ConfigRecord ``schema``, ``fit_id``, ``round``, ``client_id`` (whom the server
  believes it addresses), ``method``, ``model``, ``settings`` (:class:`LocalSettings` as JSON).

Client -> server, reply to ``train`` (:class:`Reply`):

* ``"delta"``: ArrayRecord ``eta1``, ``eta2``, the change of the client's factor,
  ``delta = rho (eta(q_new) - eta(q))`` (zeros when it refused or its update was not finite); low-rank: in the
  wider basis ``[B, E]`` of the client's answer, which the server widens ``B`` by before adding;
* ``"curvature"`` (noise-aware DP optimisation only): ArrayRecord ``curvature``, the full ``[D, D]`` curvature of
  the client's factor as its releases estimate it, ``bias``, the part of it that the estimate's own noise
  adds (:func:`numpyro_dppvi.pvi.noise_aware.curvature_noise_bias`), and ``gain_noise``, the variance that
  noise adds to the client's pull on the mean (:func:`numpyro_dppvi.pvi.noise_aware.gain_noise_covariance`;
  all three post-processing of its releases), from which the server gives ``q`` its noise-aware (co)variances;
* ``"diagnostics"``: MetricRecord of data-free values only (``update_finite``, ``factor_in_sync`` (not for
  low rank, whose factors the server truncates),
  and for DP optimisation the data-free part of the last local loss);
* ``"status"``: ConfigRecord ``schema``, ``client_id``, ``status`` (``"ok"`` | ``"refused"``),
  ``reason`` (why it refused: :data:`REFUSALS`), ``detail`` (text), ``participations`` (steps of
  this fit charged so far) and ``ledger`` (the client's own :class:`PrivacyLedger` as JSON, ``""``
  when the method is not private). The server keeps it as a mirror: the client's copy on its own
  disk is the authority.

Server -> client, ``query.hello`` (:class:`Hello`) and its reply (:class:`Identity`): the fit id
and model; the client's id, the model it agrees to fit, the shapes and dtypes of one data row (the
model's signature), its number of rows (public, as in ``fit_dppvi``), the methods it runs and its
ledger. No data value is ever part of a message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..factors import Gaussian, LowRank
from .settings import LocalSettings

#: 2: LocalSettings.tail_average; 3: LocalSettings.family ([D, D] eta2); 4: family "low_rank" (eta2 as diag, core,
#: basis) and LocalSettings.rank; 5: LocalSettings.noise_aware and the reply's ``curvature``; 6: the reply's
#: curvature ``bias``; 7: the reply's ``gain_noise``
SCHEMA_VERSION = "numpyro_dppvi.flower/7"
#: Message types: one local update; the introduction that maps a Flower node to a client.
TRAIN = "train"
HELLO = "query.hello"
STATUSES = ("ok", "refused")
#: Why a client refuses (it then touched no data and was charged nothing, except ``"budget"``
#: where nothing more is charged either): the next step would pass its budget; the method, model or
#: settings are not what it agreed to; the message addressed another client; the message expired.
REFUSALS = ("budget", "method", "model", "settings", "client", "expired", "cavity")


class SchemaError(ValueError):
    """A message that does not follow :data:`SCHEMA_VERSION` (names the fix)."""


@dataclass(frozen=True)
class Instruction:
    """Server -> client: one local update (message type ``train``).

    Attributes:
        fit_id: the fit's id; a client keeps one fit record per id.
        round: the round the update belongs to (1-based).
        client_id: the client the server believes it addresses (a node that is another client refuses).
        method: ``"dp_optimisation"`` or ``"pvi"``.
        model: the model reference ``"package.module:function"``.
        settings: the local update's :class:`~numpyro_dppvi.flower.settings.LocalSettings` (fixed within a fit).
        q: the global posterior (natural parameters; low rank: ``eta2`` a
            :class:`~numpyro_dppvi.factors.LowRank` in a public basis).
        t_m: the server's view of the client's factor (the cavity is ``q / t_m``).
    """

    fit_id: str
    round: int
    client_id: str
    method: str
    model: str
    settings: LocalSettings
    q: Gaussian
    t_m: Gaussian


@dataclass(frozen=True)
class Reply:
    """Client -> server: the reply to an :class:`Instruction`; what the client releases.

    Attributes:
        client_id: the replying client's own id.
        status: ``"ok"`` or ``"refused"`` (:data:`STATUSES`).
        delta: the change of the client's factor, ``rho (eta(q_new) - eta(q))`` (zeros when it refused or
            its update was not finite; low rank: in the wider basis ``[B, E]`` of its answer).
        reason: why it refused, one of :data:`REFUSALS` (``""`` when ``"ok"``).
        detail: a text for people (no data value).
        participations: the steps of this fit charged to the client so far.
        ledger: the client's own :class:`~numpyro_dppvi.privacy.PrivacyLedger` as a dict
            (``to_dict``), None when the method is not private; the server keeps a mirror.
        diagnostics: data-free values only (``update_finite``, ``factor_in_sync``, the data-free part of
            DP optimisation's last loss), floats.
        curvature: noise-aware DP optimisation only: the ``[D, D]`` curvature of the client's factor as
            its releases estimate it (post-processing), else None.
        curvature_bias: the part of ``curvature`` the estimate's own noise adds, else None (encoded as
            zeros when ``curvature`` is given without it).
        gain_noise: the covariance the curvature's noise adds to the client's pull on the mean
            (:func:`numpyro_dppvi.pvi.noise_aware.gain_noise_covariance`), else None (zeros likewise).
    """

    client_id: str
    status: str
    delta: Gaussian
    reason: str = ""
    detail: str = ""
    participations: int = 0
    ledger: dict | None = None
    diagnostics: dict = field(default_factory=dict)
    curvature: np.ndarray | None = None
    curvature_bias: np.ndarray | None = None
    gain_noise: np.ndarray | None = None


@dataclass(frozen=True)
class Hello:
    """Server -> node (``query.hello``): who are you? Carries the fit's id and model reference."""

    fit_id: str
    model: str


@dataclass(frozen=True)
class Identity:
    """Node -> server: the reply to :class:`Hello`, the client's public introduction (no data value).

    Attributes:
        client_id: the client's own id (from its node config), stable across Flower node ids.
        model: the model it agrees to fit: the :class:`Hello`'s when its node config names the same one,
            else ``""``.
        row_shapes: the shape of one data row per data array (the model's signature).
        row_dtypes: the dtype of each data array, as strings.
        num_rows: the node's public size: its declared public-size bound, else its number of rows.
        methods: the methods the node runs.
        ledger: its :class:`~numpyro_dppvi.privacy.PrivacyLedger` as a dict, None before its first private step.
    """

    client_id: str
    model: str
    row_shapes: tuple
    row_dtypes: tuple
    num_rows: int  # the node's public size: its declared public-size bound, else its number of rows
    methods: tuple
    ledger: dict | None = None


# --------------------------------------------------------------------------- encoding

LOW_RANK_PARTS = ("diag", "core", "basis")


def _gaussian_record(g: Gaussian) -> ArrayRecord:
    if isinstance(g.eta2, LowRank):
        parts = {f"eta2.{part}": Array(np.asarray(getattr(g.eta2, part))) for part in LOW_RANK_PARTS}
        return ArrayRecord({"eta1": Array(np.asarray(g.eta1)), **parts})
    return ArrayRecord({"eta1": Array(np.asarray(g.eta1)), "eta2": Array(np.asarray(g.eta2))})


def _gaussian(records: RecordDict, name: str) -> Gaussian:
    record = _record(records, name, ArrayRecord)
    try:
        if "eta2" not in record and "eta2.diag" in record:
            return Gaussian(record["eta1"].numpy(), LowRank(*(record[f"eta2.{part}"].numpy() for part in LOW_RANK_PARTS)))
        return Gaussian(record["eta1"].numpy(), record["eta2"].numpy())
    except KeyError as exc:
        raise SchemaError(f"array record {name!r} lacks {exc}; expected eta1 and eta2 (or eta2.diag, eta2.core and "
                          "eta2.basis)") from exc


def _record(records: RecordDict, name: str, kind):
    if name not in records:
        raise SchemaError(f"message lacks the {kind.__name__} {name!r} of {SCHEMA_VERSION}: the sender runs another "
                          "version of numpyro_dppvi; install the same version on server and nodes")
    record = records[name]
    if not isinstance(record, kind):
        raise SchemaError(f"{name!r} is a {type(record).__name__}, expected a {kind.__name__}")
    return record


def _config(records: RecordDict, name: str, keys: tuple) -> ConfigRecord:
    record = _record(records, name, ConfigRecord)
    version = record.get("schema")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"message schema {version!r} is not {SCHEMA_VERSION!r}: server and node run different "
                          "versions of numpyro_dppvi; install the same version on both")
    missing = [k for k in keys if k not in record]
    if missing:
        raise SchemaError(f"{name!r} lacks {missing} ({SCHEMA_VERSION})")
    return record


def _ledger_json(ledger: dict | None) -> str:
    return "" if ledger is None else json.dumps(ledger, sort_keys=True)


def _ledger(text: str) -> dict | None:
    return json.loads(text) if text else None


def encode_instruction(instruction: Instruction) -> RecordDict:
    """The ``RecordDict`` of a ``train`` message: ``"q"``, ``"t_m"`` and ``"config"`` (module docstring)."""
    i = instruction
    return RecordDict({
        "q": _gaussian_record(i.q), "t_m": _gaussian_record(i.t_m),
        "config": ConfigRecord({"schema": SCHEMA_VERSION, "fit_id": i.fit_id, "round": int(i.round),
                                "client_id": i.client_id, "method": i.method, "model": i.model,
                                "settings": i.settings.to_json()}),
    })


def decode_instruction(records: RecordDict) -> Instruction:
    """The :class:`Instruction` a ``train`` message carries; raises :class:`SchemaError` when a record or key
    is missing, of the wrong kind, or of another schema version."""
    c = _config(records, "config", ("fit_id", "round", "client_id", "method", "model", "settings"))
    return Instruction(str(c["fit_id"]), int(c["round"]), str(c["client_id"]), str(c["method"]), str(c["model"]),
                       LocalSettings.from_json(c["settings"]), _gaussian(records, "q"), _gaussian(records, "t_m"))


def encode_reply(reply: Reply) -> RecordDict:
    """The ``RecordDict`` of a reply to ``train``: ``"delta"``, ``"diagnostics"``, ``"status"`` and, when
    ``reply.curvature`` is given, ``"curvature"`` (float32); raises :class:`SchemaError` for an unknown status."""
    r = reply
    if r.status not in STATUSES:
        raise SchemaError(f"status {r.status!r} is not one of {STATUSES}")
    metrics = {k: float(v) for k, v in r.diagnostics.items()}
    records = {
        "delta": _gaussian_record(r.delta),
        "diagnostics": MetricRecord(metrics),
        "status": ConfigRecord({"schema": SCHEMA_VERSION, "client_id": r.client_id, "status": r.status,
                                "reason": r.reason, "detail": r.detail, "participations": int(r.participations),
                                "ledger": _ledger_json(r.ledger)}),
    }
    if r.curvature is not None:
        bias = np.zeros_like(r.curvature) if r.curvature_bias is None else r.curvature_bias
        gain = np.zeros_like(r.curvature) if r.gain_noise is None else r.gain_noise
        records["curvature"] = ArrayRecord({"curvature": Array(np.asarray(r.curvature, np.float32)),
                                            "bias": Array(np.asarray(bias, np.float32)),
                                            "gain_noise": Array(np.asarray(gain, np.float32))})
    return RecordDict(records)


def decode_reply(records: RecordDict) -> Reply:
    """The :class:`Reply` a reply to ``train`` carries; raises :class:`SchemaError` when it does not follow
    :data:`SCHEMA_VERSION` (or names an unknown status)."""
    c = _config(records, "status", ("client_id", "status", "reason", "detail", "participations", "ledger"))
    if c["status"] not in STATUSES:
        raise SchemaError(f"status {c['status']!r} is not one of {STATUSES}")
    diagnostics = dict(_record(records, "diagnostics", MetricRecord))
    curvature = bias = gain = None
    if "curvature" in records:
        record = _record(records, "curvature", ArrayRecord)
        for name in ("curvature", "bias", "gain_noise"):
            if name not in record:
                raise SchemaError(f"array record 'curvature' lacks its array {name!r}")
        curvature, bias, gain = (record[name].numpy() for name in ("curvature", "bias", "gain_noise"))
    return Reply(str(c["client_id"]), str(c["status"]), _gaussian(records, "delta"), str(c["reason"]),
                 str(c["detail"]), int(c["participations"]), _ledger(c["ledger"]), diagnostics, curvature, bias,
                 gain)


def encode_hello(hello: Hello) -> RecordDict:
    """The ``RecordDict`` of a ``query.hello`` message: the ConfigRecord ``"config"``."""
    return RecordDict({"config": ConfigRecord({"schema": SCHEMA_VERSION, "fit_id": hello.fit_id,
                                               "model": hello.model})})


def decode_hello(records: RecordDict) -> Hello:
    """The :class:`Hello` a ``query.hello`` message carries; raises :class:`SchemaError` as
    :func:`decode_instruction` does."""
    c = _config(records, "config", ("fit_id", "model"))
    return Hello(str(c["fit_id"]), str(c["model"]))


def encode_identity(identity: Identity) -> RecordDict:
    """The ``RecordDict`` of a reply to ``query.hello``: the ConfigRecord ``"identity"`` (shapes, dtypes,
    methods and ledger as JSON strings)."""
    i = identity
    return RecordDict({"identity": ConfigRecord({
        "schema": SCHEMA_VERSION, "client_id": i.client_id, "model": i.model,
        "row_shapes": json.dumps([list(s) for s in i.row_shapes]), "row_dtypes": json.dumps(list(i.row_dtypes)),
        "num_rows": int(i.num_rows), "methods": json.dumps(list(i.methods)), "ledger": _ledger_json(i.ledger)})})


def decode_identity(records: RecordDict) -> Identity:
    """The :class:`Identity` a reply to ``query.hello`` carries; raises :class:`SchemaError` as
    :func:`decode_instruction` does."""
    c = _config(records, "identity", ("client_id", "model", "row_shapes", "row_dtypes", "num_rows", "methods",
                                      "ledger"))
    return Identity(str(c["client_id"]), str(c["model"]), tuple(tuple(s) for s in json.loads(c["row_shapes"])),
                    tuple(json.loads(c["row_dtypes"])), int(c["num_rows"]), tuple(json.loads(c["methods"])),
                    _ledger(c["ledger"]))
