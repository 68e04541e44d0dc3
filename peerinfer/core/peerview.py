"""The peer view: the peer index as a node reads it, with the announcements it has received but
not yet taken in (lazy announcements, and the runs a simulator shares between recipients).

Most announcements change nothing but a peer's epoch, load and freshness. With
``lazy_announcements`` a node keeps the newest such one per peer (``_Kept``) and takes them in
only when something next reads that peer's state; a simulator may also share one sender's run
of them between recipients (``AnnounceRun``, which goes on through announcements with changes
that keep its followers in step: ``peerinfer.core.announcerun``), and a recipient that kept the run's newest one
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
from typing import Any, ClassVar

from peerinfer.core.announcerun import AnnounceRun, RunHolders, RunReads
from peerinfer.core.antientropy import Replica
from peerinfer.core.index import PeerIndex
from peerinfer.core.merkle import MerkleDigest
from peerinfer.core.messages import Announce, Load
from peerinfer.types import PeerId

__all__ = ["AnnounceRun", "PeerView"]


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
    #: the followed run's announcements with changes among the ``times`` not taken in, each
    #: as ``AnnounceRun.take_run`` reads it: its position among them (1 = the first not taken
    #: in), its previous epoch and epoch, and how many elements it changed
    changes: list[tuple[int, int, int, int]] | None = None
    #: the set the last of ``changes`` leads to (the run's, when it was pushed)
    final: MerkleDigest | None = None




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
                 "_pull_idle", "_changed", "_run_holders", "_following_changes")

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
        #: grows whenever a peer joins or leaves ``_following`` (``RunReads.following_changes``)
        self._following_changes = 0
        #: the peers whose kept record holds a followed run's announcements with changes
        self._changed: set[PeerId] = set()
        self._heard_through_run = heard_through_run
        self._pull_idle = pull_idle
        #: the index of runs (``RunHolders``) every run this node followed reported to; None
        #: before the first; False once two differed or one had none (routing then asks
        #: every peer's set: ``RunReads``)
        self._run_holders: RunHolders | None | bool = None

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
    def following(self) -> Mapping[PeerId, _Kept]:
        """The kept records of the runs this node follows, per peer (read-only: the liveness
        loop reads when each was last heard from them, ``Members.check``; tests)."""
        return self._following

    @property
    def run_clock(self) -> RunHolders | None:
        """Where every run this node follows is listed by its newest announcement's time
        (``RunHolders.stale``), if one place lists them all (the liveness check then visits
        only the members that can be due, ``Members.check``); else None."""
        holders = self._run_holders
        return holders if isinstance(holders, RunHolders) else None

    @property
    def follows_runs(self) -> bool:
        """Whether this node follows any shared run."""
        return bool(self._following)

    def _take_all_unapplied(self) -> None:
        """Take in every kept announcement (``take`` for every peer, in one call)."""
        if self._unapplied:
            pending, self._unapplied = self._unapplied, {}
            for kept in pending.values():
                if kept.changes:
                    self._take_changes(kept)
                else:
                    kept.replica.take_unchanged(kept.times, kept.epoch, kept.root, kept.count)
                kept.replica_epoch = kept.epoch
                kept.times = 0
            self._changed.clear()
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
        for peer in self._changed:
            waiting = self._unapplied.get(peer)
            assert waiting is not None and waiting.changes, f"{peer}: no changes kept"
        for peer, kept in self._unapplied.items():
            assert not kept.changes or peer in self._changed, f"{peer}: changes kept unseen"

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
                self._follow(peer, kept, run)
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
        self._kept[peer] = kept
        self._follow(peer, kept, run)

    def _follow(self, peer: PeerId, kept: _Kept, run: AnnounceRun) -> None:
        """Follow ``run`` from its newest announcement (the replica is in step with it)."""
        kept.run, kept.cursor = run, run.length
        run.cursors[self._me] = run.length
        run.seed(kept.replica.digest)
        replica = kept.replica
        allowance = self._index.allowance(peer)
        run.followers[self._me] = replica.max_elements if replica.max_elements < allowance else allowance
        self._following[peer] = kept
        self._following_changes += 1
        if run.holders is not None:
            run.holders.moved(run)  # (listed again if dropped as stale without followers)
        holders = self._run_holders
        if holders is not run.holders and holders is not False:
            self._run_holders = run.holders if holders is None and run.holders is not None else False

    # ------------------------------------------------------------------ reading without taking in

    def for_routing(
        self,
    ) -> tuple[
        PeerIndex,
        Mapping[PeerId, tuple[Load, float]] | None,
        Mapping[PeerId, MerkleDigest] | None,
    ]:
        """The index for a routing decision, the newer loads and freshness of the peers
        with announcements received but not taken in (kept ones, and followed runs'
        announcements since this node last looked: ``heard`` of ``PeerIndex.candidates``),
        and without masks the sets their changes lead to (``newer``): what routing reads of
        them, without taking the rest in. Of what waits for the peers with speculative
        entries, the drops of entries its confirmation makes are made first (the walk would
        see them: ``_confirm_waiting``); with masks, the peers with changes waiting are taken
        in first (the masks must hold them)."""
        index = self._index
        following = self._following
        if index.masks and (following or self._changed):
            self._take_changed()
        unapplied = self._unapplied
        if (following or unapplied) and index.speculative_blocks() > 0:
            # Few peers hold speculative entries (those routed to lately): of what waits for
            # them, routing needs only the drops of their entries that taking it in would
            # confirm (the rest it reads as it reads every peer: ``heard``, ``newer``).
            for peer in index.speculative_peers():
                self._confirm_waiting(peer)
        if not (following or unapplied):
            return index, None, None
        newer: Mapping[PeerId, MerkleDigest] | None = None
        holders = self._run_holders
        if not index.masks and isinstance(holders, RunHolders):
            # Every followed run indexed in one place: read per peer, matched run by run.
            newer = RunReads(following, self._changed, unapplied, holders, self._following_changes)
        elif not index.masks:
            # (attributes read inline: every followed peer, every route)
            newer = {
                p: k.run.digest for p, k in following.items()
                if k.run is not None and k.run.change_at and k.run.change_at[-1] > k.cursor
                and k.run.digest is not None
            }
            if self._changed:
                for p in self._changed:
                    if p not in newer:
                        final = unapplied[p].final
                        if final is not None:
                            newer[p] = final
        return index, _Heard(following, unapplied), newer

    #: tests: ``_confirm_waiting`` takes the peer in instead (the reference it stands for)
    confirm_by_taking: ClassVar[bool] = False

    def _confirm_waiting(self, peer: PeerId) -> None:
        """Drop ``peer``'s speculative entries that taking in its waiting announcements would
        confirm (``take``: ``announced(peer, load, at, fresh=True)`` at the newest one's time
        ``at``, after ``_catch_up``), and take nothing in. Taking in later confirms at that
        time or a later one: a superset of these drops, each done once (an entry is dropped
        at most once), so the speculative entries are at every read what taking in now would
        have left them; the rest of what waits (the set, the load, the freshness) routing
        reads without taking it in, as for the peers without entries."""
        if PeerView.confirm_by_taking:
            if peer in self._following or peer in self._unapplied:
                self.take(peer)
            return
        kept = self._following.get(peer)
        if kept is not None and kept.run is not None and kept.run.length != kept.cursor:
            at = kept.run.at  # (what ``_catch_up`` would set ``kept.at`` to)
        else:
            kept = self._unapplied.get(peer)
            if kept is None:
                return  # nothing waits
            at = kept.at
        self._index.confirm(peer, at)

    def rebalance(self) -> list[PeerId]:
        """``self.index.rebalance()`` without taking in first what waits (kept announcements,
        followed runs): the index sizes the allowances as if it had been (``pending``), and
        takes it in only before it empties a replica. Like routing, a rebalance (every few
        seconds, over every peer) then leaves the runs to be read when something needs more.
        Returns the peers whose replicas it emptied. Followed runs' announcements with changes
        are read as the sizes the replicas will have (with masks, taken in first)."""
        index = self._index
        following = self._following
        if index.masks and (following or self._changed):
            self._take_changed()
        unapplied = self._unapplied
        # The newest counts of what waits bound every size and claim the sizing reads of it
        # (a kept record's count, a followed run's): with them small, nothing is sized
        # (``ReplicaBudget.wants_minimal``).
        bound = max([k.count for k in unapplied.values()], default=0)
        clock = self.run_clock
        if clock is not None:  # (one place lists every run followed, and bounds their counts)
            bound = max(bound, clock.max_count)
        else:
            for k in following.values():
                run = k.run
                if run is not None and run.count > bound:
                    bound = run.count
        minimal = index.wants_minimal(bound)
        pending = None if minimal and not index.check_rebalances else {
            p: (k.epoch, k.count, k.at, k.count if k.changes else -1)
            for p, k in unapplied.items()
        }
        return index.rebalance(pending=pending, followed=following,
                               before_emptying=self._take_everything, minimal=minimal)

    def _take_everything(self) -> None:
        self.index  # noqa: B018 - the property takes every announcement received in

    def expire(self, now: float) -> None:
        """Drop speculative entries past their time (``PeerIndex.expire``). Expiry only drops
        speculative entries, which only their own peer's announcements also drop: of what
        waits for the peers with entries and kept announcements, only the drops taking it in
        would make are made first (``_confirm_waiting``, as routing does; taking in would
        catch a followed run up first, so a kept peer's confirmation is at its run's newest
        time); the rest may wait, as the other peers' announcements do."""
        index = self._index
        if self._unapplied and index.speculative_blocks():
            unapplied = self._unapplied
            for peer in [p for p in index.speculative_peers() if p in unapplied]:
                self._confirm_waiting(peer)
        index.expire(now)

    # ------------------------------------------------------------------ taking in, leaving runs

    def _catch_up(self, peer: PeerId, kept: _Kept) -> None:
        """Move the announcements ``peer``'s followed run got since ``kept`` last looked into
        ``kept`` (to be taken in with the others kept), and have the node record what receiving
        each does at once (``heard_through_run``)."""
        run = kept.run
        if run is None or run.length == kept.cursor:
            return
        if run.changed_since(kept.cursor):
            steps = kept.changes
            if steps is None:
                steps = kept.changes = []
            steps.extend(run.steps_since(kept.cursor, kept.times - kept.cursor))
            kept.root, kept.count, kept.final = run.root, run.count, run.digest
            self._changed.add(peer)
        kept.times += run.length - kept.cursor
        kept.cursor = run.cursors[self._me] = run.length
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
        if kept is None:
            return
        self._following_changes += 1
        if kept.run is None:
            return
        self._catch_up(peer, kept)
        kept.run.followers.pop(self._me, None)
        kept.run.cursors.pop(self._me, None)
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
        me = self._me
        pull_idle = self._pull_idle
        for peer in list(following) if touched is None else touched:
            kept = following.get(peer)
            if kept is None:
                continue
            run = kept.run
            replica = kept.replica
            # (the check's terms cheapest first, the allowance read once: after a rebalance
            # that changed the share, every followed peer comes here)
            allowance = index.allowance(peer)
            if (
                run is not None
                and run.count <= allowance
                and run.count <= replica.max_elements
                and replica.epoch == kept.replica_epoch
                and index.replica(peer) is replica
                and pull_idle(peer)
                and replica.digest.flat_summary() == kept.summary
            ):
                limit = replica.max_elements
                run.followers[me] = limit if limit < allowance else allowance
            else:
                self.leave_run(peer)

    def take_changes_of(self, peer: PeerId) -> None:
        """Take ``peer``'s waiting announcements in if some have changes (its replica's set is
        about to be read as it is)."""
        kept = self._following.get(peer)
        if (kept is not None and kept.run is not None and kept.run.changed_since(kept.cursor)) \
                or peer in self._changed:
            self.take(peer)

    #: tests: ``waiting_changes_of`` takes the peer's changes in instead and answers None
    #: (``take_changes_of``: the reference it stands for)
    take_target_changes: ClassVar[bool] = False

    def waiting_changes_of(self, peer: PeerId) -> tuple[MerkleDigest, Load] | None:
        """What ``take_changes_of(peer)`` would leave ``peer``'s replica's set and the index's
        load of it at, without taking anything in, when announcements with changes wait for
        it (else None: the replica's set and the index's load are what taking in would leave
        them; the load's freshness aside, which the routes read from ``heard``). The set is
        the followed run's newest (``_catch_up`` would move the record to it and ``take``
        adopt it) or the kept record's final one; the load, the run's newest (a catch-up sets
        the record's) or the record's. Its speculative entries need no take-in: routing
        confirmed them just before (``for_routing``), and a new entry is younger than what
        the waiting announcements confirm. With masks the peer is taken in (the masks must
        hold its set)."""
        kept = self._following.get(peer)
        run = kept.run if kept is not None else None
        ahead = run if run is not None and kept is not None and run.length != kept.cursor else None
        run_changed = ahead is not None and kept is not None and ahead.changed_since(kept.cursor)
        if not (run_changed or peer in self._changed):
            return None
        if self._index.masks or PeerView.take_target_changes:
            self.take(peer)
            return None
        final = ahead.digest if run_changed and ahead is not None else self._unapplied[peer].final
        load = ahead.load if ahead is not None else self._unapplied[peer].load
        assert final is not None
        return final, load

    def _take_changed(self) -> None:
        """Take in every peer whose followed run got announcements with changes since this node
        last looked, and every kept record holding such (their sets are what routing and the
        rebalance read)."""
        for peer, kept in self._following.items():
            run = kept.run
            if run is not None and run.changed_since(kept.cursor):
                self._catch_up(peer, kept)
        for peer in list(self._changed):
            self.take(peer)

    def _take_changes(self, kept: _Kept) -> None:
        """Take in ``kept``'s announcements, some with changes (a followed run's): what taking
        each in at once did (``AnnounceRun.take_run``: the change rates one by one, the set at
        once). Then the record's check holds for the replica's new set."""
        steps = kept.changes
        final = kept.final
        assert steps is not None and final is not None
        replica = kept.replica
        AnnounceRun.take_run(replica, steps, kept.times, kept.epoch, kept.root, kept.count, final)
        kept.changes = kept.final = None
        summary = replica.digest.flat_summary()
        assert summary is not None
        kept.summary = summary

    def take(self, peer: PeerId) -> None:
        """Take in ``peer``'s kept announcements: what taking each in at once would have done."""
        self.catch_up(peer)
        kept = self._unapplied.pop(peer, None)
        if kept is None:
            return
        if kept.changes:
            self._take_changes(kept)
            self._changed.discard(peer)
        else:
            kept.replica.take_unchanged(kept.times, kept.epoch, kept.root, kept.count)
        kept.replica_epoch = kept.epoch
        kept.times = 0
        # Loads and times only ever replace the older ones; confirming at the newest time drops
        # what confirming at each would have.
        self._index.announced(peer, kept.load, kept.at, fresh=True)

    def forget(self, peer: PeerId) -> None:
        """``peer`` left (the node removed it from the index): drop the record of its check."""
        self._kept.pop(peer, None)
