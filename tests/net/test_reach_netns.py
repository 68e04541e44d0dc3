"""Nodes behind emulated home NATs (peerinfer.testing.netns): they join through a public node,
reserve relay slots on it, and serve each other's requests through it.

Topology: ``pub`` (bootstrap and relay, 10.200.0.1), ``home1`` and ``home2`` each behind its own
cone NAT router, ``home3`` behind a symmetric (random-port) NAT (and, for the partition,
``pub2``: a second public node). No home is reachable from outside; every namespace, link and
process is removed by the fixture, also on failure. Skipped where network namespaces cannot be
made (not root, no ``nft``).

Healing (a cut link, a partition) is asserted as 0 lost requests and reconvergence within a
generous bound (HEAL_BOUND_S); how many announce intervals it took is printed here and measured
by bench/reach_bench.py (docs/reach.md, "Healing").
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from peerinfer.client import Client, GenerationResult
from peerinfer.core.costmodel import CostModel
from peerinfer.testing.cluster import NodeHandle
from peerinfer.testing.netns import Internet, emulated_internet, netns_unavailable, run_in_netns
from tests.conftest import body_failed

_UNAVAILABLE = netns_unavailable()
if _UNAVAILABLE is not None and os.environ.get("PEERINFER_REQUIRE_NETNS") == "1":
    # `make test` runs as root with nftables installed (CI does): a skip there would hide a
    # broken set-up, so it fails instead.
    raise RuntimeError(f"the emulated internet cannot run here: {_UNAVAILABLE}")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=str(_UNAVAILABLE)),
]

#: Prefill dominates so strongly (~1.2 s for the shared prefix) that a holder behind a relay
#: (a round trip of 100-200 ms on this emulated net under load) always beats recomputing.
FAST = CostModel(
    prefill_s_per_token=0.002, cached_s_per_token=0.00001, decode_s_per_token=0.002,
    overhead_s=0.002, slots=1,
)
SHARED = " ".join(f"shared{i}" for i in range(300))
HOMES = ("home1", "home2", "home3")
#: Short, so the tests are quick; reconvergence is reported in these units.
ANNOUNCE_S = 0.5
#: What the tests allow for reconvergence after a heal (the issue's target, 3 announce
#: intervals, is measured by bench/reach_bench.py --heal and reported in docs/reach.md: a
#: test asserting it would fail on a loaded machine without anything being wrong).
HEAL_BOUND_S = 150.0


@pytest.fixture
def internet(request: pytest.FixtureRequest) -> Iterator[tuple[Internet, dict[str, NodeHandle]]]:
    """The emulated internet with one node per site, all started and printing their address
    (``@pytest.mark.pub_args(...)``: extra flags for the public node; ``@pytest.mark.pub2``: a
    second public node, ``pub2``, that the homes bootstrap from too)."""
    marker = request.node.get_closest_marker("pub_args")
    pub_args = list(marker.args) if marker is not None else []
    with emulated_internet() as net:
        costs = net.workdir / "costs.json"
        costs.write_text(json.dumps(FAST.to_dict()))
        args = ["--costs", str(costs), "--announce-interval", str(ANNOUNCE_S)]
        pub = net.spawn_node("pub", extra_args=args + pub_args)
        net.wait_ready([pub])
        publics = {"pub": pub}
        if request.node.get_closest_marker("pub2") is not None:
            publics["pub2"] = net.spawn_node("pub2", bootstrap=[pub.addr], extra_args=args)
            net.wait_ready([publics["pub2"]])
        boot = [p.addr for p in publics.values()]
        homes = {h: net.spawn_node(h, bootstrap=boot, extra_args=args) for h in HOMES}
        net.wait_ready(list(homes.values()))
        yield net, {**publics, **homes}
        if body_failed(request):
            # The test failed after the nodes were up: their logs go with the report (the
            # namespaces and work directory are removed on leaving this block).
            sys.stderr.write(net.logs() + "\n")
    # Leaving the block removed every namespace of this run.
    from peerinfer.testing.netns import _namespaces

    assert not [n for n in _namespaces() if n.startswith(net.prefix)]
    assert all(not h.alive for h in net.nodes)


def generate(net: Internet, site: str, node: NodeHandle, prompt: str) -> GenerationResult:
    async def go() -> GenerationResult:
        async with Client.connect(node.addr, timeout_s=30) as client:
            return await client.generate(prompt, max_tokens=3)

    return run_in_netns(net.sites[site].namespace, go)


def status(net: Internet, site: str, node: NodeHandle) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with Client.connect(node.addr, timeout_s=10) as client:
            return await client.status()

    return run_in_netns(net.sites[site].namespace, go)


def wait_for(probe: Callable[[], Any], ok: Callable[[Any], bool], timeout_s: float, what: str) -> Any:
    last: Any = None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        last = probe()
        if ok(last):
            return last
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout_s} s: {what}; last seen: {last!r}")


def holds(peer_id: str, min_tokens: int = 256) -> Callable[[dict[str, Any]], bool]:
    def ok(s: dict[str, Any]) -> bool:
        view = next((p for p in s["peers"] if p["peer_id"] == peer_id), None)
        # rtt_ms > 0: it answered a ping over a connection of ours (direct or relayed), so it
        # is a routing candidate, not only a digest heard of through gossip (status reports 0
        # for a peer with no measured round trip).
        return view is not None and view["cached_tokens"] >= min_tokens and view["rtt_ms"] > 0

    return ok


def served_after_heal(
    net: Internet, site: str, node: NodeHandle, holder: NodeHandle, prefixes: tuple[str, ...]
) -> list[str]:
    """Who served each of ``prefixes`` (each cached only by ``holder``) sent to ``node`` in turn,
    up to the first one ``holder`` served. Right after a heal the first such request can still
    end on ``node`` itself (answered, not lost: once in CI, on a loaded machine, where the
    asker's status already showed the holder's digest and a round trip), so one more prefix is
    allowed, and the asker's view (counters, round trips, reputations) is printed when that
    happens, to tell a failover from a routing choice."""
    served: list[str] = []
    for prefix in prefixes:
        served.append(generate(net, site, node, prefix + " after").served_by)
        if served[-1] == holder.peer_id:
            break
        view = status(net, site, node)
        print(f"after the heal, {site} served {prefix[:12]}... by {served[-1]}; its requests "
              f"{view['requests']}, its peers {[(p['peer_id'][-6:], p['rtt_ms'], p['reputation']) for p in view['peers']]}")
    return served


def test_home_nodes_behind_nats_serve_each_other_through_the_relay(
    internet: tuple[Internet, dict[str, NodeHandle]],
) -> None:
    net, nodes = internet
    holder = nodes["home2"]
    # Without a relay nothing could reach home2: it is behind its router, not routable.
    warm = generate(net, "home2", holder, SHARED + " warm up")
    assert warm.served_by == holder.peer_id
    for asker in ("home1", "home3"):  # a cone-NAT peer and a symmetric-NAT peer
        wait_for(lambda a=asker: status(net, a, nodes[a]), holds(holder.peer_id), 60,
                 f"{asker} sees home2's digest")
    # home2 advertises a relayed address through pub; pub, publicly reachable, none.
    addrs = status(net, "home2", holder)["addrs"]
    assert any(f"/p2p/{nodes['pub'].peer_id}/p2p-circuit/p2p/{holder.peer_id}" in a for a in addrs)
    assert not any("p2p-circuit" in a for a in status(net, "pub", nodes["pub"])["addrs"])
    for i, asker in enumerate(("home1", "home3", "home1", "home3")):
        result = generate(net, asker, nodes[asker], SHARED + f" question {i}")
        assert result.served_by == holder.peer_id, f"{asker}'s request was not served by home2"
        assert result.cached_tokens >= 256
    # Hole punching: home1 and home2 (cone NATs) end up with a direct flow between their
    # routers; home3 (symmetric NAT) talks to pub only, its traffic stays relayed.
    home2_uplink = net.sites["home2"].uplink
    wait_for(lambda: net.established_tcp_peers("home1"), lambda peers: home2_uplink in peers, 60,
             "a direct (hole-punched) flow from home1 to home2's router")
    assert net.established_tcp_peers("home3") <= {net.sites["pub"].addr}
    # And the other way round: home3 (symmetric NAT) holds a prefix, home2 asks.
    other = " ".join(f"other{i}" for i in range(300))
    assert generate(net, "home3", nodes["home3"], other + " warm").served_by == nodes["home3"].peer_id
    wait_for(lambda: status(net, "home2", holder), holds(nodes["home3"].peer_id), 60,
             "home2 sees home3's digest")
    assert generate(net, "home2", holder, other + " q").served_by == nodes["home3"].peer_id


def test_a_cut_relay_link_loses_no_request_and_heals(
    internet: tuple[Internet, dict[str, NodeHandle]],
) -> None:
    """home2's uplink (its only way to the relay and everyone) is cut and restored: every
    request sent meanwhile and after is answered, and every node's view of every digest is
    right again after the restore (measured on the status timeline; see HEAL_BOUND_S)."""
    net, nodes = internet
    holder, asker = nodes["home2"], nodes["home1"]
    generate(net, "home2", holder, SHARED + " warm up")
    wait_for(lambda: status(net, "home1", asker), holds(holder.peer_id), 60, "home1 sees home2's digest")
    assert generate(net, "home1", asker, SHARED + " before").served_by == holder.peer_id
    fresh = tuple(" ".join(f"fresh{k}x{i}" for i in range(300)) for k in range(2))
    with net.watch_statuses(nodes) as watch:
        watch.wait_converged(time.monotonic(), HEAL_BOUND_S)
        net.set_uplink("home2", up=False)
        try:
            # Every request is answered while home2 is cut off (by home1 itself, after failover).
            served = [generate(net, "home1", asker, SHARED + f" cut {i}").served_by for i in range(4)]
            assert holder.peer_id not in served[1:], "home2 served a request through a cut link"
            # home2 caches prefixes only it holds: every other view of home2 is now stale.
            for prefix in fresh:
                assert generate(net, "home2", holder, prefix + " warm").served_by == holder.peer_id
        finally:
            net.set_uplink("home2", up=True)
        restored = time.monotonic()
        # Requests sent while it heals are answered too (by whoever the core picks).
        served += [generate(net, "home1", asker, SHARED + f" healing {i}").served_by for i in range(2)]
        healed_s = watch.wait_converged(restored, HEAL_BOUND_S)
    print(f"relay link restored: views reconverged after {healed_s:.2f} s = "
          f"{healed_s / ANNOUNCE_S:.1f} announce intervals")
    assert set(served) <= {holder.peer_id, asker.peer_id}
    # Healed: home1 reaches home2 again (reconnected through the relay, reserved again) and
    # sends it the prefix only home2 holds.
    wait_for(lambda: status(net, "home1", asker), holds(holder.peer_id, 600), 60,
             "home1 has home2 as a candidate again")
    assert served_after_heal(net, "home1", asker, holder, fresh)[-1] == holder.peer_id


@pytest.mark.pub2
def test_a_partition_of_the_swarm_loses_no_request_and_reconverges(
    internet: tuple[Internet, dict[str, NodeHandle]],
) -> None:
    """The swarm split in two, each half with a public node (relay): {pub, home1} and
    {pub2, home2, home3}. Every request sent meanwhile is answered on its own side, also one
    for a prefix only the other side holds (failover); both sides' digests change. After the
    heal every view is right again (see HEAL_BOUND_S) and requests cross again."""
    net, nodes = internet
    side_a, side_b = ("pub", "home1"), ("pub2", "home2", "home3")
    holder, asker = nodes["home2"], nodes["home1"]
    generate(net, "home2", holder, SHARED + " warm up")
    wait_for(lambda: status(net, "home1", asker), holds(holder.peer_id), 60, "home1 sees home2's digest")
    assert generate(net, "home1", asker, SHARED + " before").served_by == holder.peer_id
    # And a prefix side A holds that side B knows of (home3 will ask for it during the split).
    pre_a = " ".join(f"prea{i}" for i in range(300))
    assert generate(net, "home1", asker, pre_a + " warm").served_by == asker.peer_id
    wait_for(lambda: status(net, "home3", nodes["home3"]), holds(asker.peer_id, 256), 60,
             "home3 sees home1's digest")
    fresh_a = tuple(" ".join(f"side{k}a{i}" for i in range(300)) for k in range(2))
    fresh_b = tuple(" ".join(f"side{k}b{i}" for i in range(300)) for k in range(2))
    with net.watch_statuses(nodes) as watch:
        watch.wait_converged(time.monotonic(), HEAL_BOUND_S)
        net.partition(side_a, side_b)
        try:
            answered: dict[str, list[str]] = {"home1": [], "home3": []}
            for i in range(3):
                answered["home1"].append(generate(net, "home1", asker, SHARED + f" split {i}").served_by)
            # Each side caches something new: every view across the split is now stale.
            for prefix_a, prefix_b in zip(fresh_a, fresh_b, strict=True):
                assert generate(net, "home1", asker, prefix_a + " warm").served_by == asker.peer_id
                assert generate(net, "home2", holder, prefix_b + " warm").served_by == holder.peer_id
            for i in range(2):
                answered["home3"].append(generate(net, "home3", nodes["home3"], pre_a + f" q{i}").served_by)
        finally:
            net.heal()
        healed = time.monotonic()
        healed_s = watch.wait_converged(healed, HEAL_BOUND_S)
    print(f"partition healed: views reconverged after {healed_s:.2f} s = "
          f"{healed_s / ANNOUNCE_S:.1f} announce intervals")
    ids_a = {nodes[s].peer_id for s in side_a}
    ids_b = {nodes[s].peer_id for s in side_b}
    assert set(answered["home1"]) <= ids_a, "a request crossed the partition"
    assert set(answered["home3"]) <= ids_b, "a request crossed the partition"
    # Healed: each side's new prefix is served where it is cached, from the other side.
    wait_for(lambda: status(net, "home1", asker), holds(holder.peer_id, 600), 60,
             "home1 has home2 as a candidate again")
    assert served_after_heal(net, "home1", asker, holder, fresh_b)[-1] == holder.peer_id
    wait_for(lambda: status(net, "home3", nodes["home3"]), holds(asker.peer_id, 600), 60,
             "home3 has home1 as a candidate again")
    assert served_after_heal(net, "home3", nodes["home3"], asker, fresh_a)[-1] == asker.peer_id


MAX_BEFORE_LIMIT = 40  # requests; 12 spent the 64 KiB in every run so far but one
AFTER_LIMIT = 3


@pytest.mark.pub_args("--relay-circuit-bytes", "64K")
def test_a_relay_closing_a_circuit_at_its_byte_limit_loses_no_request(
    internet: tuple[Internet, dict[str, NodeHandle]],
) -> None:
    """pub lets one relayed connection carry 64 KiB: requests (and digests) between home3
    (symmetric NAT: relayed for good) and home2 run into it; every request is still answered
    (failover, then a fresh circuit), none is lost."""
    net, nodes = internet
    holder, asker = nodes["home2"], nodes["home3"]
    generate(net, "home2", holder, SHARED + " warm up")
    wait_for(lambda: status(net, "home3", asker), holds(holder.peer_id), 60, "home3 sees home2's digest")
    # Every request is answered (generate raises on an error). A forward cut by the relay's
    # limit makes the core stop routing to home2 until it is heard from again, so before each
    # request wait (bounded) until home3 has it as a candidate again: then the relayed path
    # keeps being used, whatever the machine's load does to the timing. How many requests it
    # takes to spend 64 KiB depends on how much digest traffic shared the circuit, so ask
    # until the relay logs the limit (at most MAX_BEFORE_LIMIT), then a few more across the cut.
    pub_log = nodes["pub"].stderr_path

    def limit_reached() -> bool:
        return "limit exceeded" in pub_log.read_text(errors="replace")

    served: list[str] = []
    after_limit = 0
    for i in range(MAX_BEFORE_LIMIT + AFTER_LIMIT + 1):
        wait_for(lambda: status(net, "home3", asker), holds(holder.peer_id), 30,
                 "home3 has home2 as a candidate again")
        served.append(generate(net, "home3", asker, SHARED + f" q{i}").served_by)
        if limit_reached():
            after_limit += 1
            if after_limit > AFTER_LIMIT:
                break
        elif i + 1 >= MAX_BEFORE_LIMIT:
            break
    assert limit_reached(), f"the relay never reached its circuit byte limit in {len(served)} requests"
    assert after_limit > AFTER_LIMIT, "too few requests were asked after the circuit's limit"
    assert set(served) <= {holder.peer_id, asker.peer_id}
    assert holder.peer_id in served


def test_the_emulated_internet_removes_everything_also_when_the_body_fails() -> None:
    from peerinfer.testing.netns import _namespaces

    with pytest.raises(RuntimeError, match="the body failed"), emulated_internet() as net:
        node = net.spawn_node("home1")
        net.wait_ready([node])
        prefix = net.prefix
        assert len([n for n in _namespaces() if n.startswith(prefix)]) == 8  # pub, pub2, 3 routers, 3 homes
        raise RuntimeError("the body failed")
    assert not [n for n in _namespaces() if n.startswith(prefix)]
    assert not node.alive
