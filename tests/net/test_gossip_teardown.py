"""A ban blacklists a connected peer in pubsub; py-libp2p 0.8.1 then deletes the peer after
awaiting its stream's reset, by which time the disconnect handler may have removed it: the
KeyError ended the pubsub service and with it the node (a flaky liar test showed it).
``GuardedPubsub._teardown_if_connected`` tolerates that interleaving."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from peerinfer.net.gossip import GuardedPubsub


def test_teardown_tolerates_the_peer_removed_while_its_stream_resets() -> None:
    forgotten: list[str] = []
    state = SimpleNamespace(peers={}, _forget_all_subscriptions=forgotten.append)

    class Stream:
        async def reset(self) -> None:
            await trio.sleep(0)
            state.peers.pop("peer", None)  # the disconnect handler ran meanwhile

    state.peers["peer"] = Stream()
    trio.run(GuardedPubsub._teardown_if_connected, state, "peer")  # type: ignore[arg-type]
    assert state.peers == {} and forgotten == ["peer"]
    # Not connected at all: only the subscriptions are forgotten.
    trio.run(GuardedPubsub._teardown_if_connected, state, "other")  # type: ignore[arg-type]
    assert forgotten == ["peer", "other"]
