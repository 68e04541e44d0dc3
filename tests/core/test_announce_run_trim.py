"""A shared run drops the changes every follower took in (``AnnounceRun._trim``) without
changing what any follower reads: issue 25, memory held that nobody reads."""

from __future__ import annotations

import random

from peerinfer.core.announcerun import AnnounceRun
from peerinfer.core.merkle import MerkleDigest, NullObserver
from peerinfer.types import BlockHash, PeerId
from tests.core.test_run_holders import _announce


def _digest(hashes: set[int]) -> MerkleDigest:
    d = MerkleDigest(NullObserver(), lazy=True)
    for h in hashes:
        d.add(BlockHash(h))
    return d



def test_followers_read_the_same_changes_while_the_run_drops_those_all_took_in() -> None:
    """Followers reading at random times, joining and leaving: each reads exactly the changes
    pushed after its cursor (checked against every change ever pushed), and each trim keeps
    exactly the changes some follower has not read yet."""
    rng = random.Random(3)
    held = set(rng.sample(range(1, 2000), 40))
    d = _digest(held)
    run = AnnounceRun(_announce("p", 1, d), 0.0)
    run.seed(d)
    cursors: dict[PeerId, int] = {}
    every: list[tuple[int, int, int, int]] = []  # (run length once pushed, prev, epoch, size)
    pushed = trims = 0
    for step in range(3000):
        roll = rng.random()
        if roll < 0.3:
            run.push(_announce("p", run.epoch + 1, run.digest), float(step))  # type: ignore[arg-type]
        elif roll < 0.6:
            added = tuple(b for b in rng.sample(range(1, 2000), 3) if b not in held)
            removed = tuple(rng.sample(sorted(held), 2))
            held = (held | set(added)) - set(removed)
            a = _announce("p", run.epoch + 1, _digest(held), added, removed)
            after = run.advances(a)
            assert after is not None
            held_before = len(run.change_at)
            run.push_changes(a, float(step), after)
            every.append((run.length, a.prev_epoch, a.epoch, len(added) + len(removed)))
            pushed += 1
            if len(run.change_at) <= held_before:  # trimmed: to exactly what is unread
                lowest = min(cursors.values(), default=run.length)
                assert len(run.change_at) == sum(1 for s in every if s[0] > lowest), step
                trims += 1
        else:
            me = PeerId(f"n{rng.randrange(6)}")
            if me in cursors and rng.random() < 0.05:  # leaves (``PeerView.leave_run``)
                del cursors[me]
                run.cursors.pop(me, None)
            elif me not in cursors:  # joins at the run's newest (``PeerView._follow``)
                cursors[me] = run.cursors[me] = run.length
            else:  # reads (``PeerView._catch_up``)
                cursor = cursors[me]
                steps = list(run.steps_since(cursor, 0))
                assert steps == [s for s in every if s[0] > cursor], step
                assert run.changed_since(cursor) == bool(steps)
                cursors[me] = run.cursors[me] = run.length
        assert run.change_at == [s[0] for s in every[len(every) - len(run.change_at):]]
        assert len(run.change_prev) == len(run.change_epoch) == len(run.change_size) \
            == len(run.change_at)
    assert pushed > 500 and trims > 3 and len(run.change_at) < pushed / 4
