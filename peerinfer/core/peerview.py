"""The peer view: the peer index as a node reads it, with the announcements it has received but
not yet taken in (lazy announcements, and the runs a simulator shares between recipients).

Most announcements change nothing but a peer's epoch, load and freshness. With
``lazy_announcements`` a node keeps the newest such one per peer (``_Kept``) and takes them in
only when something next reads that peer's state; a simulator may also share one sender's run
of them between recipients (``AnnounceRun``), and a recipient that kept the run's newest one
*follows* the run instead of being handed each. ``PeerView`` owns all of that on top of the
``PeerIndex``, so the node's parts read one of two doors:

* ``index``: every announcement received taken in (what eager application would have left);
* ``as_is``: the index without taking anything in, for the reads that provably do not depend
  on what waits (a peer's digest, which unchanged announcements leave alone).

``for_routing`` and ``rebalance`` read what waits without taking it in. With lazy announcements
off nothing ever waits, and every door is the index itself. See "Pull" in
``peerinfer.core.node`` for the rules, and ``_defer_unchanged`` for when waiting is safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from peerinfer.core.antientropy import Replica
from peerinfer.core.index import PeerIndex
from peerinfer.core.messages import Announce, Load
from peerinfer.types import PeerId

__all__ = ["AnnounceRun", "PeerView"]


class AnnounceRun:
    """One sender's announcements that change nothing, as a shell hands them to a group of
    recipients at one time (the simulator: all recipients at one link delay), shared by them.

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

    Why: with N nodes, each announcement otherwise costs N - 1 calls, although nearly all of
    them change nothing; a shared run costs one ``push`` plus the recipients that do not follow.
    """

    __slots__ = ("sender", "root", "count", "epoch", "load", "at", "length", "followers")

    def __init__(self, announce: Announce, at: float) -> None:
        self.sender = announce.sender
        self.root = announce.root
        self.count = announce.count
        self.epoch = announce.epoch
        self.load = announce.load
        self.at = at
        self.length = 1
        self.followers: set[PeerId] = set()

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


@dataclass(slots=True)
class _Kept:
    """One peer's announcements that change nothing, kept for later (``PeerView._defer_unchanged``).

    ``times`` of them are not taken in yet (0: none), the newest at ``epoch`` with ``load``,
    heard at ``at``. The check that let them wait stays true while the peer's replica is the
    same object at the same epoch with the same flat summary (``replica_epoch``, ``summary``)
    and the announcements keep announcing ``root`` and ``count``: then the next one may wait
    without checking the digest again. While the node follows a shared ``run`` of the peer's
    announcements, ``cursor`` is the run's length when it last took the run's newest ones.
    """

    replica: Replica
    summary: tuple[int, int]
    replica_epoch: int
    root: int
    count: int
    epoch: int
    load: Load
    at: float
    times: int = 0
    run: AnnounceRun | None = None
    cursor: int = 0




class _Heard(Mapping[PeerId, tuple[Load, float]]):
    """What routing reads of the announcements a node received and has not taken in, per
    peer: the newest load and arrival time, from its followed run if that moved since the
    node last looked (newer), else from its kept announcement. A view, read per peer asked
    (routing asks only the peers it considers), not a dict built per decision."""

    __slots__ = ("_following", "_unapplied")

    def __init__(self, following: dict[PeerId, _Kept], unapplied: dict[PeerId, _Kept]) -> None:
        self._following, self._unapplied = following, unapplied

    def get(self, peer: PeerId, default: object = None) -> Any:
        kept = self._following.get(peer)
        if kept is not None:
            run = kept.run
            if run is not None and run.length != kept.cursor:
                return run.load, run.at
        kept = self._unapplied.get(peer)
        if kept is not None:
            return kept.load, kept.at
        return default

    def __getitem__(self, peer: PeerId) -> tuple[Load, float]:
        news = self.get(peer)
        if news is None:
            raise KeyError(peer)
        return news  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[PeerId]:
        return (p for p in {**self._unapplied, **self._following} if self.get(p) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return bool(self._following or self._unapplied)


class PeerView:
    """The peer index with the announcements received and not yet taken in (see the module
    docstring). ``me``: this node (a run's follower). The node's other parts own the rest of a
    peer's state; the view reaches it through two functions the node gives it:

    * ``heard_through_run(peer, run)``: a followed run's announcements since the node last
      looked are being taken in; record what receiving each does at once (the epoch remembered,
      the peer's announced epoch and root, and that it was heard at ``run.at``);
    * ``pull_idle(peer)``: ``peer`` is a member with no pull running or wanted (then its
      followed run's next announcement may still wait: ``recheck_following``).
    """

    __slots__ = ("_index", "_me", "lazy", "_kept", "_unapplied", "_following", "_heard_through_run",
                 "_pull_idle")

    def __init__(
        self,
        index: PeerIndex,
        me: PeerId,
        *,
        lazy: bool,
        heard_through_run: Callable[[PeerId, AnnounceRun], None],
        pull_idle: Callable[[PeerId], bool],
    ) -> None:
        self._index = index
        self._me = me
        self.lazy = lazy
        #: per peer, the last check that its unchanged announcements may wait, and those of
        #: them not taken in yet (only with ``lazy``)
        self._kept: dict[PeerId, _Kept] = {}
        self._unapplied: dict[PeerId, _Kept] = {}
        #: per peer, the kept record of the shared run this node follows (``AnnounceRun``)
        self._following: dict[PeerId, _Kept] = {}
        self._heard_through_run = heard_through_run
        self._pull_idle = pull_idle

    # ------------------------------------------------------------------ the two doors

    @property
    def index(self) -> PeerIndex:
        """The peer index, every announcement received taken in (``take``)."""
        if self._following:
            for peer, kept in self._following.items():
                if kept.run is not None and kept.run.length != kept.cursor:
                    self._catch_up(peer, kept)
        if self._unapplied:
            self._take_all_unapplied()
        return self._index

    @property
    def as_is(self) -> PeerIndex:
        """The peer index as it is, nothing taken in: for reads that what waits cannot change
        (a replica's digest) and for writes that keep it so (speculative entries of a peer
        just taken in)."""
        return self._index

    @property
    def unapplied(self) -> Mapping[PeerId, _Kept]:
        """The kept announcements not taken in yet, per peer (read-only; for tests)."""
        return self._unapplied

    @property
    def follows_runs(self) -> bool:
        """Whether this node follows any shared run."""
        return bool(self._following)

    def _take_all_unapplied(self) -> None:
        """Take in every kept announcement (``take`` for every peer, in one call)."""
        if self._unapplied:
            pending, self._unapplied = self._unapplied, {}
            for kept in pending.values():
                kept.replica.take_unchanged(kept.times, kept.epoch, kept.root, kept.count)
                kept.replica_epoch = kept.epoch
                kept.times = 0
            # Peers' states are disjoint: their replicas first, then their index entries.
            self._index.announced_fresh([(p, k.load, k.at) for p, k in pending.items()])

    def check_invariants(self) -> None:
        """What waits is consistent: every kept announcement not taken in counts at least one
        announcement, and every followed run is this node's to follow."""
        for peer, kept in self._unapplied.items():
            assert kept.times > 0, f"{peer}: a kept record with nothing to take in"
        for peer, kept in self._following.items():
            assert kept.run is not None and self._me in kept.run.followers, \
                f"{peer}: follows a run it is not a follower of"
            assert kept.run.sender == peer, f"{peer}: follows another sender's run"

    # ------------------------------------------------------------------ receiving

    def offer(
        self, peer: PeerId, a: Announce, run: AnnounceRun | None, now: float, pull_idle: bool
    ) -> PeerIndex | None:
        """``peer``'s announcement ``a``, received at ``now`` (the node checked it is a member,
        the epoch is new, and noted what receiving does at once; ``pull_idle``: no pull of it
        runs or is wanted): None if it waits (kept, and with ``run`` followed: nothing more to
        do now); else the index to apply it to, with everything of ``peer`` that waited taken
        in first."""
        if not self.lazy:
            return self._index
        kept = self._kept.get(peer)
        if kept is None or not (
            a.prev_epoch == kept.epoch < a.epoch
            and a.root == kept.root
            and a.count == kept.count
            and not (a.added or a.removed or a.truncated)
            and pull_idle
            and a.count <= kept.replica.max_elements  # the allowance (rebalanced or not)
            and kept.replica.epoch == kept.replica_epoch
            and kept.replica.digest.flat_summary() == kept.summary
            and self._index.replica(peer) is kept.replica
        ):
            kept = self._defer_unchanged(peer, a, pull_idle)
        if kept is not None:
            kept.epoch, kept.load, kept.at = a.epoch, a.load, now
            kept.times += 1
            self._unapplied[peer] = kept
            if run is not None and run.epoch == a.epoch and run.sender == peer:
                # Its next announcements that change nothing wait in the run.
                kept.run, kept.cursor = run, run.length
                run.followers.add(self._me)
                self._following[peer] = kept
            return None
        index = self._index
        if peer in index:
            self.take(peer)
            return index
        if not index.add_reads_others():
            # A new peer that evicts nothing and needs no rebalance: what waits of the others
            # stays waiting (a node meeting a swarm otherwise took every followed run in at
            # each newcomer's first announcement, O(peers) each).
            return index
        return self.index  # adding a peer may evict the least recently fresh one, or rebalance

    def _defer_unchanged(self, peer: PeerId, a: Announce, pull_idle: bool) -> _Kept | None:
        """A record to keep ``a`` for later, if taking it in now could do nothing but move the
        replica to its epoch and record its load and freshness: no change, it chains from the
        replica's epoch, announces the replica's own root and count within its allowance, no
        pull is running or wanted (then it starts no pull, is not refused, empties nothing).
        Taking it in later (``take``) before anything reads this peer's state gives the same
        state: every read goes through ``index``, which takes everything in first, and so does
        any other announcement of the peer.

        Why: a node hears every peer about once a second, almost always with no change, and
        reads the index when it routes or rebalances, every few seconds; the announcements
        in between then cost a few attribute updates instead of a replica and index update."""
        if a.added or a.removed or a.truncated or not pull_idle:
            return None
        pending = self._unapplied.get(peer)
        if pending is not None:
            return None  # a kept one that this one does not follow: take both in now
        index = self._index
        replica = index.replica(peer)
        if replica is None:
            return None
        digest = replica.digest
        summary = digest.flat_summary()
        epoch = replica.epoch
        if (
            summary is None
            or a.prev_epoch != epoch
            or a.epoch <= epoch
            or a.count != summary[1]
            or a.count > replica.max_elements
            or a.count > index.allowance(peer)
            or a.root != digest.root
        ):
            return None
        kept = _Kept(replica, summary, epoch, a.root, a.count, epoch, a.load, 0.0)
        self._kept[peer] = kept
        return kept

    def follow_from(
        self, peer: PeerId, a: Announce, run: AnnounceRun, now: float, pull_idle: bool
    ) -> None:
        """``peer``'s announcement ``a``, the newest of the shared ``run``, was just taken in
        (``offer`` returned the index): follow the run now if the replica is in step, so that
        the run's next announcements (which change nothing: ``AnnounceRun.extends``) are not
        handed to this node one by one.

        The record is the one ``_defer_unchanged`` would make for the run's next announcement,
        made now: each one the run gets chains from the replica's epoch and announces its root
        and count, so each would wait as long as no pull runs or is wanted, the count fits the
        allowance and the replica stays this one, at this epoch, with this set;
        ``recheck_following`` leaves the run when any of that changes, and taking the run in
        (``_catch_up``) does what receiving each would have done. Why: after every
        announcement with changes, every recipient was otherwise handed the sender's next one
        only to start following then (one call per recipient and change: nearly half the
        announcements handed out in a 64-node simulation)."""
        if not (self.lazy and pull_idle and run.epoch == a.epoch and run.sender == peer):
            return
        if peer in self._unapplied or peer in self._following:
            return
        index = self._index
        replica = index.replica(peer)
        if replica is None or replica.epoch != a.epoch:
            return
        digest = replica.digest
        summary = digest.flat_summary()
        if (
            summary is None
            or a.count != summary[1]
            or a.count > replica.max_elements
            or a.count > index.allowance(peer)
            or a.root != digest.root
        ):
            return
        kept = _Kept(replica, summary, a.epoch, a.root, a.count, a.epoch, a.load, now)
        kept.run, kept.cursor = run, run.length
        self._kept[peer] = kept
        run.followers.add(self._me)
        self._following[peer] = kept

    # ------------------------------------------------------------------ reading without taking in

    def for_routing(self) -> tuple[PeerIndex, Mapping[PeerId, tuple[Load, float]] | None]:
        """The index for a routing decision, and the newer loads and freshness of the peers
        with announcements received but not taken in (kept ones, and followed runs'
        announcements since this node last looked: ``heard`` of ``PeerIndex.candidates``):
        what routing reads of them, without taking the rest in. Peers with speculative
        entries are taken in first (their confirmation drops entries the walk would see)."""
        index = self._index
        following = self._following
        unapplied = self._unapplied
        if (following or unapplied) and index.speculative_blocks() > 0:
            # Few peers hold speculative entries (those routed to lately): ask for them.
            for peer in index.speculative_peers():
                if peer in following or peer in unapplied:
                    self.take(peer)
        if not (following or unapplied):
            return index, None
        return index, _Heard(following, unapplied)

    def rebalance(self) -> list[PeerId]:
        """``self.index.rebalance()`` without taking in first what waits (kept announcements,
        followed runs): the index sizes the allowances as if it had been (``pending``), and
        takes it in only before it empties a replica. Like routing, a rebalance (every few
        seconds, over every peer) then leaves the runs to be read when something needs more.
        Returns the peers whose replicas it emptied."""
        pending: dict[PeerId, tuple[int, int, float]] = {
            p: (k.epoch, k.count, k.at) for p, k in self._unapplied.items()
        }
        for peer, kept in self._following.items():
            run = kept.run
            if run is not None and run.length != kept.cursor:
                pending[peer] = (run.epoch, run.count, run.at)
        return self._index.rebalance(pending=pending, before_emptying=self._take_everything)

    def _take_everything(self) -> None:
        self.index  # noqa: B018 - the property takes every announcement received in

    def heard_in_runs(self) -> dict[PeerId, float]:
        """When each peer was last heard through a followed run that moved since this node last
        looked (read, not taken in: no state moves), for the peers where it did."""
        return {
            peer: kept.run.at
            for peer, kept in self._following.items()
            if kept.run is not None and kept.run.length != kept.cursor
        }

    def expire(self, now: float) -> None:
        """Drop speculative entries past their time (``PeerIndex.expire``). Expiry only drops
        speculative entries, which only their own peer's announcements also drop: the other
        peers' announcements may wait."""
        index = self._index
        if self._unapplied and index.speculative_blocks():
            unapplied = self._unapplied
            for peer in [p for p in index.speculative_peers() if p in unapplied]:
                self.take(peer)
        index.expire(now)

    # ------------------------------------------------------------------ taking in, leaving runs

    def _catch_up(self, peer: PeerId, kept: _Kept) -> None:
        """Move the announcements ``peer``'s followed run got since ``kept`` last looked into
        ``kept`` (to be taken in with the others kept), and have the node record what receiving
        each does at once (``heard_through_run``)."""
        run = kept.run
        if run is None or run.length == kept.cursor:
            return
        kept.times += run.length - kept.cursor
        kept.cursor = run.length
        kept.epoch, kept.load, kept.at = run.epoch, run.load, run.at
        self._unapplied[peer] = kept
        self._heard_through_run(peer, run)

    def catch_up(self, peer: PeerId) -> None:
        """Note what ``peer``'s followed run got since this node last looked (nothing taken in
        yet): before the node changes what it knows of ``peer``'s liveness."""
        kept = self._following.get(peer)
        if kept is not None:
            self._catch_up(peer, kept)

    def leave_run(self, peer: PeerId) -> None:
        """Stop following ``peer``'s run (what it got so far is kept, to be taken in)."""
        kept = self._following.pop(peer, None)
        if kept is None or kept.run is None:
            return
        self._catch_up(peer, kept)
        kept.run.followers.discard(self._me)
        kept.run = None

    def recheck_following(self, changes: int) -> None:
        """If an allowance or a replica object changed since the index counted ``changes``
        (``PeerIndex.allowance_changes``): leave every run whose next announcement would no
        longer wait (the check of ``offer``, for the run), of the peers whose allowance or
        replica changed (``PeerIndex.take_touched``). The other terms of the check (no pull
        running or wanted, the replica's epoch and set) change only on paths that leave the run
        themselves (``_on_announce``, a pull starting, the peer forgotten) or move the record
        along (``take``), so the peers not touched still pass it. Why not every followed peer:
        with a node following nearly every peer, each change (a peer added, a rebalance) cost
        a check of every one: two thirds of a 256-node simulation's CPU."""
        index = self._index
        if index.allowance_changes == changes:
            return
        touched = index.take_touched()
        following = self._following
        if not following:
            return
        for peer in list(following) if touched is None else touched:
            kept = following.get(peer)
            if kept is None:
                continue
            run = kept.run
            replica = kept.replica
            if not (
                run is not None
                and self._pull_idle(peer)
                and run.count <= replica.max_elements
                and run.count <= index.allowance(peer)
                and replica.epoch == kept.replica_epoch
                and replica.digest.flat_summary() == kept.summary
                and index.replica(peer) is replica
            ):
                self.leave_run(peer)

    def take(self, peer: PeerId) -> None:
        """Take in ``peer``'s kept announcements: what taking each in at once would have done."""
        self.catch_up(peer)
        kept = self._unapplied.pop(peer, None)
        if kept is None:
            return
        kept.replica.take_unchanged(kept.times, kept.epoch, kept.root, kept.count)
        kept.replica_epoch = kept.epoch
        kept.times = 0
        # Loads and times only ever replace the older ones; confirming at the newest time drops
        # what confirming at each would have.
        self._index.announced(peer, kept.load, kept.at, fresh=True)

    def forget(self, peer: PeerId) -> None:
        """``peer`` left (the node removed it from the index): drop the record of its check."""
        self._kept.pop(peer, None)
