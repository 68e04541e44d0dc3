"""The disk tier in the core: the disk figure a node's load announces (``Load.disk``) crosses
the wire compatibly, and the ``cost`` policy prices a hit on disk above a hit in memory."""

from __future__ import annotations

import random

from peerinfer.core.messages import Announce, Load, decode, encode
from peerinfer.core.routing import Candidate, CostPolicy, RouteRequest
from peerinfer.types import PeerId

REQ = RouteRequest(prompt_tokens=2048, max_tokens=16)


def _announce(load: Load) -> Announce:
    return Announce("peer", 2, 1, 7, 3, load)


def test_the_disk_figure_round_trips_and_is_left_off_without_a_disk_tier() -> None:
    load = Load(1, 2, 4, (1, 2, 3, 4), disk=(750, 120_000))
    back = decode(encode(_announce(load)))
    assert isinstance(back, Announce) and back.load.disk == (750, 120_000)
    assert back.load.scaffolds == ()
    # Without a disk tier the frame is byte for byte what an older node sends.
    plain = Load(1, 2, 4, (1, 2, 3, 4))
    assert encode(_announce(plain)) == encode(_announce(Load(1, 2, 4, (1, 2, 3, 4), disk=())))
    assert decode(encode(_announce(plain))).load.disk == ()  # type: ignore[attr-defined]
    with_hints = Load(1, 2, 4, (1, 2, 3, 4), scaffolds=(9,), disk=(1, 2))
    back = decode(encode(_announce(with_hints)))
    assert back.load.scaffolds == (9,) and back.load.disk == (1, 2)  # type: ignore[attr-defined]


def test_disk_seconds_per_token() -> None:
    assert Load().disk_s_per_token == 0.0
    assert Load(disk=(500, 2_000)).disk_s_per_token == 0.5 * 2_000e-9
    assert Load(disk=(5_000, 2_000)).disk_s_per_token == 2_000e-9  # a share above 1 is 1


def _holder(name: str, disk: tuple[int, ...], matched: int = 2000) -> Candidate:
    return Candidate(PeerId(name), False, matched, Load(0, 0, 1, disk=disk), 0.01, 0.0)


def test_cost_prices_a_disk_hit_between_a_memory_hit_and_a_recompute() -> None:
    policy = CostPolicy()
    local = Candidate(PeerId("me"), True, 0, Load(0, 0, 1), 0.0, 0.0)
    ram = _holder("ram", ())
    disk = _holder("disk", (1000, 50_000))  # everything on disk, 50 us a token
    cold = _holder("cold", (), matched=0)
    t_ram = policy.estimate(REQ, ram)[0]
    t_disk = policy.estimate(REQ, disk)[0]
    t_cold = policy.estimate(REQ, cold)[0]
    assert t_ram < t_disk < t_cold
    assert abs((t_disk - t_ram) - 2000 * 50e-6) < 1e-9
    d = policy.choose(REQ, [local, disk, ram], random.Random(0))
    assert d.target == "ram"
    # The hot loop (choose) and the reference form (estimate) agree.
    ttfts = policy._ttfts(REQ, [local, disk, ram], {})
    assert abs(ttfts[1] - t_disk) < 1e-12 and abs(ttfts[2] - t_ram) < 1e-12
    # A disk read slower than the recompute it saves loses to serving here.
    slow = _holder("slow", (1000, 10**9))
    assert policy.choose(REQ, [local, slow], random.Random(0)).target == "me"
