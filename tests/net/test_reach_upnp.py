"""UPnP port mapping (``peerinfer node --upnp``) on the emulated internet.

Topology: ``pub`` (bootstrap and relay), ``home1`` behind a cone NAT whose router offers no UPnP,
``home2`` behind a router that runs a UPnP gateway (miniupnpd, secure mode: a LAN host may map
ports to itself only). Both homes start with ``--upnp``. home2's router maps its port, so the
dial-back test finds it reachable: it advertises its router's address and needs no relay, and
their connection ends up direct. home1 finds no gateway and falls back to a relay reservation. When
home2 stops, its mapping is removed. Every namespace, link and process (the gateway too) is
removed by ``emulated_internet``, also on failure.
"""

from __future__ import annotations

import json
import os

import pytest

from peerinfer.testing.netns import (
    NODE_PORT,
    emulated_internet,
    netns_unavailable,
    upnp_gateway_unavailable,
)
from tests.net.test_reach_netns import FAST, SHARED, generate, status, wait_for

_UNAVAILABLE = netns_unavailable() or upnp_gateway_unavailable()
if _UNAVAILABLE is not None and os.environ.get("PEERINFER_REQUIRE_NETNS") == "1":
    raise RuntimeError(f"the emulated internet with a UPnP gateway cannot run here: {_UNAVAILABLE}")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=str(_UNAVAILABLE)),
]


def test_a_node_behind_a_upnp_router_maps_its_port_and_is_reached_directly() -> None:
    with emulated_internet((("home1", False), ("home2", False)), upnp=("home2",)) as net:
        costs = net.workdir / "costs.json"
        costs.write_text(json.dumps(FAST.to_dict()))
        args = ["--costs", str(costs), "--announce-interval", "0.5"]
        pub = net.spawn_node("pub", extra_args=args)
        net.wait_ready([pub])
        home1 = net.spawn_node("home1", bootstrap=[pub.addr], extra_args=[*args, "--upnp"])
        home2 = net.spawn_node("home2", bootstrap=[pub.addr], extra_args=[*args, "--upnp"])
        net.wait_ready([home1, home2])
        uplink = net.sites["home2"].uplink
        mapped = f"/ip4/{uplink}/tcp/{NODE_PORT}/p2p/{home2.peer_id}"

        # home2's router forwards its port (a DNAT rule of the gateway's) ...
        wait_for(lambda: net.upnp_mappings("home2"), lambda text: f"10.2.0.2:{NODE_PORT}" in text, 30,
                 "home2's router maps its port")
        # ... and home2 advertises its router's address.
        wait_for(lambda: status(net, "home2", home2)["addrs"], lambda addrs: mapped in addrs, 30,
                 "home2 advertises its mapped address")
        # home1's router has no gateway: it falls back to a relayed address through pub.
        wait_for(lambda: status(net, "home1", home1)["addrs"],
                 lambda addrs: any("p2p-circuit" in a for a in addrs), 60, "home1 reserves a relay slot")
        assert not any(str(uplink) in a for a in status(net, "home1", home1)["addrs"])

        # home2 holds a prefix; home1 is served by it. home2 has no relayed address at all
        # (the dial-back test found its mapped port open), so that connection is direct.
        warm = generate(net, "home2", home2, SHARED + " warm up")
        assert warm.served_by == home2.peer_id

        def home1_sees_home2(s: dict[str, object]) -> bool:
            peers = s["peers"]
            assert isinstance(peers, list)
            return any(p["peer_id"] == home2.peer_id and p["cached_tokens"] >= 256 and p["rtt_ms"] for p in peers)

        wait_for(lambda: status(net, "home1", home1), home1_sees_home2, 60, "home1 sees home2's digest")
        for i in range(3):
            result = generate(net, "home1", home1, SHARED + f" question {i}")
            assert result.served_by == home2.peer_id
            assert result.cached_tokens >= 256
        assert not any("p2p-circuit" in a for a in status(net, "home2", home2)["addrs"])
        # Their connection ends up direct, to home2's mapped port: home1 dials it there, or, if
        # home2 dialed home1 first (through home1's relay: home1 is behind a plain NAT), hole
        # punching upgrades it within seconds (seen in a full-suite run).
        wait_for(lambda: net.established_tcp_peers("home1"), lambda peers: str(uplink) in peers, 60,
                 "a direct flow from home1 to home2's router")

        # A graceful stop removes the mapping.
        home2.terminate()
        assert home2.wait_exit_blocking(15.0) is not None
        wait_for(lambda: net.upnp_mappings("home2"), lambda text: f"10.2.0.2:{NODE_PORT}" not in text, 10,
                 "home2's mapping removed when it stopped")
