"""Sending instructions and collecting replies over any Flower ``Grid``, with deadlines.

``push_messages`` then our own ``pull_messages`` loop every ``poll_interval`` seconds (Flower's
``send_and_receive`` polls every 3 s on a real SuperLink). Replies are matched to instructions by
``reply_to_message_id``: a SuperLink's own error replies (node unavailable, message expired) come
from the SuperLink, not from the node. A reply that misses its deadline is not waited for; the
instruction's TTL equals the deadline, so the SuperLink stops delivering it then. A client may
still have taken the step (and charged its own ledger): its factor on the server is unchanged,
and the client's ledger, sent with its next reply, says what it spent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flwr.app import Message, RecordDict

from ._compat import ErrorCode

#: What a Flower error code means for the fit (other codes: the client failed).
ERROR_REASONS = {
    ErrorCode.NODE_UNAVAILABLE: "unavailable",
    ErrorCode.MESSAGE_UNAVAILABLE: "expired",
    ErrorCode.REPLY_MESSAGE_UNAVAILABLE: "expired",
    ErrorCode.CLIENT_APP_RAISED_EXCEPTION: "client error",
    ErrorCode.CLIENT_APP_CRASHED: "client crashed",
    ErrorCode.LOAD_CLIENT_APP_EXCEPTION: "client app not loadable",
}


@dataclass
class Sent:
    """One instruction in flight."""

    message_id: str
    node_id: int
    payload: object  # whatever the caller needs back with the reply (e.g. the client record)
    sent_at: float


def error_reason(reply: Message) -> str:
    """``"<meaning> (code c): <Flower's reason>"`` of an error reply."""
    code, reason = reply.error.code, reply.error.reason or ""
    return f"{ERROR_REASONS.get(code, 'error')} (code {code}): {reason}"[:500]


class Exchange:
    """Push/pull over ``grid`` with deadlines (see the module docstring)."""

    def __init__(self, grid, poll_interval: float = 0.2, clock=time.monotonic, sleep=time.sleep):
        self.grid = grid
        self.poll_interval = float(poll_interval)
        self.clock = clock
        self.sleep = sleep
        self.in_flight: dict[str, Sent] = {}

    def node_ids(self) -> set[int]:
        return set(int(n) for n in self.grid.get_node_ids())

    def send(self, node_id: int, content: RecordDict, message_type: str, ttl: float, payload=None,
             group_id: str = "") -> Sent | None:
        """Push one instruction; None when the grid refused it (the caller drops that client)."""
        message = Message(content, dst_node_id=int(node_id), message_type=message_type, ttl=float(ttl),
                          group_id=group_id)
        (message_id,) = list(self.grid.push_messages([message]))
        if not message_id:
            return None
        sent = Sent(message_id, int(node_id), payload, self.clock())
        self.in_flight[message_id] = sent
        return sent

    def collect(self, wanted: list[Sent], timeout: float, any_one: bool = False) -> list[tuple[Sent, Message]]:
        """Replies to ``wanted`` that arrive within ``timeout`` seconds: all of them, or (``any_one``)
        as soon as at least one has arrived. The others stay in flight."""
        deadline = self.clock() + float(timeout)
        waiting = {s.message_id: s for s in wanted}
        out: list[tuple[Sent, Message]] = []
        while waiting:
            for reply in self.grid.pull_messages(list(waiting)):
                sent = waiting.pop(reply.metadata.reply_to_message_id, None)
                if sent is not None:
                    self.in_flight.pop(sent.message_id, None)
                    out.append((sent, reply))
            if not waiting or (any_one and out) or self.clock() >= deadline:
                break
            self.sleep(min(self.poll_interval, max(deadline - self.clock(), 0.0)))
        return out

    def forget(self, sent: Sent) -> None:
        """Stop waiting for ``sent`` (late): a reply that comes later is ignored."""
        self.in_flight.pop(sent.message_id, None)
