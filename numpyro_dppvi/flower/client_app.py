"""The ClientApp a data holder runs: ``numpyro_dppvi.flower.client_app:app``.

It comes from the node's own installed ``numpyro_dppvi`` (the server's app bundle names it and
ships no client code), reads its settings from the node config (:class:`NodeSettings`) and keeps
its state on its own disk (:mod:`.client_store`). One ``train`` message is one local update, taken
in this order:

1. Refusals that need no data: another client addressed, another model, a method the node does not
   run, settings changed within a fit, an expired message, an invalid cavity ``q / t_m``.
2. The budget (private methods): at a fit's first step the noise is calibrated to the node's
   ``(epsilon, delta)`` given what the ledger already holds; at every step the client refuses if
   ``epsilon(ledger + this participation) > epsilon``, and the ledger records the stop. An
   instruction the node cannot calibrate is refused (``"calibration"``) without touching the ledger.
   The data are not read before this check.
3. The update on the node's own rows, with a key of the client's secret seed.
4. The charge, the new factor and the next key number are written durably (:func:`client_store.save`).
5. Only then the reply: the factor change, data-free diagnostics and the client's ledger.

An exception's text travels to the server (Flower's error reply carries ``str(exception)``), and an
error raised on the node's rows can name a row or a value (``validate_clients`` names the row of a
NaN). So an exception raised while the node reads or uses its rows, other than a
:class:`SettingsError` (which names a setting of the node's config, never a record), leaves as a
:class:`ClientDataError` that names only its type; the full text and traceback go to the node's own
log (:data:`log`). Errors before the data are read (a refusal, a state file failing its HMAC) keep
their text.

``query.hello`` introduces the client (its id, model signature, size and ledger) without touching
anything but the shapes of its data.
"""

from __future__ import annotations

import contextlib
import logging
import time

import jax
import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .. import factors
from ..factors import Gaussian
from . import client_store, local_update
from .client_store import ClientState
from .schema import (Identity, Instruction, Reply, decode_hello, decode_instruction, encode_identity,
                     encode_reply)
from .settings import NodeSettings, SettingsError

app = ClientApp()
#: The node's own log: the details of failures on its data are written here and never sent.
log = logging.getLogger("numpyro_dppvi.flower.client")


class ClientDataError(RuntimeError):
    """A failure of the client on its own data; its details stay in the node's log."""


@contextlib.contextmanager
def details_stay_on_the_node(node: NodeSettings):
    """Re-raise any exception but a :class:`SettingsError` as a :class:`ClientDataError` naming only
    its type (module docstring); the original goes to :data:`log` with its traceback."""
    try:
        yield
    except SettingsError:
        raise
    except Exception as exc:  # noqa: BLE001 - any text could carry a record's value
        log.exception("client %s failed on its own data", node.client_id)
        raise ClientDataError(f"client {node.client_id} failed on its own data ({type(exc).__name__}); the "
                              "details are in the node's log and are not sent") from None


@app.query("hello")
def hello(message: Message, context: Context) -> Message:
    """Answer ``query.hello`` with the client's :class:`~numpyro_dppvi.flower.schema.Identity`.

    Releases only public facts: the client's id, the model it agrees to fit (``""`` when the server's is
    not its own), the shapes and dtypes of one row, its public size
    (:meth:`~numpyro_dppvi.flower.settings.NodeSettings.size_of`), the methods it runs and its ledger. At the
    first hello the data file is read once, under the state lock, to record that signature in the state
    file; nothing is charged and no data value leaves."""
    node = node_settings(context)
    request = decode_hello(message.content)
    with client_store.locked(node):
        state = client_store.load(node)
        if state.num_rows is None:
            with details_stay_on_the_node(node):
                record_signature(state, local_update.load_data(node))
            client_store.save(state, node)
    model = node.model if request.model == node.model else ""
    identity = Identity(node.client_id, model, tuple(tuple(s) for s in state.row_shapes), tuple(state.row_dtypes),
                        node.size_of(state.num_rows), node.methods,
                        None if state.ledger is None else state.ledger.to_dict())
    return Message(encode_identity(identity), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """Answer one ``train`` message with the :class:`~numpyro_dppvi.flower.schema.Reply` of
    :func:`take_step`, under the state lock; the message's remaining TTL decides whether it expired."""
    node = node_settings(context)
    instruction = decode_instruction(message.content)
    seconds_left = message.metadata.created_at + message.metadata.ttl - time.time()
    with client_store.locked(node):
        state = client_store.load(node)
        reply = take_step(node, state, instruction, seconds_left)
    return Message(encode_reply(reply), reply_to=message)


def node_settings(context: Context) -> NodeSettings:
    """The node's :class:`NodeSettings` from its Flower node config; also turns on JAX's persistent
    compilation cache when ``compilation-cache`` is set (each message runs in a fresh process)."""
    node = NodeSettings.from_node_config(context.node_config)
    if node.compilation_cache is not None:  # a fresh process per message: reuse compiled programs from disk
        from ..persistent_cache import enable_compilation_cache

        enable_compilation_cache(node.compilation_cache)
    return node


def record_signature(state: ClientState, arrays) -> None:
    """Keep the public facts of the node's data: its number of rows, and the shape and dtype of one row."""
    state.num_rows = int(arrays[0].shape[0])
    state.row_shapes = [list(a.shape[1:]) for a in arrays]
    state.row_dtypes = [str(a.dtype) for a in arrays]


def take_step(node: NodeSettings, state: ClientState, instruction: Instruction, seconds_left: float) -> Reply:
    """One local update under the protocol of the module docstring; returns the reply to send."""
    i = instruction
    fit = state.fit if state.fit is not None and state.fit["fit_id"] == i.fit_id else None
    zero = jax.tree.map(lambda x: np.zeros(np.shape(x), np.float32), i.q)
    if factors.is_low_rank(i.q):  # a change in q's own basis (LowRank sums keep the left operand's basis)
        zero = zero._replace(eta2=zero.eta2._replace(basis=np.asarray(i.q.eta2.basis, np.float32)))

    def refuse(reason: str, detail: str) -> Reply:
        ledger = None if state.ledger is None else state.ledger.to_dict()
        return Reply(node.client_id, "refused", zero, reason, detail, 0 if fit is None else fit["participations"],
                     ledger)

    refusal = refusal_without_data(node, fit, i, seconds_left)
    if refusal is not None:
        return refuse(*refusal)
    if state.num_rows is None:  # a client that never said hello: learn its (public) size first
        with details_stay_on_the_node(node):
            record_signature(state, local_update.load_data(node))
    plan = None
    if i.method != "pvi":
        plan, why, spent = budget_check(node, state, fit, i)
        if plan is None and not spent:  # an instruction this node cannot calibrate: refused, budget untouched
            return refuse("calibration", why)
        if plan is None:  # the ledger records the stop, written before the refusal leaves
            if 0 not in state.ledger.stopped:
                state.ledger.stop(0, "epsilon_max", i.round)
                client_store.save(state, node)
            return refuse("budget", why)

    # -- from here on the client reads its data
    with details_stay_on_the_node(node):  # an error from here on may carry a record: its text stays here
        arrays = local_update.load_data(node)
        if [list(a.shape[1:]) for a in arrays] != state.row_shapes or arrays[0].shape[0] != state.num_rows:
            raise ValueError(f"data-file {node.data_file} changed since this client's first message; a client's data "
                             "and its size are fixed (give changed data a new state-dir and client-id)")
        adapter = local_update.adapter_for(local_update.load_model(node.model), arrays)
        if adapter.dim != np.shape(i.q.eta1)[-1]:
            raise ValueError(f"q has {np.shape(i.q.eta1)[-1]} coordinates but model {node.model} has {adapter.dim} on "
                             "this data; server and node fit different models")
        rule = local_update.make_rule(i.method, adapter, i.settings, plan)
        template = local_update.initial_rule_state(rule, plan, arrays, np.ones(state.num_rows, bool), None)
        if fit is None:
            fit = {"fit_id": i.fit_id, "method": i.method, "model": i.model, "settings": i.settings.to_json(),
                   "noise_multiplier": None if plan is None else float(plan.noise_multipliers[0]), "participations": 0}
            rule_state, own = template, zero
        else:
            rule_state, own = local_update.rule_state_from(template, state.rule_leaves), state.factor
        if node.test_fit_key is not None:  # tests only (NodeSettings checks the environment): fit_dppvi's keys
            key = local_update.simulated_fit_key(state.seed, i.round - 1, node.test_client_index)
        else:
            key = local_update.noise_key(state.seed, state.exchanges)
        delta, rule_state, loss, finite = local_update.run_update(rule, i.settings.damping, i.q, i.t_m, arrays, key,
                                                                  rule_state, node.size_of(state.num_rows))

    # -- the charge, written durably before anything leaves the client
    if plan is not None:
        state.ledger.record(0, plan.event(0, 1))
    fit["participations"] += 1
    state.fit = fit
    state.exchanges += 1
    # the factor the server will hold; a low-rank one is rebased and truncated there, so it is not kept here
    low = factors.is_low_rank(i.q)
    state.factor = None if low else Gaussian(*(np.asarray(t, np.float32) + np.asarray(d, np.float32)
                                                for t, d in zip(i.t_m, delta)))
    state.rule_leaves = local_update.rule_state_leaves(rule_state)
    client_store.save(state, node)

    diagnostics = {"update_finite": float(finite)}
    if not low:
        in_sync = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in zip(own, i.t_m))
        diagnostics["factor_in_sync"] = float(in_sync)
    if i.method != "pvi":
        diagnostics["loss"] = loss  # DP optimisation reports the data-free part of its loss only
    # noise-aware DP optimisation: the factor's curvature as the releases estimate it (post-processing)
    aware = i.settings.noise_aware and finite
    curvature = np.asarray(rule_state["factor_curvature"]) if aware else None
    bias = np.asarray(rule_state["curvature_bias"]) if aware else None
    gain = np.asarray(rule_state["gain_noise"]) if aware else None
    return Reply(node.client_id, "ok", delta, participations=fit["participations"],
                 ledger=None if state.ledger is None else state.ledger.to_dict(), diagnostics=diagnostics,
                 curvature=curvature, curvature_bias=bias, gain_noise=gain)


def refusal_without_data(node: NodeSettings, fit: dict | None, i: Instruction,
                         seconds_left: float) -> tuple[str, str] | None:
    """``(reason, detail)`` when the message asks for something the node did not agree to (or cannot
    use), decided from the message, the node config and the fit record alone; else None."""
    if i.client_id != node.client_id:
        return "client", f"this node is client {node.client_id!r}, not {i.client_id!r}"
    if i.model != node.model:
        return "model", f"this node fits model {node.model!r} only"
    if i.method not in node.methods:
        return "method", (f"this node runs {list(node.methods)} (set epsilon for private methods, "
                          "allow-non-private=true for method='pvi')")
    if fit is not None and (fit["method"], fit["model"], fit["settings"]) != (i.method, i.model, i.settings.to_json()):
        return "settings", "a fit's method, model and local settings are fixed at its first step"
    try:
        i.settings.check_method(i.method)
    except SettingsError as exc:
        return "settings", str(exc)
    dim = int(np.shape(i.q.eta1)[-1])
    layout = gaussian_layout(i.settings, dim)
    if any(gaussian_shapes(g) != layout for g in (i.q, i.t_m)):
        return "settings", (f"q and t_m must be {i.settings.family} Gaussians ({layout}), got {gaussian_shapes(i.q)} "
                            f"and {gaussian_shapes(i.t_m)}")
    if factors.is_low_rank(i.q) and not np.array_equal(i.q.eta2.basis, i.t_m.eta2.basis):
        return "settings", "q and t_m must share one public basis (the server rebases every factor into q's)"
    if seconds_left <= 0:
        return "expired", "the message expired before the client started"
    if not bool(factors.is_proper(factors.divide(i.q, i.t_m))):
        return "cavity", "the cavity q / t_m is not a proper Gaussian"
    return None


def gaussian_layout(settings, dim: int) -> dict:
    """The array shapes of a Gaussian of ``settings.family`` over ``dim`` latents, as :func:`gaussian_shapes` gives
    them (low rank: ``eta2`` as diagonal ``[D]``, core ``[r, r]`` and basis ``[D, r]``, ``r`` the settings' rank)."""
    if settings.family == "low_rank":
        r = settings.resolved_rank(dim)
        return {"eta1": (dim,), "eta2.diag": (dim,), "eta2.core": (r, r), "eta2.basis": (dim, r)}
    return {"eta1": (dim,), "eta2": (dim, dim) if settings.family == "full_rank" else (dim,)}


def gaussian_shapes(g: Gaussian) -> dict:
    """The array shapes of ``g`` by record name (``eta1`` and ``eta2``, or ``eta2.diag``, ``eta2.core`` and
    ``eta2.basis`` for a low-rank ``eta2``), to compare with :func:`gaussian_layout`."""
    if factors.is_low_rank(g):
        return {"eta1": np.shape(g.eta1), **{f"eta2.{k}": np.shape(v) for k, v in g.eta2._asdict().items()}}
    return {"eta1": np.shape(g.eta1), "eta2": np.shape(g.eta2)}


def budget_check(node: NodeSettings, state: ClientState, fit: dict | None, i: Instruction):
    """``(plan, "", False)`` when the node's budget pays one more participation, else ``(None, why, spent)``.

    The plan is calibrated at a fit's first step (to what the ledger leaves of the node's budget) and
    pinned afterwards; the step is allowed while ``epsilon(ledger + plan.event(1)) <= epsilon``
    (``fit_dppvi``'s stop rule, checked against every fit on the node's data). ``spent``: the budget
    itself refuses (a fit under way would pass it, or the node stopped earlier), and the node stops for
    good. An instruction the node cannot calibrate (e.g. ``batch_size >= n``, or more planned rounds than
    what is left of the budget pays) is refused with ``spent=False``: one such instruction from a server
    used to stop the node for good, with nothing spent (issue 24, finding 4)."""
    ledger = state.ledger_for(node)
    if 0 in ledger.stopped:
        return None, f"the node's budget epsilon={node.epsilon} is spent", True
    # noise coordinates of one release: the gradient of (loc, log_scale), a full-rank q's (loc, L), a low-rank's
    # (loc, log_scale, W)
    dimension = local_update.noise_dimension(i.settings, int(np.shape(i.q.eta1)[-1]))
    try:
        size = node.size_of(state.num_rows)  # a declared public bound, else the number of rows
        plan = (local_update.calibrated_plan(node, i.settings, size, dimension, ledger.events(0))
                if fit is None or fit["noise_multiplier"] is None else
                local_update.pinned_plan(node, i.settings, size, dimension, fit["noise_multiplier"]))
    except ValueError as exc:  # settings that cannot be calibrated, or no noise meets what is left of the budget
        return None, f"this instruction cannot be calibrated on this node: {exc}", False
    if ledger.epsilon_if(0, plan.event(0, 1)) > node.epsilon * (1 + 1e-9):
        return None, f"one more participation would pass epsilon={node.epsilon}", fit is not None
    return plan, "", False
