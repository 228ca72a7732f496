"""The server's schedules over Flower nodes (``pvi.server``'s, with real messages and real failures).

* :func:`sequential_round`: clients in turn (in the order they joined), each from the ``q`` left by
  the previous one; each waits at most ``round_timeout`` seconds for its reply.
* :func:`synchronous_round`: every active client from the same ``q``; replies collected until all
  have arrived or the deadline passes; the changes that arrived are summed once; late clients are
  dropped for the round (their factors unchanged).
* :func:`asynchronous_rounds`: one message in flight per client; each change is applied on arrival
  and the client gets the current ``q`` back; a "round" is as many arrivals as there are clients.

Every round first introduces nodes the server has not met (``query.hello``): a client is known by
its own id, so a restarted SuperNode (a new Flower node id) keeps its factor. A client whose node
is gone, whose reply is an error or late, or who refuses, is reported in the round's history entry
and its factor stays unchanged; a client that refuses for its budget, or because it does not run
this fit's method, model or settings, takes no further part.
"""

from __future__ import annotations

import time
from typing import Callable

from flwr.app import Message

from ..pvi.driver import FitDiverged
from .coordinator import ClientRecord, ClientRejected, Coordinator, RoundLog
from .exchange import Exchange, error_reason
from .schema import HELLO, TRAIN, Hello, SchemaError, decode_identity, decode_reply, encode_hello, encode_instruction


def introduce_new_nodes(coord: Coordinator, exchange: Exchange, timeout: float, rejected: dict) -> None:
    """Ask every node the server has not met who it is (in parallel) and register the replies in node
    order; nodes that left lose their mapping. ``rejected``: node id -> why it cannot join."""
    nodes = exchange.node_ids()
    for client in coord.clients:
        if client.node_id is not None and client.node_id not in nodes:
            client.node_id = None
    mapped = {c.node_id for c in coord.clients if c.node_id is not None}
    new = sorted(nodes - mapped - set(rejected))
    hello = encode_hello(Hello(coord.fit_id, coord.model_ref))
    sent = [s for s in (exchange.send(n, hello, HELLO, ttl=timeout, payload=n) for n in new) if s is not None]
    replies = sorted(exchange.collect(sent, timeout), key=lambda pair: pair[0].node_id)
    for s, reply in replies:
        if reply.has_error():
            continue  # not reachable now: asked again next round
        try:
            coord.register(decode_identity(reply.content), s.node_id)
        except (ClientRejected, SchemaError) as exc:
            rejected[s.node_id] = str(exc)
    for s in sent:
        exchange.forget(s)


def book(coord: Coordinator, client: ClientRecord, reply: Message, log: RoundLog):
    """The change a reply carries (or None), with its outcome in ``log``."""
    if reply.has_error():
        log.dropped[client.index] = error_reason(reply)
        return None
    try:
        return coord.receive(client, decode_reply(reply.content), log)
    except SchemaError as exc:
        log.dropped[client.index] = f"bad reply: {exc}"
        return None


def _check(coord: Coordinator, before) -> None:
    """Raise :class:`FitDiverged` (carrying the result before the round, as ``fit_dppvi`` does) when ``q``
    is no longer a proper Gaussian."""
    if not coord.valid():
        raise FitDiverged(f"round {coord.round + 1} made q improper (non-finite or non-positive precision); in the "
                          "run config, lower damping, learning-rate or local-steps", before)


def _send_train(coord: Coordinator, exchange: Exchange, client: ClientRecord, round_timeout: float, log: RoundLog):
    """Send ``client`` its round instruction; ``None`` (and the reason in ``log``) when it cannot be sent."""
    if client.node_id is None:
        log.dropped[client.index] = "unavailable"
        return None
    sent = exchange.send(client.node_id, encode_instruction(coord.instruction(client)), TRAIN, round_timeout,
                         client, group_id=str(coord.round + 1))
    if sent is None:  # the link refused the message: a node it no longer lists (stopped, lost) is unavailable
        gone = client.node_id not in exchange.node_ids()
        log.dropped[client.index] = "unavailable (the link no longer lists its node)" if gone else "not sent"
    return sent


def sequential_round(coord: Coordinator, exchange: Exchange, round_timeout: float) -> RoundLog:
    """One sequential round: each active client in turn gets the current ``q``, and its change is applied
    before the next is asked. A client waits at most ``round_timeout`` seconds for its reply (else it is
    dropped as ``"late"``). Returns the round's :class:`RoundLog`; raises
    :class:`~numpyro_dppvi.pvi.driver.FitDiverged` when a change makes ``q`` improper."""
    log, before = RoundLog(), coord.result()
    for client in coord.active():
        sent = _send_train(coord, exchange, client, round_timeout, log)
        if sent is None:
            continue
        replies = exchange.collect([sent], round_timeout)
        if not replies:
            log.dropped[client.index] = "late"
            exchange.forget(sent)
            continue
        delta = book(coord, client, replies[0][1], log)
        if delta is not None:
            coord.apply([(client, delta)])
            _check(coord, before)
    return log


def synchronous_round(coord: Coordinator, exchange: Exchange, round_timeout: float) -> RoundLog:
    """One synchronous round: every active client gets the same ``q``; the replies that arrive within
    ``round_timeout`` seconds are applied as one sum (in client order), late clients are dropped for the
    round. Returns the round's :class:`RoundLog`; raises :class:`~numpyro_dppvi.pvi.driver.FitDiverged`
    when the sum makes ``q`` improper."""
    log, before = RoundLog(), coord.result()
    sent = [s for s in (_send_train(coord, exchange, client, round_timeout, log) for client in coord.active())
            if s is not None]
    replies = exchange.collect(sent, round_timeout)
    answered = {s.message_id for s, _ in replies}
    for s in sent:
        if s.message_id not in answered:
            log.dropped[s.payload.index] = "late"
            exchange.forget(s)
    changes = []
    for s, reply in sorted(replies, key=lambda pair: pair[0].payload.index):
        delta = book(coord, s.payload, reply, log)
        if delta is not None:
            changes.append((s.payload, delta))
    coord.apply(changes)
    _check(coord, before)
    return log


def asynchronous_rounds(coord: Coordinator, exchange: Exchange, round_timeout: float, rounds: int,
                        end_round: Callable[[RoundLog, float], None], clock=time.monotonic) -> None:
    """``rounds`` rounds of arrivals (``len(active clients)`` arrivals each), one message in flight per
    client; ``end_round(log, seconds)`` closes each round."""
    per_round = max(len(coord.active()), 1)
    total = rounds * per_round
    state = {"sent": 0}
    in_flight: dict[str, object] = {}

    def dispatch(client: ClientRecord) -> None:
        if client.stopped or client.node_id is None or state["sent"] >= total or client.client_id in in_flight:
            return
        s = exchange.send(client.node_id, encode_instruction(coord.instruction(client)), TRAIN, round_timeout, client)
        if s is not None:
            in_flight[client.client_id] = s
            state["sent"] += 1

    for client in coord.active():
        dispatch(client)
    arrivals, log, start, before = 0, RoundLog(), clock(), coord.result()
    while in_flight and arrivals < total:
        replies = exchange.collect(list(in_flight.values()), round_timeout, any_one=True)
        if not replies:  # nobody answered within the deadline: drop them all and stop
            for s in in_flight.values():
                log.dropped[s.payload.index] = "late"
                exchange.forget(s)
            in_flight.clear()
            break
        for s, reply in replies:
            client = s.payload
            in_flight.pop(client.client_id, None)
            delta = book(coord, client, reply, log)
            log.arrivals.append(client.index)
            if delta is not None:
                coord.apply([(client, delta)])
                _check(coord, before)
            arrivals += 1
            if arrivals % per_round == 0:
                end_round(log, clock() - start)
                log, start, before = RoundLog(), clock(), coord.result()
            dispatch(client)
    if log.arrivals or log.dropped:
        end_round(log, clock() - start)
