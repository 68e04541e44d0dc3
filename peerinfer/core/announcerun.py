"""A shared run of one sender's announcements, as a shell hands them to a group of recipients
at one time (the simulator: all recipients at one link delay), shared by them.

``PeerView`` (``peerinfer.core.peerview``) decides for each recipient whether it follows a run;
this module is the run itself: what was pushed onto it, and the set of its sender that the
announcements pushed with changes lead to; ``RunHolders``, the shell's index of its runs' sets
by block (kept once per sender change) and list of its runs by their newest announcement's time
(``stale``: the liveness check, ``Members.check``), and ``RunReads``, the view through which routing
matches a followed peer against its run's set (``peerinfer.core.index``, "Without masks").
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate, groupby, repeat, takewhile
from operator import and_
from typing import Any, Protocol
from weakref import ref

from mypy_extensions import mypyc_attr

from peerinfer.core.antientropy import Replica
from peerinfer.core.merkle import MerkleDigest
from peerinfer.core.messages import Announce
from peerinfer.types import BlockHash, PeerId

__all__ = ["AnnounceRun", "RunHolders", "RunReads"]


#: how many changes a run holds before it first drops those every follower took in
_TRIM_FIRST = 64


@mypyc_attr(native_class=False)  # held by weak references, which mypyc's classes lack
class AnnounceRun:
    """One sender's announcements, shared by the recipients of a group.

    A run starts with one announcement (``length`` 1); ``push`` appends one that ``extends``
    it: no change, chaining from the run's newest epoch, announcing the same root and count.
    Each recipient still decides for itself: one that kept the run's newest announcement for
    later (``PeerView._defer_unchanged``) *follows* the run (it joins ``followers``), and the
    shell then stops handing it the run's announcements. It takes in those pushed since it
    last looked (their number, the newest ``epoch``, ``load`` and arrival time ``at``) when it
    next reads the sender's state, exactly as if it had been handed each; it leaves the run
    as soon as taking the next one in at once could do more than that (a pull, a rebalance,
    a replica emptied or replaced, the sender forgotten). Every recipient outside
    ``followers`` is handed every announcement, with the run, as usual.

    *Announcements with changes* (``advances``, ``push_changes``): once a follower joined, the
    run holds its own copy of the sender's set (``digest``, sharing the follower's replica's
    set: ``MerkleDigest.twin``). An announcement that chains from the run's newest epoch with a
    delta is applied to that copy once; when the result has the announced root and count, a
    follower in step would take it in exactly so (the same set, the same delta: its replica
    then matches, nothing is refused, no pull starts), unless the count exceeds its replica's
    allowance: each follower registers that limit (``followers[peer]``), and the shell hands
    the announcement, before pushing it, to the followers whose limit it exceeds (they refuse
    it and leave the run). The others take the run's changes in, in order, when they next read
    the sender's state (``change_at``: the run's length once each changed announcement was
    pushed, with what taking it in reads of it: ``change_prev``, ``change_epoch``,
    ``change_size``; the announcements themselves are not kept, nor their deltas, which the
    run's set already holds). Routing reads every replica's set, so a node takes those in
    before it routes (``PeerView.for_routing``).

    Why: with N nodes, each announcement otherwise costs N - 1 calls; a shared run costs one
    ``push`` plus the recipients that do not follow, and one delta application per change.
    """

    __slots__ = ("sender", "root", "count", "epoch", "load", "at", "length", "followers",
                 "digest", "cursors", "trim_at", "change_at", "change_prev", "change_epoch",
                 "change_size", "holders", "clock_key", "holder_slot", "__weakref__")

    def __init__(self, announce: Announce, at: float, holders: RunHolders | None = None) -> None:
        self.sender = announce.sender
        self.root = announce.root
        self.count = announce.count
        self.epoch = announce.epoch
        self.load = announce.load
        self.at = at
        self.length = 1
        #: each follower, with the most elements its replica may take (its allowance)
        self.followers: dict[PeerId, int] = {}
        #: the sender's set at ``epoch`` (once a follower joined: ``seed``)
        self.digest: MerkleDigest | None = None
        #: each follower's ``cursor`` (``PeerView``: the run's length when it last took the
        #: run's announcements in; it only grows), as low as the follower's own or lower: the
        #: changes pushed at or before the lowest are read by nobody again (``_trim``)
        self.cursors: dict[PeerId, int] = {}
        #: the length of ``change_at`` at which ``push_changes`` next trims (``_trim``)
        self.trim_at = _TRIM_FIRST
        #: per changed announcement, the run's length once it was pushed
        self.change_at: list[int] = []
        #: per changed announcement, what taking it in reads for the change rate: its
        #: previous epoch, epoch and elements changed (``steps_since``; read once here, not per
        #: follower)
        self.change_prev: list[int] = []
        self.change_epoch: list[int] = []
        self.change_size: list[int] = []
        #: the shell's index of the runs whose set holds a block (``RunHolders``), or None
        self.holders = holders
        #: this run's key in ``holders``' list by time (a weak reference, made there)
        self.clock_key: ref[AnnounceRun] | None = None
        #: this run's slot (bit) in ``holders``' masks once seeded there, else -1
        self.holder_slot = -1
        if holders is not None:
            holders.moved(self)

    def extends(self, a: Announce) -> bool:
        """Whether ``a`` may be pushed: it changes nothing since the run's newest one."""
        return (
            a.prev_epoch == self.epoch < a.epoch
            and a.root == self.root
            and a.count == self.count
            and a.sender == self.sender
            and not (a.added or a.removed or a.truncated)
            # (a recipient notes another speed or slot count when it is handed one)
            and a.load.slots == self.load.slots
            and a.load.speed == self.load.speed
        )

    def push(self, a: Announce, at: float) -> None:
        """Append ``a`` (which ``extends`` the run), delivered to the group at ``at``."""
        self.epoch = a.epoch
        self.load = a.load
        self.at = at
        self.length += 1
        if self.holders is not None:
            self.holders.moved(self)

    def seed(self, digest: MerkleDigest) -> None:
        """A follower joins whose replica holds the sender's set at the run's newest epoch as
        the flat ``digest``: the run's own copy, if it has none yet."""
        if self.digest is None:
            self.digest = digest.twin()
            if self.holders is not None:
                self.holders.seeded(self)

    def advances(self, a: Announce, share: bool = True) -> MerkleDigest | None:
        """The sender's set after ``a``, if ``a`` may be pushed with its changes: it chains from
        the run's newest epoch with a delta (not truncated), the run holds the set, the load
        keeps its slots and speed, and the delta leads to the announced root and count.
        ``share=False``: no other set will take ``a`` in from a delta (every recipient of it
        follows this run), so the result is not left in the shared memo
        (``MerkleDigest.apply_delta``)."""
        digest = self.digest
        if (
            digest is None
            or not (a.prev_epoch == self.epoch < a.epoch)
            or a.truncated
            or a.sender != self.sender
            or a.load.slots != self.load.slots
            or a.load.speed != self.load.speed
        ):
            return None
        after = digest.twin()
        after.apply_delta(a.added, a.removed, share)
        if len(after) != a.count or after.root != a.root:
            return None  # followers would need a pull: each is handed it
        return after

    def over_limit(self, a: Announce) -> list[PeerId]:
        """The followers whose replica allowance ``a``'s count exceeds (they refuse it)."""
        count = a.count
        return [p for p, limit in self.followers.items() if limit < count]

    def push_changes(self, a: Announce, at: float, after: MerkleDigest) -> None:
        """Append ``a``, with changes (``advances`` gave ``after``; the followers over their
        limit left the run first)."""
        self.digest = after
        if self.holders is not None:
            self.holders.changed(self, a.added, a.removed)
        self.root = a.root
        self.count = a.count
        self.epoch = a.epoch
        self.load = a.load
        self.at = at
        self.length += 1
        self.change_at.append(self.length)
        self.change_prev.append(a.prev_epoch)
        self.change_epoch.append(a.epoch)
        self.change_size.append(len(a.added) + len(a.removed))
        if len(self.change_at) >= self.trim_at:
            self._trim()
        if self.holders is not None:
            self.holders.moved(self)

    def _trim(self) -> None:
        """Drop the changes that every follower took in already: pushed when the run's length
        was at most the lowest follower's cursor (a follower reads only those pushed after its
        cursor, ``steps_since``; one that joins later starts at the run's length). The lists
        would otherwise grow by one entry per change for as long as the run lives. Amortized:
        the next trim waits until the list is twice what was kept."""
        change_at = self.change_at
        lowest = min(self.cursors.values(), default=self.length)
        dead = bisect_right(change_at, lowest)
        if dead:
            del change_at[:dead]
            del self.change_prev[:dead]
            del self.change_epoch[:dead]
            del self.change_size[:dead]
        self.trim_at = max(2 * len(change_at), _TRIM_FIRST)

    def depth(self, chain: Sequence[BlockHash]) -> int:
        """How many of ``chain``'s leading blocks the run's set holds (0 without a set): the
        reference form of what ``RunHolders.walk`` answers for every run at once."""
        digest = self.digest
        if digest is None or not chain:
            return 0
        flat = digest._flat
        return len(list(takewhile((digest if flat is None else flat).__contains__, chain)))

    def changes_since(self, cursor: int) -> list[int]:
        """The run's length once each changed announcement pushed after the run's length was
        ``cursor`` was pushed (tests: ``steps_since`` is what followers read)."""
        change_at = self.change_at
        if not change_at or change_at[-1] <= cursor:
            return []
        return change_at[bisect_right(change_at, cursor):]

    def steps_since(self, cursor: int, base: int) -> Iterator[tuple[int, int, int, int]]:
        """The changed announcements pushed after the run's length was ``cursor``, as
        ``take_run`` reads them: ``(position, prev_epoch, epoch, changed)``, the position
        counted from ``base`` (a follower's: ``base`` + the run's length once it was pushed).
        Made from the run's per-change figures, in C (every follower takes them in)."""
        change_at = self.change_at
        if not change_at or change_at[-1] <= cursor:
            return iter(())
        i = bisect_right(change_at, cursor)
        at = change_at[i:] if base == 0 else map(base.__add__, change_at[i:])
        return zip(at, self.change_prev[i:], self.change_epoch[i:], self.change_size[i:],
                   strict=True)

    def changed_since(self, cursor: int) -> bool:
        """Whether a changed announcement was pushed after the run's length was ``cursor``."""
        change_at = self.change_at
        return bool(change_at) and change_at[-1] > cursor

    @staticmethod
    def take_run(
        replica: Replica,
        changes: Sequence[tuple[int, int, int, int]],
        times: int,
        epoch: int,
        root: int,
        count: int,
        final: MerkleDigest,
    ) -> None:
        """Leave ``replica`` exactly as ``Replica.apply_announce`` (with changes) and
        ``Replica.take_unchanged`` (without) would, for ``times`` announcements of a run it
        followed in step, the last at ``epoch`` with ``root`` and ``count``: those with changes
        given as ``(position, prev_epoch, epoch, changed)`` (position 1 is the first;
        ``changed``: elements added and removed). Each change was within the replica's
        allowance when it came and led the run's set to its announced root and count (the run
        checked both), and the last leads to ``final``. Only the change rate needs each one;
        the set moves to ``final`` at once (``MerkleDigest.adopt``: shared; an index's masks
        hear the difference)."""
        if replica._announced is None:
            raise ValueError("take_run: a replica that has taken no announcement in")
        rate = replica._rate
        done = 0
        # ``apply_announce``'s and ``take_unchanged``'s smoothing, step by step: the same
        # floats. A step without change, ``0.0 if rate == 0.0 else 0.7 * rate + 0.3 * 0.0``,
        # is ``rate * 0.7`` to the bit: the rate is never negative, and adding 0.0 to a
        # non-negative float returns it (and 0.0 stays 0.0).
        for position, prev_epoch, at_epoch, changed in changes:
            if rate != 0.0:
                for _ in range(position - 1 - done):
                    rate *= 0.7
            if at_epoch > prev_epoch:
                per_epoch = changed / (at_epoch - prev_epoch)
                rate = per_epoch if rate == 0.0 else 0.7 * rate + 0.3 * per_epoch
            done = position
        if rate != 0.0:
            for _ in range(times - done):
                rate *= 0.7
        replica._rate = rate
        if epoch >= replica._announced[0]:
            replica._announced = (epoch, root, count)
            replica.note_claim()
        replica.digest.adopt(final)
        replica.epoch = epoch


class RunHolders:
    """Per block, the shared runs whose set holds it, as a bitmask of the runs' slots: for
    routing without masks, which would otherwise ask every followed peer's set how many of a
    prompt's leading blocks it holds (``RunReads``). One per shell (the simulator's
    broadcast), shared by every run it makes, so a run's set is indexed once per change of its
    sender, not once per recipient. It also lists the runs by their newest announcement's
    time (``moved``, ``stale``), for the liveness check to visit only the followed members
    whose run went quiet.

    Every block of every seeded run's set is indexed: a run gets a slot (``holder_slot``) when
    seeded, and each of its set's changes (``seed``, ``push_changes``, which report here) sets
    or clears its bit in the changed blocks' masks, so for every block the mask's live slots
    are exactly the live runs whose ``digest`` holds it. A route's walk (``walk``) then counts
    every run's depth at once, one mask AND per block of the chain, like ``PeerIndex``'s
    combined masks, instead of asking each run holding the first block (a route asked 16 runs
    on average at 64 nodes, a few microseconds each). The upkeep is one mask operation per
    changed block per sender change (about 10 per request at 64 nodes).

    Runs are held weakly: one that nobody follows and the shell replaced goes away by itself;
    its slot's bits are cleared, and only then is the slot handed out again (lowest first)."""

    __slots__ = ("_masks", "_slots", "senders", "_free", "_gone", "_recent", "_late", "_latest",
                 "_dead", "max_count")

    def __init__(self) -> None:
        #: per block, the slots of the seeded runs whose set holds it (no empty masks)
        self._masks: dict[BlockHash, int] = {}
        #: per slot, its run (weakly), None for a free slot
        self._slots: list[ref[AnnounceRun] | None] = []
        #: per slot, the sender of the run seeded into it last (a route reads a run's sender
        #: here, then the run it follows for that sender: the slot's run when it holds the slot)
        self.senders: list[str] = []
        self._free: list[int] = []  # a heap: the lowest free slot is reused first
        #: slots of runs gone whose bits are still set (cleared by ``_clear_gone``)
        self._gone: list[int] = []
        #: the runs by their newest announcement's time ``at``, oldest first (each moved to the
        #: end when pushed onto: the shell pushes at its clock's time, which never goes back),
        #: for ``stale``; ``_late``: runs pushed onto at an earlier time than the newest
        #: (another shell's order), asked one by one. Held weakly, like ``_slots``; the keys of
        #: runs gone wait in ``_dead`` (a weak reference's callback may come mid-iteration).
        self._recent: dict[ref[AnnounceRun], None] = {}
        self._late: set[ref[AnnounceRun]] = set()
        self._latest = -math.inf
        self._dead: list[ref[AnnounceRun]] = []
        #: the largest ``count`` a run listed here ever had (it only grows): at least every
        #: run's count now, for a rebalance's bound on what its followers wait to take in
        #: (``PeerView.rebalance``) without reading each followed run
        self.max_count = 0

    def _purge(self) -> None:
        dead, self._dead = self._dead, []
        for key in dead:
            self._recent.pop(key, None)
            self._late.discard(key)

    def moved(self, run: AnnounceRun) -> None:
        """``run`` was made or pushed onto (its ``at`` is its newest announcement's time), or a
        node follows it (``PeerView``): listed for ``stale``."""
        if self._dead:
            self._purge()
        if run.count > self.max_count:  # (a run's count changes only where it is moved)
            self.max_count = run.count
        key = run.clock_key
        if key is None:
            key = run.clock_key = ref(run, self._dead.append)
        recent = self._recent
        if run.at >= self._latest:
            self._latest = run.at
            recent.pop(key, None)
            recent[key] = None
            self._late.discard(key)
        elif key not in recent:
            self._late.add(key)

    def stale(self, before: float) -> list[AnnounceRun]:
        """The runs with followers whose newest announcement came at ``before`` or earlier:
        a run not listed has its newest after ``before``, or no followers. Runs without
        followers at ``before`` or earlier are dropped (a node that follows one later lists it
        again, ``moved``). Time proportional to the runs that old (the senders silent that
        long, and those replaced), not to every run."""
        if self._dead:
            self._purge()
        out: list[AnnounceRun] = []
        recent = self._recent
        drop: list[ref[AnnounceRun]] = []
        for key in recent:
            run = key()
            if run is None:
                drop.append(key)
                continue
            if run.at > before:
                break
            if run.followers:
                out.append(run)
            else:
                drop.append(key)
        for key in drop:
            del recent[key]
        late = self._late
        if late:
            for key in list(late):
                run = key()
                if run is None or not run.followers:
                    late.discard(key)
                elif run.at <= before:
                    out.append(run)
        return out

    def seeded(self, run: AnnounceRun) -> None:
        """``run`` got its set (``AnnounceRun.seed``): it takes a slot, set in its blocks."""
        digest = run.digest
        assert digest is not None and run.holder_slot < 0
        if self._gone:
            self._clear_gone()
        slots = self._slots
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = len(slots)
            slots.append(None)
            self.senders.append("")
        self.senders[slot] = run.sender
        gone = self._gone
        slots[slot] = ref(run, lambda _: gone.append(slot))
        run.holder_slot = slot
        bit = 1 << slot
        masks = self._masks
        get = masks.get
        flat = digest._flat
        for h in digest if flat is None else flat:
            masks[h] = get(h, 0) | bit  # type: ignore[index, call-overload]

    def changed(self, run: AnnounceRun, added: Sequence[int], removed: Sequence[int]) -> None:
        """``run``'s set moved by a delta of ``added`` and ``removed`` (``push_changes``)."""
        digest = run.digest
        assert digest is not None and run.holder_slot >= 0
        if self._gone:
            self._clear_gone()
        bit = 1 << run.holder_slot
        masks = self._masks
        get = masks.get
        flat = digest._flat
        held = (digest if flat is None else flat).__contains__
        for changed in (added, removed):
            for h in changed:
                m = get(h, 0)  # type: ignore[call-overload]
                if held(h):
                    if not m & bit:
                        masks[h] = m | bit  # type: ignore[index]
                elif m & bit:
                    m ^= bit
                    if m:
                        masks[h] = m  # type: ignore[index]
                    else:
                        del masks[h]  # type: ignore[arg-type]

    def _clear_gone(self) -> None:
        """Clear the bits of the runs gone (rare: a run lives as long as its sender's group
        is followed), then free their slots."""
        pending = self._gone  # (a run may go meanwhile: its slot waits for the next call)
        n = len(pending)
        gone = pending[:n]
        del pending[:n]
        dead = 0
        for slot in gone:
            dead |= 1 << slot
        keep = ~dead
        masks = self._masks
        for h, m in list(masks.items()):
            if m & dead:
                m &= keep
                if m:
                    masks[h] = m
                else:
                    del masks[h]
        for slot in gone:
            self._slots[slot] = None
            heapq.heappush(self._free, slot)

    def walk(self, chain: Sequence[BlockHash]) -> list[tuple[int, int]]:
        """``(depth, slots)`` pairs: the runs in the bitmask ``slots`` hold exactly ``depth``
        of ``chain``'s leading blocks (at least one; depths ascending, masks disjoint); a slot
        whose run is gone may be among them (``run``: None). The running AND of the blocks'
        masks, in C (``accumulate``), cut where it empties, and grouped by value: a route pays
        per block a dict lookup and an AND, and per distinct depth a step in Python."""
        if self._gone:
            self._clear_gone()
        out: list[tuple[int, int]] = []
        if not chain:
            return out
        depth = 0
        prev = 0
        for mask, blocks in groupby(
            takewhile(bool, accumulate(map(self._masks.get, chain, repeat(0)), and_))
        ):
            if prev:
                out.append((depth, prev ^ mask))
            depth += len(list(blocks))
            prev = mask
        if prev:
            out.append((depth, prev))
        return out

    def run(self, slot: int) -> AnnounceRun | None:
        """The run in ``slot``, None when it is gone or the slot is free."""
        r = self._slots[slot]
        return None if r is None else r()

    def holding(self, h: BlockHash) -> list[AnnounceRun]:
        """The live runs whose set holds ``h`` (tests; routing walks: ``walk``)."""
        if self._gone:
            self._clear_gone()
        m = self._masks.get(h, 0)
        out = []
        while m:
            low = m & -m
            m ^= low
            run = self.run(low.bit_length() - 1)
            if run is not None:
                out.append(run)
        return out

    def blocks(self) -> int:
        """How many blocks are indexed (memory: every block of a live run's set)."""
        return len(self._masks)


class _Followed(Protocol):
    """What ``RunReads`` reads of a followed peer's record (``peerinfer.core.peerview``'s
    ``_Kept``)."""

    @property
    def run(self) -> AnnounceRun | None: ...

    @property
    def cursor(self) -> int: ...

    @property
    def final(self) -> MerkleDigest | None: ...


class RunReads(Mapping[PeerId, MerkleDigest]):
    """Without masks, the newer sets routing matches for some peers instead of their replicas'
    (``newer`` of ``PeerIndex.candidates``), as a view read per peer: a followed run's set when
    it changed since the node last looked, else the set a kept record's changes lead to.

    It also tells the index how to match without asking every peer (``holders``: every run
    the node follows is indexed there): a peer whose run the node follows is matched against
    the run's set, the very set it reads either way (its replica's, taken in from the run, when
    nothing changed since). So the index reads those peers' depths off the runs' walk
    (``RunHolders.walk``), and asks every other peer alone (``ReplicaIndex._walk_runs``)."""

    __slots__ = ("following", "changed", "unapplied", "holders", "following_changes")

    def __init__(
        self,
        following: Mapping[PeerId, _Followed],
        changed: set[PeerId],
        unapplied: Mapping[PeerId, _Followed],
        holders: RunHolders | None,
        following_changes: int | None = None,
    ) -> None:
        self.following, self.changed, self.unapplied = following, changed, unapplied
        self.holders = holders
        #: a count that grows whenever a peer joins or leaves ``following`` (the index then
        #: keeps which of its peers are not followed between routes), or None: not counted
        self.following_changes = following_changes

    def get(self, peer: PeerId, default: Any = None) -> Any:
        kept = self.following.get(peer)
        if kept is not None:
            run = kept.run
            if (run is not None and run.change_at and run.change_at[-1] > kept.cursor
                    and run.digest is not None):
                return run.digest
        if peer in self.changed:
            final = self.unapplied[peer].final
            if final is not None:
                return final
        return default

    def __getitem__(self, peer: PeerId) -> MerkleDigest:
        digest = self.get(peer)
        if digest is None:
            raise KeyError(peer)
        return digest  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[PeerId]:
        return (p for p in {**self.following, **dict.fromkeys(self.changed)}
                if self.get(p) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return bool(self.following or self.changed)
