"""``RunHolders``: per block, exactly the live shared runs whose set holds it, kept through
runs seeded, changed and dropped (slots reused), and its walk: every run's depth in a chain at
once, as each run counts it (issue 25: a route reads the runs' depths off one walk)."""

from __future__ import annotations

import gc
import random

from peerinfer.core.announcerun import AnnounceRun, RunHolders
from peerinfer.core.merkle import MerkleDigest
from peerinfer.core.messages import Announce, Load
from peerinfer.types import BlockHash


def _digest(hashes: set[int]) -> MerkleDigest:
    d = MerkleDigest(lazy=True)
    for h in hashes:
        d.add(BlockHash(h))
    return d


def _announce(sender: str, epoch: int, d: MerkleDigest, added: tuple[int, ...] = (),
              removed: tuple[int, ...] = ()) -> Announce:
    return Announce(sender=sender, epoch=epoch, prev_epoch=epoch - 1, root=d.root, count=len(d),
                    load=Load(), added=added, removed=removed)


def _change(run: AnnounceRun, held: set[int], blocks: list[int], rng: random.Random,
            at: float) -> set[int]:
    added = tuple(b for b in rng.sample(blocks, 3) if b not in held)
    removed = tuple(b for b in rng.sample(sorted(held), min(2, len(held))))
    after_set = (held | set(added)) - set(removed)
    a = _announce(run.sender, run.epoch + 1, _digest(after_set), added, removed)
    after = run.advances(a)
    assert after is not None
    run.push_changes(a, at, after)
    return after_set


def _walk_by_run(holders: RunHolders, chain: list[BlockHash]) -> dict[int, int]:
    """``holders.walk``'s answer as {id(run): depth}, each run named once."""
    out: dict[int, int] = {}
    last = 0
    for depth, slots in holders.walk(chain):
        assert slots and depth > last  # depths ascending, masks not empty
        last = depth
        while slots:
            low = slots & -slots
            slots ^= low
            run = holders.run(low.bit_length() - 1)
            if run is not None:
                assert id(run) not in out
                out[id(run)] = depth
    return out


def test_holders_are_the_runs_whose_set_holds_the_block_through_changes() -> None:
    """For sampled blocks, exactly the runs whose set holds each, through 300 changes and a
    run dropped; a new run takes the freed slot without inheriting its bits (fails if a
    removal is not applied or a gone run's bits are left set)."""
    rng = random.Random(25)
    blocks = list(range(1, 41))
    holders = RunHolders()
    runs: list[AnnounceRun] = []
    sets: list[set[int]] = []
    for k in range(12):
        held = set(rng.sample(blocks, 10))
        d = _digest(held)
        run = AnnounceRun(_announce(f"p{k}", 1, d), 0.0, holders)
        assert holders.holding(BlockHash(blocks[0])) is not None  # asked before a set is seeded
        run.seed(d)
        runs.append(run)
        sets.append(held)
    for step in range(300):
        k = rng.randrange(len(runs))
        sets[k] = _change(runs[k], sets[k], blocks, rng, float(step))
        for b in rng.sample(blocks, 5):
            expected = {id(r) for r, s in zip(runs, sets, strict=True) if b in s}
            assert {id(r) for r in holders.holding(BlockHash(b))} == expected, (step, b)
    # A run nobody holds any more goes away by itself, and its bits with it.
    b = next(b for b in blocks if b in sets[0])
    slot = runs[0].holder_slot
    del runs[0], sets[0], run
    gc.collect()
    assert {id(r) for r in holders.holding(BlockHash(b))} == \
        {id(r) for r, s in zip(runs, sets, strict=True) if b in s}
    # A new run reuses the slot and holds only its own set's blocks.
    held = {b}
    d = _digest(held)
    run = AnnounceRun(_announce("new", 1, d), 0.0, holders)
    run.seed(d)
    assert run.holder_slot == slot
    runs.append(run)
    sets.append(held)
    for b in blocks:
        expected = {id(r) for r, s in zip(runs, sets, strict=True) if b in s}
        assert {id(r) for r in holders.holding(BlockHash(b))} == expected, b
    assert holders.blocks() == len(set().union(*sets))


def test_the_walk_gives_every_runs_depth_as_it_counts_it() -> None:
    """``RunHolders.walk``: for prefixes of orders of the blocks (like a prompt's hash
    chains) and through changes of the runs' sets, each run holding the first block at the
    depth ``AnnounceRun.depth`` counts (the leading blocks its set holds), every other run
    absent (fails if a block's mask misses a change, or a depth is off by one at a group's
    end)."""
    from itertools import takewhile

    rng = random.Random(7)
    blocks = list(range(1, 31))
    holders = RunHolders()
    runs: list[AnnounceRun] = []
    sets: list[set[int]] = []
    for k in range(10):
        held = set(rng.sample(blocks, rng.choice((5, 20, 28, 30))))
        d = _digest(held)
        run = AnnounceRun(_announce(f"p{k}", 1, d), 0.0, holders)
        assert run.depth([BlockHash(1)]) == 0  # no set yet
        run.seed(d)
        runs.append(run)
        sets.append(held)
    orders = [[BlockHash(b) for b in rng.sample(blocks, len(blocks))] for _ in range(4)]
    deep = 0
    for step in range(400):
        if step % 5 == 4:
            k = rng.randrange(len(runs))
            sets[k] = _change(runs[k], sets[k], blocks, rng, float(step))
        order = rng.choice(orders)
        chain = order[: rng.randrange(1, len(order) + 1)]
        want = {}
        for run, held in zip(runs, sets, strict=True):
            depth = len(list(takewhile(held.__contains__, chain)))
            assert run.depth(chain) == depth, step
            if depth:
                want[id(run)] = depth
        assert _walk_by_run(holders, chain) == want, step
        deep += any(d == len(chain) for d in want.values()) and len(chain) > 1
    assert deep > 20  # whole chains held, not only short depths
    assert holders.walk([]) == []


def test_leading_counts_what_the_set_or_the_entries_hold_as_block_by_block() -> None:
    """``replicaindex.leading`` (a route's walk over a peer not followed: its set and its
    speculative entries) counts the chain's leading blocks that either holds, as the loop
    block by block does, whatever the stretches: the set alone, the entries alone, holes in
    one filled by the other, either empty (fails if a stretch of the entries is not continued
    by the set after it, or one block too many or too few is counted at a switch)."""
    from peerinfer.core.slotmasks import leading

    rng = random.Random(31)
    chain = [BlockHash(1000 + i) for i in range(60)]
    switched = 0
    for trial in range(3000):
        k = rng.randrange(len(chain) + 1)
        head = chain[: rng.randrange(1, len(chain) + 1)]
        held = {h for h in chain[:k] if rng.random() < rng.choice((0.0, 0.5, 0.9, 1.0))}
        refs = {h: 1 for h in chain if h not in held and rng.random() < rng.choice((0.0, 0.5, 1.0))}
        want = 0
        for h in head:
            if h not in held and h not in refs:
                break
            want += 1
        assert leading(head, held.__contains__, refs) == want, trial
        switched += any(h in refs for h in head[:want]) and any(h in held for h in head[:want])
    assert switched > 300


def test_max_count_is_at_least_every_runs_count_through_changes() -> None:
    """``RunHolders.max_count`` bounds every listed run's count (a rebalance reads it instead of
    each followed run: ``PeerView.rebalance``), through runs made and changed to larger sets."""
    rng = random.Random(8)
    holders = RunHolders()
    runs: list[AnnounceRun] = []
    sets: list[set[int]] = []
    grew = 0
    for k in range(6):
        held = set(rng.sample(range(1, 500), rng.randrange(1, 20)))
        d = _digest(held)
        run = AnnounceRun(_announce(f"p{k}", 1, d), 0.0, holders)
        run.seed(d)
        runs.append(run)
        sets.append(held)
        assert holders.max_count >= max(r.count for r in runs)
    for step in range(200):
        k = rng.randrange(len(runs))
        run, held = runs[k], sets[k]
        added = tuple(b for b in rng.sample(range(1, 500), rng.randrange(0, 12)) if b not in held)
        removed = tuple(rng.sample(sorted(held), min(rng.randrange(0, 4), len(held))))
        after_set = (held | set(added)) - set(removed)
        a = _announce(run.sender, run.epoch + 1, _digest(after_set), added, removed)
        after = run.advances(a)
        assert after is not None
        before = holders.max_count
        run.push_changes(a, float(step), after)
        sets[k] = after_set
        grew += holders.max_count > before
        assert holders.max_count >= max(r.count for r in runs), step
    assert grew > 10, grew  # (not only the runs' first counts)
