"""The disk tier on real in-process nodes: a node restarted with its disk cache comes up warm,
its first request on a prefix cached before the restart is a hit, and a peer sees its digest
(and the disk figure in its load) soon after it starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from peerinfer.client import Client
from peerinfer.core.costmodel import CostModel
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.node import Node
from peerinfer.testing.inprocess import node_options, open_nodes, wait_until

COSTS = CostModel(
    prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.002,
    overhead_s=0.002, slots=1,
)
SHARED = " ".join(f"shared{i}" for i in range(300))
#: The default announce interval: the target is "within one interval after it starts".
INTERVAL_S = 1.0


def _node(bootstrap: tuple[str, ...], disk: Path | None) -> Node:
    opts = node_options(
        costs=COSTS, bootstrap=bootstrap, announce_interval_s=INTERVAL_S, peer_timeout_s=4.0,
        disk_cache_bytes=(1 << 30) if disk is not None else 0, disk_cache_dir=disk,
    )
    # A memory cache of 64 blocks: the shared prompt (19 blocks) fits, its file copies are
    # written when the node stops.
    engine = SimulatedEngine(costs=COSTS, kv_bytes_per_token=256, capacity_bytes=64 * 16 * 256)
    return Node(opts, engine=engine)


@pytest.mark.slow
async def test_a_restarted_node_is_warm_and_its_peer_sees_its_digest(tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    async with open_nodes(1, lambda i, b: _node(b, disk)) as (first,):
        async with Client.connect(first.addresses()[0]) as client:
            cold = await client.generate(SHARED + " first question", max_tokens=3)
        assert cold.cached_tokens == 0
        before = set(first.core.local.digest)  # type: ignore[union-attr]
        assert len(before) >= 18
    # Stopped: its memory cache was saved to disk.
    assert first.ctx.engine is not None
    saved = first.ctx.engine.disk_statistics()
    assert saved is not None and saved.blocks >= len(before)

    def make(i: int, bootstrap: tuple[str, ...]) -> Node:
        return _node(bootstrap, disk if i == 0 else None)

    async with open_nodes(2, make) as (again, peer):
        # Warm from the start: the digest holds every block held before the restart.
        assert before <= set(again.core.local.digest)  # type: ignore[union-attr]
        started = trio.current_time()
        await wait_until(
            lambda: (r := peer.core.index.replica(again.core.peer_id)) is not None  # type: ignore[union-attr]
            and before <= set(r.digest),
            timeout=30.0,
        )
        seen_after = trio.current_time() - started
        # Measured 0.42-0.44 s (docs/performance.md); three intervals leave a loaded machine room.
        assert seen_after <= 3 * INTERVAL_S
        # The peer learns where a hit costs a disk read: the disk figure in the load.
        await wait_until(
            lambda: any(
                p.peer_id == again.peer_id and len(p.load.disk) == 2 and p.load.disk[0] > 0
                for p in peer.core.peers(trio.current_time())  # type: ignore[union-attr]
            ),
            timeout=30.0,
        )
        async with Client.connect(again.addresses()[0]) as client:
            warm = await client.generate(SHARED + " second question", max_tokens=3)
        assert warm.served_by == again.peer_id
        assert warm.cached_tokens >= 18 * 16  # the first request after the restart is a hit
    # Reported for docs/performance.md (the target: within one announce interval).
    print(f"peer saw the restarted node's digest {seen_after:.2f} s after both served "
          f"(announce interval {INTERVAL_S} s)")


def test_the_disk_flags_reach_the_options_and_the_directory_defaults_beside_the_identity(
    tmp_path: Path,
) -> None:
    from peerinfer.cli import build_parser
    from peerinfer.cli import node_options as cli_options
    from peerinfer.node.options import disk_cache_path

    base = ["node", "--engine", "simulated", "--no-mdns", "--http", "none"]

    def parse(*flags: str):  # type: ignore[no-untyped-def]
        return cli_options(build_parser("node").parse_args([*base, *flags]))

    plain = parse()
    assert plain.disk_cache_bytes == 0
    given = parse("--disk-cache-bytes", "2G", "--identity", str(tmp_path / "id" / "identity.key"))
    assert given.disk_cache_bytes == 2 << 30 and given.disk_cache_dir is None
    assert disk_cache_path(given) == tmp_path / "id" / "kvcache"
    moved = parse("--disk-cache-bytes", "1M", "--disk-cache-dir", str(tmp_path / "elsewhere"))
    assert disk_cache_path(moved) == tmp_path / "elsewhere"
