"""The sink table and request ids (peerinfer/node/sinks.py), in trio's virtual time."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from peerinfer.core.messages import ErrorMessage, Message, TokenChunk
from peerinfer.node.sinks import Sink, SinkTable, forward_request_id, node_request_id
from peerinfer.types import RequestId


def _sink(client_id: str) -> tuple[Sink, trio.MemoryReceiveChannel[Message]]:
    send, receive = trio.open_memory_channel[Message](math.inf)
    return Sink(send, client_id, started=0.0, prompt_tokens=3), receive


def test_request_ids_are_per_requester_and_a_forward_names_its_attempt() -> None:
    rid = node_request_id("http:127.0.0.1", "a/b")
    assert rid == RequestId("http:127.0.0.1/a/b")
    assert forward_request_id(rid, 2, retry=False) == "b~2"
    assert forward_request_id(rid, 2, retry=True) == "b~2r"
    long = node_request_id("peer", "x" * 100)
    assert forward_request_id(long, 1, retry=False) == "x" * 64 + "~1"


async def test_waiting_for_the_table_to_empty_ends_with_its_last_sink(
    autojump_clock: trio.testing.MockClock,
) -> None:
    table = SinkTable()
    with trio.fail_after(1):
        await table.wait_empty()  # empty: at once
    first, first_rx = _sink("one")
    second, _ = _sink("two")
    table.add(RequestId("p/one"), first)
    table.add(RequestId("p/two"), second)
    emptied_at: list[float] = []

    async def waiter() -> None:
        await table.wait_empty()
        emptied_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(5)
        table.relay_tokens(first, [1, 2], "ab")
        table.finish(first, ErrorMessage("one", "internal", "x"))
        table.finish(first, ErrorMessage("one", "internal", "again"))  # once only
        await trio.sleep(5)
        assert not emptied_at and len(table) == 1
        table.discard(RequestId("p/two"))
    assert emptied_at == [10.0]
    got = [first_rx.receive_nowait(), first_rx.receive_nowait()]
    assert isinstance(got[0], TokenChunk) and got[0].token_ids == (1, 2)
    assert isinstance(got[1], ErrorMessage) and got[1].message == "x"
    assert first.first_token_at == 5.0 and first.completion_ids == [1, 2]
    # Frames after the end are dropped.
    table.relay_tokens(first, [3], "c")
    with pytest.raises(trio.WouldBlock):
        first_rx.receive_nowait()
