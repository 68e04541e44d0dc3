"""The replica budget of the replica index: the per-peer record (and the speculative entry it
refers to), each peer's allowance (its replica's ``max_elements``), the rebalance that sizes
them, and the record of the peers whose allowance or replica changed (``take_touched``).

How the budget is shared (equal shares, headroom, the spare to the useful peers, newcomers,
``enforce_allowance``) is described in :mod:`peerinfer.core.index`, under "Memory bounds".
``ReplicaBudget`` is a base class of :class:`peerinfer.core.replicaindex.ReplicaIndex`, which
keeps the state it reads (its ``__init__`` sets the attributes declared below); this module only
holds the budget's part of the upkeep.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import ClassVar, Protocol

from peerinfer.core.antientropy import MAX_REPLICA_ELEMENTS, Replica
from peerinfer.core.merkle import SizeWatch
from peerinfer.core.messages import Load
from peerinfer.types import BlockHash, PeerId

_NO_LOAD = Load()

#: The smallest allowance a peer's equal share is sized at (if the budget allows): a cache
#: that grows from nothing is not refused at its first announcements.
MIN_ALLOWANCE = 4096

#: A rebalance that a newcomer needs holds back the shares of ``peers // NEWCOMER_RESERVE``
#: more peers for the next newcomers (``PeerIndex.add_peer``).
NEWCOMER_RESERVE = 8


class _Run(Protocol):
    @property
    def length(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    @property
    def count(self) -> int: ...

    @property
    def at(self) -> float: ...

    def changed_since(self, cursor: int) -> bool: ...


class FollowedRecord(Protocol):
    """What a rebalance reads of a followed peer's record (``peerinfer.core.peerview``'s
    ``_Kept``): its shared run, and how far into it the node last looked."""

    @property
    def run(self) -> _Run | None: ...

    @property
    def cursor(self) -> int: ...


def _merged(
    pending: Mapping[PeerId, tuple[int, int, float, int]] | None,
    followed: Mapping[PeerId, FollowedRecord] | None,
) -> Mapping[PeerId, tuple[int, int, float, int]] | None:
    """``pending`` with the followed peers whose run moved since their record looked, as
    ``ReplicaBudget.rebalance`` reads them (the run's entry replaces the peer's in ``pending``)."""
    if not followed:
        return pending
    merged = dict(pending) if pending else {}
    for peer, kept in followed.items():
        run = kept.run
        if run is not None and run.length != kept.cursor:
            merged[peer] = (
                run.epoch, run.count, run.at, run.count if run.changed_since(kept.cursor) else -1
            )
    return merged


class _PeerState:
    """Everything the index keeps about one peer."""

    __slots__ = (
        "peer",
        "slot",
        "bit",
        "added_seq",
        "replica",
        "indexed",
        "skipped",
        "load",
        "load_at",
        "fresh_at",
        "spec_refs",
        "spec_entries",
        "spec_live",
        "allowance",
        "_hits_of",
    )

    def __init__(self, peer: PeerId, slot: int, added_seq: int, hits_of: list[float]) -> None:
        self.peer = peer
        self.slot = slot
        self.bit = 1 << slot
        self.added_seq = added_seq
        self.replica: Replica | None = None
        self.indexed = 0  # how many of the replica's hashes carry this peer's bit
        self.skipped = False  # some hash was not indexed (cap reached) since the last rescan
        self.load = _NO_LOAD
        self.load_at = -math.inf
        self.fresh_at = -math.inf
        self.spec_refs: dict[BlockHash, int] = {}
        #: None until the first speculative entry (most peers never get one: 760 bytes each)
        self.spec_entries: deque[_SpecEntry] | None = None
        self.spec_live = 0
        self.allowance = 0
        #: the index's hits by slot (``ReplicaBudget._hits``): this peer's is at ``slot``
        self._hits_of = hits_of
        hits_of[slot] = 0.0

    @property
    def hits(self) -> float:
        """This peer's hits (halved at every rebalance): kept in the index's list by slot."""
        return self._hits_of[self.slot]

    @hits.setter
    def hits(self, hits: float) -> None:
        self._hits_of[self.slot] = hits


class _SpecEntry:
    __slots__ = ("state", "blocks", "time", "alive")

    def __init__(self, state: _PeerState, blocks: tuple[BlockHash, ...], time: float) -> None:
        self.state = state
        self.blocks = blocks
        self.time = time
        self.alive = True


class ReplicaBudget:
    """The replica budget's part of ``ReplicaIndex``: allowances, rebalance, the touched record."""

    # Set by ``ReplicaIndex.__init__``.
    replica_budget_blocks: int
    _allocated: int
    allowance_changes: int
    _touched: dict[PeerId, None]
    _touched_all: bool
    rebalances: int
    max_peers: int
    _states: dict[PeerId, _PeerState]
    _size_watch: SizeWatch
    #: each slot's peer's hits (a free slot's: anything, reset when the slot is handed out):
    #: in one list, so a rebalance halves them all in one comprehension, without visiting
    #: each peer's state (every one a cache miss)
    _hits: list[float]
    #: every peer's allowance (and replica limit) is ``MIN_ALLOWANCE``: set by a minimal
    #: rebalance, cleared wherever an allowance is set (``_give_minimal`` then reads no state)
    _all_minimal: bool

    # The index's (``ReplicaIndex``), which this budgets for; declared here as methods, not
    # under TYPE_CHECKING, for mypyc (peerinfer/native.py), which compiles no class-body ``if``.
    def add_peer(self, peer: PeerId) -> Replica:
        raise NotImplementedError

    def remove_peer(self, peer: PeerId) -> None:
        raise NotImplementedError

    def allowance(self, peer: PeerId) -> int:
        """How many elements ``peer``'s replica may hold (0 for an unknown peer)."""
        state = self._states.get(peer)
        return 0 if state is None else state.allowance

    def enforce_allowance(self, peer: PeerId) -> bool:
        """Empty ``peer``'s replica if it holds more than its allowance; True if it did.

        The emptied replica starts over (epoch 0, never fresh); its load and hits are kept.
        Call after every announcement or sync response applied to the replica.
        """
        state = self._states.get(peer)
        if state is None or state.replica is None or len(state.replica.digest) <= state.allowance:
            return False
        kept = state.load, state.load_at, state.hits, state.allowance
        self.remove_peer(peer)
        self.add_peer(peer)
        fresh = self._states[peer]
        fresh.load, fresh.load_at, fresh.hits = kept[0], kept[1], kept[2]
        self._set_allowance(fresh, min(kept[3], fresh.allowance))
        return True

    def _set_allowance(self, state: _PeerState, allowance: int) -> None:
        self._all_minimal = False
        self.allowance_changes += 1
        self._touch(state.peer)
        self._allocated += allowance - state.allowance
        state.allowance = allowance
        assert state.replica is not None
        state.replica.max_elements = allowance

    #: test hook: each rebalance that sizes the short way (below) also sizes the long way, over
    #: every peer's want with a full sort for the spare, and requires the same allowances
    #: (``tests/sim/test_sim_lazy.py``, ``tests/core/test_admission_core.py``)
    check_rebalances: ClassVar[bool] = False
    #: how many rebalances sized the short way (``short_rebalances``, for those tests: it ran),
    #: and found every want minimal (``minimal_rebalances``, ``wants_minimal``: nothing sized);
    #: counted on an object, as writing a class attribute would make CPython drop what it
    #: specialized for the class's attribute reads (``Members.counts``)
    rebalance_counts: ClassVar[SimpleNamespace] = SimpleNamespace(short_rebalances=0, minimal_rebalances=0)

    def rebalance(
        self,
        *,
        decay: bool = True,
        pending: Mapping[PeerId, tuple[int, int, float, int]] | None = None,
        followed: Mapping[PeerId, FollowedRecord] | None = None,
        before_emptying: Callable[[], None] | None = None,
        reserve: int = 0,
        minimal: bool = False,
    ) -> list[PeerId]:
        """Recompute every allowance (see :mod:`peerinfer.core.index`, "Memory bounds"); halve the hits (``decay``).
        Returns the peers whose replicas were emptied for holding more than their new
        allowance. O(peers log peers); the node runs it every few seconds.

        ``pending`` names peers with announcements received but not fed in yet, each as
        ``(epoch, count, at, size)`` of the newest (``Replica.take_unchanged`` or, for a shared
        run's changes, ``AnnounceRun.take_run``, and ``announced_fresh`` would take them in;
        ``size``: how many elements the replica then holds, -1 for as many as now): the
        allowances are computed as if they had been fed in, the index left as it is (what they
        change and the sizing reads is the peer's claimed count and size and its freshness).
        ``followed``: the records of the peers whose shared runs the node follows
        (``PeerView.following``); a peer whose run moved since the record last looked counts
        as pending with the run's newest, ``(run.epoch, run.count, run.at, run.count if it
        changed since else -1)``, instead of its entry in ``pending`` (read per peer, not
        gathered into a dict first). ``before_emptying`` is called once, before the
        first replica is emptied, for the caller to feed them in then (an emptied replica
        starts over, and must not be confirmed by them afterwards).

        ``reserve`` peers more are counted in the equal share, and their shares stay
        unallocated, for newcomers to take (``add_peer``; the periodic rebalance passes 0).

        Where the equal share is below ``MIN_ALLOWANCE`` (and the cap), every peer wants more
        than it (a want is at least that), so every peer is given the share and the spare goes
        by hits alone: then no peer's want is computed but the spare's takers', and the order
        by hits is read only as far as the spare lasts (``_size_short``). The same allowances
        as sizing every want (``_size_every``): past 256 peers at the default budget, where a
        rebalance of every peer every few seconds was a tenth of a simulation's CPU.

        ``minimal``: the caller found ``wants_minimal`` true (with ``reserve`` 0) for the
        newest counts of what waits: every want is ``MIN_ALLOWANCE``, within the share, so
        every peer is given exactly that and no replica is over it; nothing is sized (and
        ``pending`` may be left out). Under ``check_rebalances`` the sizing over every want
        runs too and must agree."""
        if reserve < 0:
            raise ValueError("reserve must be >= 0")
        self.rebalances += 1
        n = len(self._states)
        if not n:
            return []
        budget = self.replica_budget_blocks
        share = budget // (n + reserve)
        cap = self.max_replica_elements
        if minimal:
            ReplicaBudget.rebalance_counts.minimal_rebalances += 1
            spare = budget - reserve * share - n * MIN_ALLOWANCE
            if ReplicaBudget.check_rebalances:
                states = list(self._states.values())
                every = self._size_every(states, share, reserve, _merged(pending, followed))
                assert every[0] == [MIN_ALLOWANCE] * n and every[2] == spare, \
                    "minimal rebalance != every peer's"
                assert max(every[1]) <= MIN_ALLOWANCE, "minimal rebalance with a replica over"
            self._give_minimal(decay)
            self._allocated = budget - reserve * share - spare
            return []
        states = list(self._states.values())
        if share < MIN_ALLOWANCE and share < cap:
            ReplicaBudget.rebalance_counts.short_rebalances += 1
            given, sizes, spare = self._size_short(states, share, reserve, pending, followed)
            if ReplicaBudget.check_rebalances:
                every = self._size_every(states, share, reserve, _merged(pending, followed))
                assert (given, sizes, spare) == every, "short rebalance != every peer's"
        else:
            given, sizes, spare = self._size_every(states, share, reserve,
                                                   _merged(pending, followed))
        self._give(states, given, decay)
        self._allocated = budget - reserve * share - spare
        emptied = []
        for st, size in zip(states, sizes, strict=True):
            # (an emptied replica is a new one: ``size`` is still that of st.replica's)
            if size > st.allowance:
                if before_emptying is not None:
                    before_emptying()
                    before_emptying = None
                if self.enforce_allowance(st.peer):
                    emptied.append(st.peer)
        return emptied

    def _give(self, states: list[_PeerState], given: list[int], decay: bool) -> None:
        """Set each peer's allowance to ``given``'s (by position); halve the hits (``decay``)."""
        if decay:
            self._halve_hits()
        self._all_minimal = False
        changed = False
        for st, allowance in zip(states, given, strict=True):
            replica = st.replica
            assert replica is not None
            if allowance != st.allowance or allowance != replica.max_elements:
                changed = True
                self._touch(st.peer)
                st.allowance = allowance
                replica.max_elements = allowance
        if changed:
            self.allowance_changes += 1

    def _halve_hits(self) -> None:
        """Halve every peer's hits (each the same float as ``hits *= 0.5``), in place."""
        hits = self._hits
        hits[:] = [h * 0.5 for h in hits]

    def _give_minimal(self, decay: bool) -> None:
        """``_give`` with every allowance ``MIN_ALLOWANCE``: no peer's state is read when every
        allowance is that already (``_all_minimal``, as the last minimal rebalance left them),
        and no replica where its peer's allowance is (a replica's ``max_elements`` equals its
        peer's allowance: ``_give``, ``_set_allowance`` and ``add_peer`` set both, and
        ``ReplicaIndex.check_invariants`` asserts it). Why: a minimal rebalance visited every
        peer's state and replica to halve its hits and find its allowance unchanged, a cache
        miss or two per peer (34 us of 63 peers at 64 nodes, 2% of the run)."""
        if decay:
            self._halve_hits()
        if self._all_minimal:
            return
        changed = False
        for st in self._states.values():
            if st.allowance != MIN_ALLOWANCE:
                changed = True
                self._touch(st.peer)
                st.allowance = MIN_ALLOWANCE
                replica = st.replica
                assert replica is not None
                replica.max_elements = MIN_ALLOWANCE
        if changed:
            self.allowance_changes += 1
        self._all_minimal = True

    def wants_minimal(self, news_bound: int) -> bool:
        """Whether a rebalance (``reserve`` 0) would size every peer's want at ``MIN_ALLOWANCE``
        and give each exactly that: the equal share is at least ``MIN_ALLOWANCE`` (and so is
        the cap), and every size and claim the sizing reads is at most half of it: each
        replica's, and ``news_bound`` (at least every count of what waits: ``pending``'s and
        the followed runs', which the sizing reads in their place). Then a rebalance changes
        nothing but allowances that are not that yet, and empties nothing.

        Why: below 257 peers at the default budget the share is above every want, and the
        caches a simulation models hold far fewer blocks than half of ``MIN_ALLOWANCE``; the
        sizing then read every peer's size, claim and waiting news every few seconds to give
        each the same allowance again (6% of a 64-node simulation's CPU). The replicas' sizes
        and claims are bounded by the index's high-water mark (``SizeWatch``, raised wherever
        one may grow): with the mark at most half, no replica is read (reading each one's size
        and claim was 4% of a 64-node simulation's CPU); above it, every replica is read, and
        where none is over, the mark comes down to the largest."""
        states = self._states
        half = MIN_ALLOWANCE // 2
        if (
            not states
            or news_bound > half
            or self.replica_budget_blocks // len(states) < MIN_ALLOWANCE
            or self.max_replica_elements < MIN_ALLOWANCE
        ):
            return False
        watch = self._size_watch
        if watch.high <= half:
            if ReplicaBudget.check_rebalances:
                assert self._largest_size_or_claim(None) <= watch.high, \
                    "a replica's size or claim above the high-water mark"
            return True
        largest = self._largest_size_or_claim(half)
        if largest > half:
            return False
        watch.high = largest  # every replica read: the mark comes down to what is
        return True

    def _largest_size_or_claim(self, stop: int | None) -> int:
        """The largest size or claimed count of any replica, read one by one (the reference
        ``SizeWatch`` bounds); with ``stop``, the first one above it as soon as it is read."""
        largest = 0
        for st in self._states.values():
            replica = st.replica
            assert replica is not None
            digest = replica.digest
            flat = digest._flat
            size = len(flat) if flat is not None else len(digest)
            announced = replica._announced
            if announced is not None and announced[2] > size:
                size = announced[2]
            if size > largest:
                largest = size
                if stop is not None and largest > stop:
                    return largest
        return largest

    def claims_changed(self) -> None:
        """Some replica's claim (``_announced``) was set other than through ``Replica``'s
        methods and ``AnnounceRun.take_run`` (a test that builds replicas by hand): read every
        replica for the high-water mark again (``SizeWatch``)."""
        self._size_watch.high = self._largest_size_or_claim(None)

    def _size_every(
        self,
        states: list[_PeerState],
        share: int,
        reserve: int,
        pending: Mapping[PeerId, tuple[int, int, float, int]] | None,
    ) -> tuple[list[int], list[int], int]:
        """Each peer's allowance (by position in ``states``), its size, and the spare left:
        every peer given up to the share what it wants, the spare to those wanting more, most
        hits first."""
        budget = self.replica_budget_blocks
        cap = self.max_replica_elements
        # By position in ``states``: each peer's size, what it wants, what it is given.
        sizes: list[int] = []
        wants: list[int] = []
        given: list[int] = []
        pending_get = pending.get if pending else None
        wanting_more = False
        for st in states:
            replica = st.replica
            assert replica is not None
            announced = replica._announced
            later = -1
            if pending_get is not None:
                news = pending_get(st.peer)
                if news is not None:
                    later = news[3]
                    if announced is None or news[0] >= announced[0]:
                        announced = (news[0], 0, news[1])
            claimed = announced[2] if announced is not None else 0
            if later >= 0:
                size = later
            else:
                digest = replica.digest
                flat = digest._flat  # (a flat digest's size without its method call: every peer)
                size = len(flat) if flat is not None else len(digest)
            sizes.append(size)
            # min(max(2 * max(size, claimed), MIN_ALLOWANCE), cap), without the calls
            want = 2 * (size if size > claimed else claimed)
            if want < MIN_ALLOWANCE:
                want = MIN_ALLOWANCE
            if want > cap:
                want = cap
            wants.append(want)
            if want < share:
                given.append(want)
            else:
                given.append(share)
                if want > share:
                    wanting_more = True
        spare = budget - reserve * share - sum(given)
        # The spare goes to peers wanting more than their share; none: nothing to order.
        if spare > 0 and wanting_more:

            def freshness(s: _PeerState) -> float:
                news = pending_get(s.peer) if pending_get is not None else None
                return s.fresh_at if news is None or news[2] <= s.fresh_at else news[2]

            order = sorted(
                range(len(states)),
                key=lambda i: (-states[i].hits, -freshness(states[i]), states[i].added_seq),
            )
            for i in order:
                if spare <= 0 or states[i].hits <= 0.0:
                    break
                extra = min(spare, wants[i] - given[i])
                if extra > 0:
                    given[i] += extra
                    spare -= extra
        return given, sizes, spare

    def _size_short(
        self,
        states: list[_PeerState],
        share: int,
        reserve: int,
        pending: Mapping[PeerId, tuple[int, int, float, int]] | None,
        followed: Mapping[PeerId, FollowedRecord] | None,
    ) -> tuple[list[int], list[int], int]:
        """``_size_every`` where the share is below every want (``share < MIN_ALLOWANCE``,
        ``share < cap``): each peer is given the share and wants more, so the spare is what
        the shares leave, and it goes to the peers in ``_size_every``'s order (most hits, then
        the most recently fresh, then the earliest added) while it lasts, each taking up to
        its want. Sizes are read per peer, wants only for those taking some spare."""
        n = len(states)
        given = [share] * n
        spare = self.replica_budget_blocks - reserve * share - n * share
        pending_get = pending.get if pending else None
        followed_get = followed.get if followed else None
        sizes: list[int] = []
        for st in states:
            later = -1
            moved = False
            if followed_get is not None:
                kept = followed_get(st.peer)
                if kept is not None:
                    run = kept.run
                    if run is not None and run.length != kept.cursor:
                        moved = True
                        if run.changed_since(kept.cursor):
                            later = run.count
            if not moved and pending_get is not None:
                news = pending_get(st.peer)
                if news is not None:
                    later = news[3]
            if later >= 0:
                sizes.append(later)
            else:
                digest = st.replica.digest  # type: ignore[union-attr]
                flat = digest._flat
                sizes.append(len(flat) if flat is not None else len(digest))
        if spare <= 0:
            return given, sizes, spare
        hits_of = self._hits
        hits = [hits_of[st.slot] for st in states]
        top = max(hits)
        if not top > 0.0:
            return given, sizes, spare  # the first in the order has none: nobody takes any

        def news_of(st: _PeerState) -> tuple[int, int, float, int] | None:
            if followed_get is not None:
                kept = followed_get(st.peer)
                if kept is not None:
                    run = kept.run
                    if run is not None and run.length != kept.cursor:
                        return (run.epoch, run.count, run.at,
                                run.count if run.changed_since(kept.cursor) else -1)
            return pending_get(st.peer) if pending_get is not None else None

        def key(i: int) -> tuple[float, float, int]:
            st = states[i]
            news = news_of(st)
            fresh = st.fresh_at if news is None or news[2] <= st.fresh_at else news[2]
            return -st.hits, -fresh, st.added_seq

        def give(i: int) -> bool:
            # One step of ``_size_every``'s loop over the order; False: it stops there.
            nonlocal spare
            st = states[i]
            if spare <= 0 or st.hits <= 0.0:
                return False
            replica = st.replica
            assert replica is not None
            announced = replica._announced
            news = news_of(st)
            if news is not None and (announced is None or news[0] >= announced[0]):
                announced = (news[0], 0, news[1])
            claimed = announced[2] if announced is not None else 0
            size = sizes[i]
            want = min(max(2 * max(size, claimed), MIN_ALLOWANCE), self.max_replica_elements)
            extra = min(spare, want - share)
            if extra > 0:
                given[i] += extra
                spare -= extra
            return True

        # The order's head: the peers with the most hits, by freshness and age; the rest
        # (fewer hits) is sorted only if the spare outlasts them.
        head = sorted((i for i, h in enumerate(hits) if h == top), key=key)
        if all(give(i) for i in head) and spare > 0:
            taken = set(head)
            for i in sorted((j for j in range(n) if j not in taken), key=key):
                if not give(i):
                    break
        return given, sizes, spare

    def _touch(self, peer: PeerId) -> None:
        touched = self._touched
        touched[peer] = None
        if len(touched) > 4 * self.max_peers:  # bounded: past it, every peer counts as touched
            self._touched = {}
            self._touched_all = True

    def take_touched(self) -> dict[PeerId, None] | None:
        """The peers whose allowance or replica object changed since the last call (each time
        ``allowance_changes`` grew), in the order they first changed, or None for every peer
        (the record overflowed); the record starts over."""
        if self._touched_all:
            self._touched, self._touched_all = {}, False
            return None
        touched = self._touched
        if touched:
            self._touched = {}
        return touched

    @property
    def max_replica_elements(self) -> int:
        """The most one replica may ever hold, whatever the budget (antientropy's cap)."""
        return MAX_REPLICA_ELEMENTS


__all__ = ["MIN_ALLOWANCE", "NEWCOMER_RESERVE", "FollowedRecord", "ReplicaBudget"]
