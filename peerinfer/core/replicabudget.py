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
from typing import TYPE_CHECKING

from peerinfer.core.antientropy import MAX_REPLICA_ELEMENTS, Replica
from peerinfer.core.messages import Load
from peerinfer.types import BlockHash, PeerId

_NO_LOAD = Load()

#: The smallest allowance a peer's equal share is sized at (if the budget allows): a cache
#: that grows from nothing is not refused at its first announcements.
MIN_ALLOWANCE = 4096

#: A rebalance that a newcomer needs holds back the shares of ``peers // NEWCOMER_RESERVE``
#: more peers for the next newcomers (``PeerIndex.add_peer``).
NEWCOMER_RESERVE = 8


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
        "hits",
    )

    def __init__(self, peer: PeerId, slot: int, added_seq: int) -> None:
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
        self.hits = 0.0


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

    if TYPE_CHECKING:

        def add_peer(self, peer: PeerId) -> Replica: ...

        def remove_peer(self, peer: PeerId) -> None: ...

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
        self.allowance_changes += 1
        self._touch(state.peer)
        self._allocated += allowance - state.allowance
        state.allowance = allowance
        assert state.replica is not None
        state.replica.max_elements = allowance

    def rebalance(
        self,
        *,
        decay: bool = True,
        pending: Mapping[PeerId, tuple[int, int, float, int]] | None = None,
        before_emptying: Callable[[], None] | None = None,
        reserve: int = 0,
    ) -> list[PeerId]:
        """Recompute every allowance (see :mod:`peerinfer.core.index`, "Memory bounds"); halve the hits (``decay``).
        Returns the peers whose replicas were emptied for holding more than their new
        allowance. O(peers log peers); the node runs it every few seconds.

        ``pending`` names peers with announcements received but not fed in yet, each as
        ``(epoch, count, at, size)`` of the newest (``Replica.take_unchanged`` or, for a shared
        run's changes, ``AnnounceRun.take_run``, and ``announced_fresh`` would take them in;
        ``size``: how many elements the replica then holds, -1 for as many as now): the
        allowances are computed as if they had been fed in, the index left as it is (what they
        change and the sizing reads is the peer's claimed count and size and its freshness). ``before_emptying`` is called once, before the
        first replica is emptied, for the caller to feed them in then (an emptied replica
        starts over, and must not be confirmed by them afterwards).

        ``reserve`` peers more are counted in the equal share, and their shares stay
        unallocated, for newcomers to take (``add_peer``; the periodic rebalance passes 0)."""
        if reserve < 0:
            raise ValueError("reserve must be >= 0")
        self.rebalances += 1
        states = list(self._states.values())
        if not states:
            return []
        budget = self.replica_budget_blocks
        share = budget // (len(states) + reserve)
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
        hungry = spare > 0 and wanting_more

        def freshness(s: _PeerState) -> float:
            news = pending_get(s.peer) if pending_get is not None else None
            return s.fresh_at if news is None or news[2] <= s.fresh_at else news[2]

        if hungry:
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
        emptied = []
        changed = False
        for st, allowance in zip(states, given, strict=True):
            if decay:
                st.hits *= 0.5
            replica = st.replica
            assert replica is not None
            if allowance != st.allowance or allowance != replica.max_elements:
                changed = True
                self._touch(st.peer)
                st.allowance = allowance
                replica.max_elements = allowance
        if changed:
            self.allowance_changes += 1
        self._allocated = budget - reserve * share - spare
        for st, size in zip(states, sizes, strict=True):
            # (an emptied replica is a new one: ``size`` is still that of st.replica's)
            if size > st.allowance:
                if before_emptying is not None:
                    before_emptying()
                    before_emptying = None
                if self.enforce_allowance(st.peer):
                    emptied.append(st.peer)
        return emptied

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


__all__ = ["MIN_ALLOWANCE", "NEWCOMER_RESERVE", "ReplicaBudget"]
