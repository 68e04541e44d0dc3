"""Joining from behind a NAT does not wait for the dial-back verdict (peerinfer.net.reach).

Behind a NAT the verdict "not reachable" comes only when the peers' dial-backs time out
(DIALBACK_TIMEOUT_S); before the first verdict a relay slot is reserved meanwhile, and given
up if the verdict turns out "reachable". On loopback, with a relay whose dial-back answer is
held back (as a dropped SYN holds it back behind a NAT) and then says what the test wants.
"""

from __future__ import annotations

import pytest
import trio

from peerinfer.net import FramedStream, open_host
from peerinfer.net.reach import DIALBACK_PROTOCOL, ReachSettings, run_reach
from peerinfer.net.relay import RelaySettings, open_relay
from tests.net.net_helpers import config, wait_until

KEY = b"the members' key"
HELD_S = 3.0


@pytest.mark.parametrize("answer", [b"0", b"1"])
async def test_a_relay_slot_is_reserved_before_the_verdict_and_kept_only_if_unreachable(answer: bytes) -> None:
    cfg = config(swarm_key=KEY)
    async with open_host(cfg) as relay_host, open_host(cfg) as home, trio.open_nursery() as nursery:
        async def held_dialback(stream: FramedStream) -> None:
            await stream.receive()
            await trio.sleep(HELD_S)
            await stream.send(answer)

        relay_host.set_handler(DIALBACK_PROTOCOL, held_dialback)
        async with open_relay(relay_host, RelaySettings(service=True)):
            state = await nursery.start(run_reach, home, ReachSettings(relay_service=False))
            asked_at = trio.current_time()
            await home.connect(relay_host.listen_addrs()[0])
            await wait_until(lambda: bool(state.reservations), timeout=HELD_S)
            assert state.reachable is None, "the reservation waited for the verdict"
            assert trio.current_time() - asked_at < HELD_S
            circuit = next(iter(state.reservations.values()))
            assert circuit in home.dialable_addrs()
            await wait_until(lambda: state.reachable is not None, timeout=HELD_S + 10)
            if answer == b"0":  # behind a NAT: the slot stays, advertised
                assert state.reachable is False
                assert circuit in home.dialable_addrs()
            else:  # reachable after all: the speculative slot is given up
                assert state.reachable is True
                assert state.reservations == {}
                assert not any("p2p-circuit" in a for a in home.dialable_addrs())
        nursery.cancel_scope.cancel()


async def test_the_reservation_is_tried_again_while_the_relay_is_not_serving_yet() -> None:
    """A relay that has just started serves relay only once its own first peers dialed it
    back: the joining node's reservation, refused at first, is tried again before its own
    verdict is in."""
    cfg = config(swarm_key=KEY)
    async with open_host(cfg) as relay_host, open_host(cfg) as home, trio.open_nursery() as nursery:
        async def held_dialback(stream: FramedStream) -> None:
            await stream.receive()
            await trio.sleep(HELD_S)
            await stream.send(b"0")

        relay_host.set_handler(DIALBACK_PROTOCOL, held_dialback)
        async with open_relay(relay_host, RelaySettings(service=True), serve_now=False) as relay:
            state = await nursery.start(run_reach, home, ReachSettings(relay_service=False))
            await home.connect(relay_host.listen_addrs()[0])
            await trio.sleep(HELD_S / 3)
            assert state.reservations == {}  # refused: no relay service yet
            relay.enable_service()
            await wait_until(lambda: bool(state.reservations), timeout=HELD_S)
            assert state.reachable is None, "the reservation waited for the verdict"
        nursery.cancel_scope.cancel()
