"""``--trust swarm`` (NodeOptions.trust_swarm): forward only to members of this private swarm.

In a private swarm the members are exactly the peers that proved the swarm key (admission runs
before any protocol, membership needs a direct answered ping: docs/security.md), so the option
is a guarantee that the node is in one: it refuses to start without a key. Tested over real
nodes on 127.0.0.1 (simulated engine): a peer outside the swarm that holds the prompt and
connects is never forwarded to; a member is.
"""

from __future__ import annotations

import pytest
import trio

from peerinfer.cli import main
from peerinfer.client import Client
from peerinfer.core.messages import GenerateRequest, decode
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import ConfigError
from peerinfer.net import FramedStream
from peerinfer.node import GENERATE_PROTOCOL, Node, NodeOptions
from tests.node.test_trust_liars import COSTS, options, prompt, until_routed_for_its_cache

KEY = b"members only, please"


def test_trust_swarm_needs_a_swarm_key() -> None:
    with pytest.raises(ConfigError, match="needs a swarm key"):
        NodeOptions(engine="simulated", trust_swarm=True)
    assert NodeOptions(engine="simulated", trust_swarm=True, swarm_key=KEY).trust_swarm


def test_the_cli_refuses_trust_swarm_in_an_open_swarm(capsys: pytest.CaptureFixture[str]) -> None:
    # Refused while the options are built: before any engine, host or port.
    code = main(["node", "--engine", "simulated", "--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0",
                 "--trust", "swarm", "--trust", "12D3KooWexample"])
    assert code == 2
    assert "--trust swarm needs a swarm key" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("private", [True, False], ids=["trust-swarm", "open-control"])
async def test_with_trust_swarm_a_peer_outside_the_swarm_is_never_forwarded_to(private: bool) -> None:
    """``private``: origin and member share a key and the origin trusts the swarm only. The
    control is the same network all open, where the outsider does get the prompt it holds."""
    outsider_got: list[GenerateRequest] = []
    key = KEY if private else None
    async with trio.open_nursery() as nursery:
        member = Node(options(policy="local", swarm_key=key), engine=SimulatedEngine(costs=COSTS, time_scale=0.2))
        await nursery.start(member.serve)
        origin = Node(
            options(swarm_key=key, trust_swarm=private, bootstrap=(member.addresses()[0],)),
            engine=SimulatedEngine(costs=COSTS, time_scale=0.2),
        )
        await nursery.start(origin.serve)
        # The outsider (an open-swarm node) holds prompt 1 and dials the origin.
        outsider = Node(options(policy="local", bootstrap=(origin.addresses()[0],)),
                        engine=SimulatedEngine(costs=COSTS, time_scale=0.2))
        await nursery.start(outsider.serve)
        with trio.fail_after(60):
            async with Client.connect(member.addresses()[0], swarm_key=key, timeout_s=20) as client:
                await client.generate(prompt(0), max_tokens=2)
            async with Client.connect(outsider.addresses()[0], timeout_s=20) as client:
                await client.generate(prompt(1), max_tokens=2)

            async def record(stream: FramedStream) -> None:
                outsider_got.append(decode(await stream.receive(timeout=10), expected=GenerateRequest))  # type: ignore[arg-type]

            assert outsider.host is not None
            outsider.host.set_handler(GENERATE_PROTOCOL, record)
            assert origin.host is not None
            holders = [(prompt(0), member.peer_id)] + ([] if private else [(prompt(1), outsider.peer_id)])
            for text, holder in holders:
                await until_routed_for_its_cache(origin, text, holder)  # its digest reached the origin
            async with Client.connect(origin.addresses()[0], swarm_key=key, timeout_s=20) as client:
                for k in (0, 1, 1, 0, 1):
                    with trio.fail_after(20):
                        result = await client.generate(prompt(k), max_tokens=4)
                    if private:
                        # Prompt 1 is held only by the outsider: served in the swarm (here or
                        # by the member), never by the outsider.
                        assert result.served_by in (member.peer_id, origin.peer_id)
                        assert k == 1 or result.served_by == member.peer_id
        if private:
            assert outsider.peer_id not in origin.host.connected_peers()
            assert outsider.peer_id not in {p.peer_id for p in origin.status().peers}
            assert outsider_got == []
        else:
            assert len(outsider_got) >= 1  # the failure mode --trust swarm rules out
        nursery.cancel_scope.cancel()


