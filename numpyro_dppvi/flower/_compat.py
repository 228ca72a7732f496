"""The only module that touches Flower internals (``flwr>=1.41,<1.43``; see pyproject's pin).

The public Flower API (``flwr.app``, ``flwr.clientapp``, ``flwr.serverapp``) is used everywhere
else. The in-process grid also needs what a SuperLink and a SuperNode do between them: the task
identity a ``Message`` reads when it is built, the wire encoding of messages and contexts, the
SuperLink's message validation and its error replies. Those are internal to Flower, so they are
kept here, where a Flower upgrade is checked in one place.
"""

from __future__ import annotations

import time
import uuid

from flwr.app import Context, Error, Message, Metadata
from flwr.app.message.message import make_message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.server.utils.validator import validate_message
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["SUPERLINK_NODE_ID", "ErrorCode", "Run", "empty_run", "link_error", "set_server_identity",
           "stamp_message_id", "validation_errors", "wire_copy", "wire_copy_context"]


def set_server_identity(run_id: int) -> None:
    """Make this process the server task of run ``run_id``, as Flower's runtimes do before calling a
    ServerApp (``Message(content, dst_node_id, message_type)`` reads this identity)."""
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = int(run_id)
    TaskIdentity.node_id = SUPERLINK_NODE_ID


def empty_run(run_id: int) -> Run:
    return Run.create_empty(int(run_id))


def stamp_message_id(message: Message, message_id: str | None = None) -> str:
    """Give a pushed message its id, as ``HttpGrid.push_messages`` does (a fresh uuid here)."""
    message_id = message_id or uuid.uuid4().hex
    message.metadata.__dict__["_message_id"] = message_id
    return message_id


def validation_errors(message: Message, reply: bool) -> list[str]:
    """The SuperLink's checks of an instruction (``reply=False``) or a reply."""
    return validate_message(message, is_reply_message=reply)


def wire_copy(message: Message) -> Message:
    """``message`` encoded and decoded as on the wire (Flower's content-addressed objects, arrays as
    ``np.save`` bytes without pickle): the receiver shares no Python object with the sender."""
    objects = get_all_nested_objects(message)
    contents = {object_id: obj.deflate() for object_id, obj in objects.items()}
    copy = inflate_object_from_contents(message.object_id, contents)
    if not isinstance(copy, Message):  # pragma: no cover - a Flower change
        raise TypeError(f"wire round trip returned {type(copy).__name__}, not a Message")
    copy.metadata.__dict__["_message_id"] = message.metadata.message_id
    return copy


def wire_copy_context(context: Context) -> Context:
    """A node's ``Context`` through its protobuf form, as a SuperNode hands it to a ClientApp process."""
    return context_from_proto(context_to_proto(context))


def link_error(instruction: Message, code: int, reason: str) -> Message:
    """The error reply a SuperLink makes itself for ``instruction`` (node unavailable, TTL expired):
    from and to the SuperLink, linked to the instruction by ``reply_to_message_id``."""
    meta = instruction.metadata
    now = time.time()
    metadata = Metadata(run_id=meta.run_id, message_id="", src_node_id=SUPERLINK_NODE_ID,
                        dst_node_id=SUPERLINK_NODE_ID, reply_to_message_id=meta.message_id,
                        group_id=meta.group_id, created_at=now, ttl=max(meta.ttl - (now - meta.created_at), 0.0),
                        message_type=meta.message_type)
    return make_message(metadata=metadata, error=Error(int(code), reason))
