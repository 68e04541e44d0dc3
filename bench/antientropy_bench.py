"""Anti-entropy benchmark: bytes and round trips of a pull, the delta path, and apply times.

Each case starts from a replica equal to a ``n``-element digest and changes the digest by
``changed`` elements, half evicted and half new (so the counts agree and only the tree can find
the changes). The replica matched no epoch the responder's change log still holds, so every pull
is a Merkle descent, not a delta (a replica that offers its epoch first and is refused spends one
more round trip of ~40 bytes). Bytes are ``len(encode(message))`` of every SyncRequest
and SyncResponse exchanged, both directions, compared with sending the whole tree (8 bytes an
element, and the msgpack encoding of the list of elements). "blind" pulls know only the counts;
"hinted" ones are told the number of changes (as a replica estimates it from the change rate it
sees in announcements times the epochs it missed).

    python bench/antientropy_bench.py            # a table
    python bench/antientropy_bench.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402

from peerinfer.core.antientropy import Replica  # noqa: E402
from peerinfer.core.digest import LocalDigest, MerkleDigest  # noqa: E402
from peerinfer.core.messages import Announce, Load, encode  # noqa: E402
from peerinfer.core.pull_in_memory import reconcile_in_memory  # noqa: E402
from peerinfer.types import BlockHash  # noqa: E402


def scenario(
    n: int, changed: int, seed: int
) -> tuple[list[BlockHash], LocalDigest]:
    rng = random.Random(seed)
    base = [BlockHash(rng.getrandbits(64)) for _ in range(n)]
    local = LocalDigest(epoch_base=1_000, max_log_changes=0)
    for h in base:
        local.block_added(h)
    local.seal_epoch()
    for h in rng.sample(base, changed // 2):
        local.block_removed(h)
    for _ in range(changed - changed // 2):
        local.block_added(BlockHash(rng.getrandbits(64)))
    local.seal_epoch()
    return base, local


def measure_pulls(n: int, changed: int, seeds: int) -> dict[str, Any]:
    tree_raw = 8 * n
    out: dict[str, Any] = {"n": n, "changed": changed, "tree_bytes": tree_raw}
    for label, hinted in (("blind", False), ("hinted", True)):
        totals, rounds, passes, seconds = [], [], [], []
        for seed in range(seeds):
            base, local = scenario(n, changed, seed)
            replica = Replica()
            replica.digest.update(base)
            # epoch 0: no delta offer first (with one the log cannot serve, add 1 round trip)
            t0 = time.perf_counter()
            stats = reconcile_in_memory(
                replica, local, estimated_difference=changed if hinted else None
            )
            seconds.append(time.perf_counter() - t0)
            assert stats.state == "converged", stats
            assert set(replica.digest) == set(local.digest)
            totals.append(stats.bytes_total)
            rounds.append(stats.rounds)
            passes.append(stats.passes)
        out[label] = {
            "bytes_mean": statistics.mean(totals),
            "bytes_max": max(totals),
            "ratio_mean": statistics.mean(totals) / tree_raw,
            "ratio_max": max(totals) / tree_raw,
            "bytes_per_change": statistics.mean(totals) / changed,
            "rounds_mean": statistics.mean(rounds),
            "rounds_max": max(rounds),
            "rounds_hist": {str(r): rounds.count(r) for r in sorted(set(rounds))},
            "extra_passes": sum(p > 1 for p in passes),
            "pull_ms_mean": 1000 * statistics.mean(seconds),
        }
    return out


def measure_delta(n: int, changed: int) -> dict[str, Any]:
    """The two delta paths for ``changed`` changes: in an announcement, and a pull by delta."""
    rng = random.Random(99)
    base = [BlockHash(rng.getrandbits(64)) for _ in range(n)]
    local = LocalDigest(epoch_base=1_000)
    for h in base:
        local.block_added(h)
    first = local.seal_epoch()
    replica = Replica()
    replica.digest.update(base)
    assert not replica.apply_announce(first.prev_epoch, first.epoch, first.root, first.count, (), (), False)
    for h in rng.sample(base, changed // 2):
        local.block_removed(h)
    for _ in range(changed - changed // 2):
        local.block_added(BlockHash(rng.getrandbits(64)))
    delta = local.seal_epoch()
    announce = Announce(
        sender="12D3KooW" + "x" * 44, epoch=delta.epoch, prev_epoch=delta.prev_epoch,
        root=delta.root, count=delta.count, load=Load(), added=delta.added,
        removed=delta.removed, time_ms=1_700_000_000_000,
    )
    empty = Announce(
        sender="12D3KooW" + "x" * 44, epoch=delta.epoch, prev_epoch=delta.prev_epoch,
        root=delta.root, count=delta.count, load=Load(), time_ms=1_700_000_000_000,
    )
    # Applying the announcement's delta to a replica that saw the previous epoch.
    applies = []
    for _ in range(20):
        trial = Replica()
        trial.digest.update(base)
        trial.epoch = first.epoch
        t0 = time.perf_counter()
        needs_pull = trial.apply_announce(
            delta.prev_epoch, delta.epoch, delta.root, delta.count, delta.added, delta.removed,
            delta.truncated,
        )
        applies.append(time.perf_counter() - t0)
        assert not needs_pull
    # A replica that missed the announcement pulls; the log still reaches its epoch.
    replica.epoch = first.epoch
    stats = reconcile_in_memory(replica, local)
    assert stats.state == "converged" and stats.rounds == 1
    return {
        "changed": changed,
        "announce_bytes": len(encode(announce)),
        "announce_overhead_bytes": len(encode(empty)),
        "apply_us_median": 1e6 * statistics.median(applies),
        "pull_delta_bytes": stats.bytes_total,
        "pull_delta_rounds": stats.rounds,
    }


def measure_digest(n: int) -> dict[str, Any]:
    rng = random.Random(7)
    elements = [BlockHash(rng.getrandbits(64)) for _ in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    digest = MerkleDigest()
    t0 = time.perf_counter()
    digest.update(elements)
    build = time.perf_counter() - t0
    memory = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    plain = set(elements)
    probes = [BlockHash(rng.getrandbits(64)) for _ in range(n)]
    t0 = time.perf_counter()
    for h in elements:
        _ = h in digest
    contains = time.perf_counter() - t0
    t0 = time.perf_counter()
    for h in probes:
        digest.add(h)
    add = time.perf_counter() - t0
    t0 = time.perf_counter()
    for h in probes:
        digest.discard(h)
    discard = time.perf_counter() - t0
    return {
        "n": n,
        "build_ms": 1000 * build,
        "add_us": 1e6 * add / n,
        "discard_us": 1e6 * discard / n,
        "contains_us": 1e6 * contains / n,
        "bytes_per_element": memory / n,
        "plain_set_bytes_per_element": (sys.getsizeof(plain) + 32 * n) / n,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--n", type=int, default=10_000, help="elements in the digest")
    parser.add_argument("--seeds", type=int, default=20, help="random cases per setting")
    args = parser.parse_args(argv)
    n = args.n
    msgpack_tree = len(msgpack.packb([2**63 + i for i in range(n)]))
    pulls = [measure_pulls(n, max(2, round(n * f)), args.seeds) for f in (0.001, 0.01, 0.1)]
    delta = measure_delta(n, max(2, n // 100))
    digest = measure_digest(n)
    result = {"msgpack_tree_bytes": msgpack_tree, "pulls": pulls, "delta": delta, "digest": digest}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Merkle pull of a {n:,}-element digest ({args.seeds} random cases each; whole tree "
          f"= {8 * n:,} B raw, {msgpack_tree:,} B msgpack)")
    print(f"{'changed':>8} {'kind':>7} {'bytes mean':>11} {'max':>7} {'% of tree':>10} "
          f"{'B/change':>9} {'rounds mean':>12} {'max':>4} {'extra passes':>13} {'ms':>6}")
    for p in pulls:
        for label in ("blind", "hinted"):
            r = p[label]
            print(f"{p['changed']:>8} {label:>7} {r['bytes_mean']:>11,.0f} {r['bytes_max']:>7,} "
                  f"{100 * r['ratio_mean']:>9.2f}% {r['bytes_per_change']:>9.1f} "
                  f"{r['rounds_mean']:>12.2f} {r['rounds_max']:>4} {r['extra_passes']:>13} "
                  f"{r['pull_ms_mean']:>6.1f}")
        hist = ", ".join(f"{k}: {v}" for k, v in p["hinted"]["rounds_hist"].items())
        print(f"{'':>8} round trips (hinted) {{{hist}}}")
    d = delta
    print(f"\nDelta path, {d['changed']} changes: announcement {d['announce_bytes']:,} B "
          f"({d['announce_overhead_bytes']} B without the delta), applied in "
          f"{d['apply_us_median']:,.0f} us; a missed epoch pulled by delta: "
          f"{d['pull_delta_bytes']:,} B in {d['pull_delta_rounds']} round trip")
    g = digest
    print(f"\nDigest of {g['n']:,}: build {g['build_ms']:.0f} ms, add {g['add_us']:.1f} us, "
          f"discard {g['discard_us']:.1f} us, contains {g['contains_us']:.1f} us, "
          f"{g['bytes_per_element']:.0f} B/element (a plain set: "
          f"{g['plain_set_bytes_per_element']:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
