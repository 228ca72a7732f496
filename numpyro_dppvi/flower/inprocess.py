"""A Flower ``Grid`` that runs the ClientApp of many nodes inside this process (no Ray, no network).

What a SuperLink and the SuperNodes do between them, done in one process for one-machine runs and
tests: each pushed instruction is checked as the SuperLink checks it, encoded and decoded as on
the wire (so the ClientApp shares no Python object with the server), and handed at once to the
node's ClientApp with the node's ``Context`` (its node config, and its state through its protobuf
form), as ``client_app(message=..., context=...)``, Flower's runtime call. The reply is checked
and wire-encoded the same way. A ClientApp exception becomes Flower's error reply (code 2).

Faults, as a deployment shows them: :meth:`InProcessGrid.stop_node` (the SuperLink's "node
unavailable", code 5, and the node leaves ``get_node_ids``), :meth:`~InProcessGrid.restart_node`
(the same node config under a new node id, as a restarted SuperNode), and
:meth:`~InProcessGrid.hold_replies` (a slow network: the client runs, its reply arrives only after
:meth:`~InProcessGrid.release_replies`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid

from ..results import DPPVIResult
from . import _compat
from ._compat import ErrorCode


#: Node ids of a list of node configs (1 is the SuperLink's own id in Flower).
FIRST_NODE_ID = 1001


@dataclass
class _Node:
    config: dict
    context: Context
    up: bool = True
    held: tuple | None = None  # message types whose replies are delayed (None: none)


class InProcessGrid(Grid):
    """Runs ``client_app`` for the nodes of ``node_configs`` (a list: node ids 1001, 1002, ... in its
    order; or ``{node_id: node_config}``, ids other than the SuperLink's 1). ``serialize=False`` skips the wire encoding (faster, less faithful)."""

    def __init__(self, client_app, node_configs: Sequence[Mapping] | Mapping[int, Mapping], run_id: int = 1,
                 serialize: bool = True):
        self.client_app = client_app
        self.run_id = int(run_id)
        self.serialize = serialize
        self._run = _compat.empty_run(run_id)
        if not isinstance(node_configs, Mapping):
            node_configs = {FIRST_NODE_ID + i: cfg for i, cfg in enumerate(node_configs)}
        if _compat.SUPERLINK_NODE_ID in node_configs:
            raise ValueError(f"node id {_compat.SUPERLINK_NODE_ID} is the SuperLink's; number the nodes from 2")
        self._nodes: dict[int, _Node] = {}
        self._ids = itertools.count(max(node_configs, default=0) + 1)
        for node_id, config in node_configs.items():
            self._add(int(node_id), config)
        self._replies: dict[str, Message] = {}
        self._held: dict[int, list[tuple[str, Message]]] = {}
        self.in_flight: dict[int, int] = {}  # node id -> instructions whose replies are not pulled yet
        self.max_in_flight = 0
        self.delivered: list[tuple[int, str]] = []  # (node id, message type) in delivery order
        _compat.set_server_identity(self.run_id)

    def _add(self, node_id: int, config) -> None:
        context = Context(run_id=self.run_id, node_id=node_id, node_config=dict(config), state=RecordDict(),
                          run_config={})
        self._nodes[node_id] = _Node(dict(config), context)

    # -- the Grid interface ----------------------------------------------------------------------
    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [node_id for node_id, node in self._nodes.items() if node.up]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message_id = _compat.stamp_message_id(message)
            errors = _compat.validation_errors(message, reply=False)
            if errors:
                raise ValueError(f"invalid instruction: {errors}")
            ids.append(message_id)
            node_id = message.metadata.dst_node_id
            self.in_flight[node_id] = self.in_flight.get(node_id, 0) + 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight[node_id])
            self._deliver(_compat.wire_copy(message) if self.serialize else message)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = []
        for message_id in message_ids:
            reply = self._replies.pop(message_id, None)
            if reply is not None:
                out.append(reply)
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    # -- faults ----------------------------------------------------------------------------------
    def stop_node(self, node_id: int) -> None:
        """The node goes away: it leaves ``get_node_ids`` and instructions to it fail with code 5."""
        self._nodes[node_id].up = False

    def restart_node(self, node_id: int) -> int:
        """The node's SuperNode restarts: the same node config (and disk) under a new node id."""
        old = self._nodes.pop(node_id)
        new_id = next(self._ids)
        self._add(new_id, old.config)
        return new_id

    def hold_replies(self, node_id: int, message_types: tuple = ("train",)) -> None:
        """The node's replies to ``message_types`` are delayed until :meth:`release_replies` (it still runs
        every instruction at once)."""
        self._nodes[node_id].held = tuple(message_types)

    def release_replies(self, node_id: int) -> None:
        self._nodes[node_id].held = None
        for message_id, reply in self._held.pop(node_id, []):
            self._replies[message_id] = reply

    # -- delivery --------------------------------------------------------------------------------
    def _deliver(self, message: Message) -> None:
        node_id = message.metadata.dst_node_id
        node = self._nodes.get(node_id)
        self.delivered.append((node_id, message.metadata.message_type))
        if node is None or not node.up:
            reply = _compat.link_error(message, ErrorCode.NODE_UNAVAILABLE, "node unavailable (in-process grid)")
        else:
            reply = self._run_client(node, message)
        self.in_flight[node_id] -= 1
        if node is not None and node.held and message.metadata.message_type in node.held:
            self._held.setdefault(node_id, []).append((message.metadata.message_id, reply))
        else:
            self._replies[message.metadata.message_id] = reply

    def _run_client(self, node: _Node, message: Message) -> Message:
        context = _compat.wire_copy_context(node.context) if self.serialize else node.context
        try:
            reply = self.client_app(message=message, context=context)
            node.context = context  # a SuperNode keeps the state of a run only when the ClientApp succeeded
        except Exception as exc:  # noqa: BLE001 - Flower turns any exception into an error reply
            reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc)}:<'{exc}'>"), reply_to=message)
        _compat.stamp_message_id(reply)
        errors = _compat.validation_errors(reply, reply=True)
        if errors:
            return _compat.link_error(message, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, "; ".join(errors))
        return _compat.wire_copy(reply) if self.serialize else reply


def run_inprocess(run_config: Mapping, node_configs, grid: InProcessGrid | None = None,
                  report=lambda text: None) -> DPPVIResult:
    """A fit with the package's ServerApp body and ClientApp over an :class:`InProcessGrid`."""
    from .client_app import app as client_app
    from .server_app import serve

    grid = InProcessGrid(client_app, node_configs) if grid is None else grid
    return serve(grid, dict(run_config), report=report)
