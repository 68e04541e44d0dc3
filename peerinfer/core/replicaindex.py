"""The replica index: every known peer's cache replica, combined by slot bitmasks so that one
walk of a prompt's block-hash chain matches every peer at once; with the peers' loads and
freshness, speculative entries, memory bounds and the replica budget.

How it works (slots and masks, incremental upkeep, speculative entries, memory bounds) is
described in :mod:`peerinfer.core.index`, whose ``PeerIndex`` adds to this class the one thing
routing asks of it: ``candidates()`` and ``holder_candidates()``, the walk turned into routing
``Candidate``s. The split follows that seam: everything here keeps the index's state and its
invariants; the queries there only read it. The replica budget's part of the upkeep (the
per-peer record, allowances, ``rebalance``, ``take_touched``) is ``ReplicaBudget``, this class's
base, in :mod:`peerinfer.core.replicabudget`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import takewhile
from types import SimpleNamespace
from typing import ClassVar

from peerinfer.core.announcerun import RunHolders, RunReads
from peerinfer.core.antientropy import Replica
from peerinfer.core.digest import CacheObserver
from peerinfer.core.followtables import FollowTables
from peerinfer.core.merkle import MerkleDigest, NullObserver, SizeWatch
from peerinfer.core.messages import Load
from peerinfer.core.replicabudget import (
    _NO_LOAD,
    MIN_ALLOWANCE,
    NEWCOMER_RESERVE,
    ReplicaBudget,
    _PeerState,
    _SpecEntry,
)
from peerinfer.core.replicaobserver import PeerObserver
from peerinfer.core.slotmasks import leading, slots_in
from peerinfer.errors import ConfigError
from peerinfer.types import BlockHash, PeerId

ReplicaFactory = Callable[[CacheObserver], Replica]


class ReplicaIndex(ReplicaBudget):
    """All known peers' replicas, combined so that one chain walk matches every peer."""

    def __init__(
        self,
        *,
        max_peers: int = 4096,
        max_speculative_blocks: int = 1_000_000,
        speculative_ttl_s: float = 30.0,
        max_replica_blocks: int = 1_000_000,
        confirm_grace_s: float = 1.0,
        replica_factory: ReplicaFactory | None = None,
        replica_budget_blocks: int = 1 << 22,
        masks: bool = True,
    ) -> None:
        if max_peers < 1:
            raise ConfigError(f"peer index: max_peers must be >= 1, got {max_peers}")
        if max_speculative_blocks < 0:
            raise ConfigError("peer index: max_speculative_blocks must be >= 0")
        if max_replica_blocks < 1:
            raise ConfigError("peer index: max_replica_blocks must be >= 1")
        if not speculative_ttl_s > 0.0:
            raise ConfigError("peer index: speculative_ttl_s must be > 0")
        if not confirm_grace_s >= 0.0:
            raise ConfigError("peer index: confirm_grace_s must be >= 0")
        if replica_budget_blocks < 0:
            raise ConfigError("peer index: replica_budget_blocks must be >= 0")
        self.replica_budget_blocks = replica_budget_blocks
        #: whether the combined masks are kept (see "Without masks" in ``peerinfer.core.index``)
        self.masks = masks
        self._allocated = 0  # the sum of all allowances
        #: grows whenever an allowance or a peer's replica object may have changed (a peer
        #: added or removed, a rebalance): a node that relies on either rechecks it then
        self.allowance_changes = 0
        #: the peers whose allowance or replica object changed since ``take_touched`` (each
        #: change above names its peers here): a node rechecks only those (a shared run it
        #: follows), not every peer it follows, whenever anything changed
        self._touched: dict[PeerId, None] = {}
        #: the record overflowed (nobody took it for long: an index used without a node):
        #: ``take_touched`` then names every peer (None)
        self._touched_all = False
        #: how many rebalances ran (periodic ones and those a newcomer needed)
        self.rebalances = 0
        self.max_peers = max_peers
        self.max_speculative_blocks = max_speculative_blocks
        self.speculative_ttl_s = speculative_ttl_s
        self.max_replica_blocks = max_replica_blocks
        self.confirm_grace_s = confirm_grace_s
        self._replica_factory: ReplicaFactory = replica_factory or Replica
        self._states: dict[PeerId, _PeerState] = {}
        #: at least every replica's size and claim (``SizeWatch``; ``wants_minimal`` reads it)
        self._size_watch = SizeWatch()
        self._hits: list[float] = []
        self._all_minimal = False
        self._observers: dict[PeerId, PeerObserver] = {}
        self._by_slot: dict[int, _PeerState] = {}
        self._free_slots: list[int] = []  # a heap: the lowest free slot is reused first
        self._next_slot = 0
        self._added_seq = 0
        self._masks: dict[BlockHash, int] = {}
        #: per hash, the peers with a live speculative entry holding it (only with ``masks``:
        #: the walk over them reads it; without, each peer's counts are asked alone)
        self._spec_masks: dict[BlockHash, int] = {}
        self._spec_queue: deque[_SpecEntry] = deque()  # every entry, oldest first (some dead)
        self._spec_live = 0
        self._spec_blocks = 0
        self._spec_clock = -math.inf
        #: the peers whose queue of speculative entries is not empty (``has_speculative``)
        self._spec_holders: dict[PeerId, _PeerState] = {}
        self._pending_rescan: dict[PeerId, _PeerState] = {}
        #: grows when a peer is added or removed (``holder_candidates``' rtt order then goes)
        self._membership_changes = 0
        self._rtt_order: list[tuple[float, int, _PeerState]] = []
        self._rtt_order_key: tuple[object, int] = (None, -1)
        #: what the walk over runs reads of the peers followed, kept between routes
        self._follow_tables: FollowTables[_PeerState] = FollowTables()

    # ---------------------------------------------------------------------------- peers

    def add_peer(self, peer: PeerId) -> Replica:
        """The replica of ``peer``, created (and observed by the index) if it is new.

        When the index is full, the least recently fresh peer is removed first.
        """
        state = self._states.get(peer)
        if state is not None:
            assert state.replica is not None
            return state.replica
        if len(self._states) >= self.max_peers:
            victim = min(self._states.values(), key=lambda s: (s.fresh_at, s.added_seq))
            self.remove_peer(victim.peer)
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = self._next_slot
            self._next_slot += 1
            self._hits.append(0.0)
        self._added_seq += 1
        self.allowance_changes += 1
        self._touch(peer)
        self._membership_changes += 1
        self._all_minimal = False
        state = _PeerState(peer, slot, self._added_seq, self._hits)
        observer = PeerObserver(self, state)
        self._states[peer] = state
        self._observers[peer] = observer
        self._by_slot[slot] = state
        # Without masks the replica's changes concern nobody here (its set is read as it is).
        replica = self._replica_factory(observer if self.masks else NullObserver())
        state.replica = replica
        replica.digest.watch = watch = self._size_watch
        size = max(len(replica.digest), replica.claimed)  # (a factory's replica is empty)
        if size > watch.high:
            watch.high = size
        # Until the next rebalance: an equal share, from what is unallocated; when too little
        # is left, a rebalance that holds back room for the next newcomers (``reserve``): a
        # rebalance is O(peers), and where every peer wants at least its share (past
        # ``budget // MIN_ALLOWANCE`` peers) it leaves nothing unallocated, so without the
        # reserve every newcomer rebalanced, O(peers^2) for a node meeting a swarm (measured:
        # three quarters of a 512-node simulation). With an eighth of the peers reserved, a
        # rebalance comes every eighth of a newcomer wave: O(1) amortized per add. (None below
        # 8 peers: there a rebalance is cheap, and a reserve would be a big part of the budget.)
        share = self.replica_budget_blocks // len(self._states)
        if self.replica_budget_blocks - self._allocated >= share:
            state.allowance = share
            self._allocated += share
            replica.max_elements = share
        else:
            self.rebalance(decay=False, reserve=len(self._states) // NEWCOMER_RESERVE)
        return replica

    def add_reads_others(self) -> bool:
        """Whether ``add_peer`` of a new peer would read or change the other peers' state: the
        index is full (the least recently fresh peer is removed) or less than an equal share
        is unallocated (a rebalance sizes every allowance). Otherwise it touches only the new
        peer's state and the unallocated budget."""
        states = len(self._states)
        if states >= self.max_peers:
            return True
        return self.replica_budget_blocks - self._allocated < self.replica_budget_blocks // (states + 1)

    def remove_peer(self, peer: PeerId) -> None:
        """Forget ``peer``: disarm its observer, clear every bit it had, free its slot."""
        state = self._states.pop(peer, None)
        if state is None:
            return
        self.allowance_changes += 1
        self._touch(peer)
        self._membership_changes += 1
        self._observers.pop(peer).armed = False
        bit = state.bit
        masks = self._masks
        assert state.replica is not None
        state.replica.digest.watch = None  # (a pull may still hold it: it counts no more here)
        if state.indexed:
            for h in state.replica.digest:
                m = masks.get(h)
                if m is not None and m & bit:
                    m &= ~bit
                    if m:
                        masks[h] = m
                    else:
                        del masks[h]
        state.indexed = 0
        for entry in state.spec_entries or ():
            self._drop_entry(entry)
        state.spec_entries = None
        self._spec_holders.pop(peer, None)
        assert not state.spec_refs
        self._pending_rescan.pop(peer, None)
        self._allocated -= state.allowance
        del self._by_slot[state.slot]
        heapq.heappush(self._free_slots, state.slot)

    def replica(self, peer: PeerId) -> Replica | None:
        state = self._states.get(peer)
        return None if state is None else state.replica

    def peers(self) -> list[PeerId]:
        return list(self._states)

    def __contains__(self, peer: object) -> bool:
        return peer in self._states

    def __len__(self) -> int:
        return len(self._states)

    def overflowed(self, peer: PeerId) -> bool:
        """Whether ``peer``'s replica holds hashes the index skipped (``max_replica_blocks``)."""
        if not self.masks:
            return False  # nothing is skipped: every replica is asked as it is
        if self._pending_rescan:
            self._run_pending_rescans()
        state = self._states.get(peer)
        if state is None or state.replica is None:
            return False
        return len(state.replica.digest) > state.indexed

    # ---------------------------------------------------------------------- load, freshness

    def set_load(self, peer: PeerId, load: Load, now: float) -> None:
        """Record ``peer``'s announced load. Unknown peers are ignored."""
        state = self._states.get(peer)
        if state is not None:
            state.load = load
            state.load_at = now

    def load(self, peer: PeerId) -> Load:
        """The last load ``peer`` announced (an idle one-slot ``Load()`` if none)."""
        state = self._states.get(peer)
        return _NO_LOAD if state is None else state.load

    def load_age(self, peer: PeerId, now: float) -> float:
        state = self._states.get(peer)
        return math.inf if state is None else max(0.0, now - state.load_at)

    def announced(self, peer: PeerId, load: Load, now: float, *, fresh: bool) -> None:
        """``set_load(peer, load, now)``, and ``mark_fresh(peer, now)`` if ``fresh``: what an
        announcement tells, in one lookup (this runs for every announcement of every peer)."""
        state = self._states.get(peer)
        if state is None:
            return
        state.load = load
        state.load_at = now
        if fresh:
            self._mark_fresh(state, now)

    def announced_fresh(self, announced: Iterable[tuple[PeerId, Load, float]]) -> None:
        """``announced(peer, load, at, fresh=True)`` for each ``(peer, load, at)``, in one call
        (a node takes in the announcements it kept for later this way)."""
        states = self._states
        for peer, load, at in announced:
            state = states.get(peer)
            if state is None:
                continue
            state.load = load
            state.load_at = at
            if at > state.fresh_at:
                state.fresh_at = at
            if state.spec_entries:
                self._confirm(state, at)

    def mark_fresh(self, peer: PeerId, now: float) -> None:
        """``peer``'s replica was confirmed current at ``now``; implies ``confirm(peer, now)``."""
        state = self._states.get(peer)
        if state is not None:
            self._mark_fresh(state, now)

    def digest_age(self, peer: PeerId, now: float) -> float:
        """Seconds since ``peer``'s replica was last confirmed current (inf if never)."""
        state = self._states.get(peer)
        if state is None or state.fresh_at == -math.inf:
            return math.inf
        return max(0.0, now - state.fresh_at)

    # ------------------------------------------------------------------------- matching

    def match_blocks(self, chain: Sequence[BlockHash]) -> dict[PeerId, int]:
        """For every peer holding at least the first block: how many leading blocks it holds."""
        by_slot = self._by_slot
        return {
            by_slot[slot].peer: depth
            for depth, mask in self._walk(chain)
            for slot in slots_in(mask)
        }

    def _walk(
        self, chain: Sequence[BlockHash], newer: Mapping[PeerId, MerkleDigest] | None = None
    ) -> list[tuple[int, int]]:
        """``(depth, mask)`` pairs: the peers in ``mask`` hold exactly ``depth`` leading blocks.

        Depths are distinct and ascending, masks disjoint and non-zero. Without masks, a peer
        in ``newer`` is matched against that set instead of its replica's (its announcements
        with changes that the caller has not fed in yet; with masks there are none).
        """
        if not self.masks:
            return self._walk_sets(chain, newer)
        if self._pending_rescan:
            self._run_pending_rescans()
        out: list[tuple[int, int]] = []
        if not chain:
            return out
        masks = self._masks
        spec = self._spec_masks
        h0 = chain[0]
        alive = masks.get(h0, 0) | spec.get(h0, 0) if spec else masks.get(h0, 0)
        if not alive:
            return out
        depth = 1
        n = len(chain)
        while depth < n:
            h = chain[depth]
            nxt = alive & (masks.get(h, 0) | spec.get(h, 0) if spec else masks.get(h, 0))
            if nxt != alive:
                out.append((depth, alive ^ nxt))
                alive = nxt
                if not alive:
                    return out
            depth += 1
        out.append((n, alive))
        return out

    def _walk_sets(
        self, chain: Sequence[BlockHash], newer: Mapping[PeerId, MerkleDigest] | None
    ) -> list[tuple[int, int]]:
        """``_walk`` without masks: each replica (or newer set) and the peer's speculative
        entries asked for the chain's leading blocks, one peer after another."""
        if not chain:
            return []
        if type(newer) is RunReads and newer.holders is not None:
            return self._walk_runs(chain, newer, newer.holders)
        by_depth: dict[int, int] = {}
        newer_get = newer.get if newer else None
        h0 = chain[0]
        for state in self._states.values():
            replica = state.replica
            assert replica is not None
            digest = replica.digest
            if newer_get is not None:
                later = newer_get(state.peer)
                if later is not None:
                    digest = later
            flat = digest._flat  # (a flat digest's set, read without the method calls)
            held: set[int] | MerkleDigest = digest if flat is None else flat
            spec = state.spec_refs
            if spec:
                if h0 not in held and h0 not in spec:
                    continue
                depth = 1
                for h in chain[1:]:
                    if h not in held and h not in spec:
                        break
                    depth += 1
            else:
                if h0 not in held:
                    continue
                # The leading run of held hashes, counted in C (holders of a shared prefix:
                # dozens of peers, dozens of blocks each).
                depth = len(list(takewhile(held.__contains__, chain)))
            by_depth[depth] = by_depth.get(depth, 0) | state.bit
        return sorted(by_depth.items())

    #: tests: every ``_walk_runs`` also walks every peer and requires the same answer
    check_run_walks: ClassVar[bool] = False
    #: how many walks ``_walk_runs`` answered (every index together; tests), counted on an
    #: object: writing a class attribute on every route would make CPython drop what it
    #: specialized for this class's attribute reads (``Members.counts``)
    walk_counts: ClassVar[SimpleNamespace] = SimpleNamespace(run_walks=0)

    def _walk_runs(
        self, chain: Sequence[BlockHash], reads: RunReads, holders: RunHolders
    ) -> list[tuple[int, int]]:
        """``_walk_sets`` for a node whose followed runs are all indexed in ``holders``
        (``_holders_by_depth``), as ``(depth, mask)`` pairs."""
        out = []
        for depth, group in sorted(self._holders_by_depth(chain, reads, holders).items()):
            mask = 0
            for state in group:
                mask |= state.bit
            out.append((depth, mask))
        return out

    def _holders_by_depth(
        self, chain: Sequence[BlockHash], reads: RunReads, holders: RunHolders
    ) -> dict[int, list[_PeerState]]:
        """The peers holding ``chain``'s first block, by how many of its leading blocks they
        hold (in no order), for a node whose followed runs are all indexed in ``holders``: a
        followed peer reads its run's set (``RunReads``), so those are read off ``holders``'
        walk, which counts every run's depth at once; the peers not followed, and followed
        ones with speculative entries, are asked one by one as in ``_walk_sets``. The same
        answer in time proportional to the chain's matched length, the runs holding its first
        block and the peers asked alone, not to every peer (a swarm's node follows nearly
        every peer). A route reads the peers' states themselves (``_matched_by_slot``): no
        mask of them is made and read back."""
        states = self._states
        following = reads.following
        spec = self._spec_holders
        tables = self._follow_tables
        alone = tables.not_followed(states, following, reads.following_changes, self._membership_changes)
        if spec:
            also = spec.keys() & following.keys()
            if also:
                if alone or len(also) > 1:
                    # (made as it always was, so that the peers come in the same order)
                    alone = states.keys() - following.keys()
                    alone |= also
                else:
                    alone = also
        by_depth: dict[int, list[_PeerState]] = {}
        newer_get = reads.get
        for peer in alone:
            state = states[peer]
            digest = state.replica.digest  # type: ignore[union-attr]
            later = newer_get(peer)
            if later is not None:
                digest = later
            flat = digest._flat
            held = (digest if flat is None else flat).__contains__
            depth = leading(chain, held, state.spec_refs)
            if depth:
                group = by_depth.get(depth)
                if group is None:
                    by_depth[depth] = [state]
                else:
                    group.append(state)
        followed = tables.by_run_slot(states, reads, holders, self._membership_changes)
        # Every run's depth at once (``RunHolders.walk``: the runs' masks ANDed along the
        # chain); of those, the runs this node follows for their senders.
        for depth, slots in holders.walk(chain):
            group = by_depth.get(depth)
            while slots:
                low = slots & -slots
                slots ^= low
                holder = followed[low.bit_length() - 1]
                if holder is None or holder.peer in spec:
                    continue
                if group is None:
                    group = by_depth[depth] = [holder]
                else:
                    group.append(holder)
        ReplicaIndex.walk_counts.run_walks += 1
        if ReplicaIndex.check_run_walks:
            every = self._walk_sets(chain, {p: d for p, d in reads.items()})
            found: dict[int, int] = {}
            for depth, group in by_depth.items():
                for state in group:
                    assert not found.get(depth, 0) & state.bit, f"{state.peer} twice at {depth}"
                    found[depth] = found.get(depth, 0) | state.bit
            assert sorted(found.items()) == every, \
                f"walk over runs {sorted(found.items())} != over every peer {every}"
        return by_depth

    # ---------------------------------------------------------------------- speculation

    def add_speculative(self, peer: PeerId, chain: Sequence[BlockHash], now: float) -> None:
        """Assume ``peer`` will hold ``chain`` (we just routed it there) until confirmed.

        Unknown peers are ignored. A chain longer than the whole budget keeps its prefix.
        """
        state = self._states.get(peer)
        if state is None or not chain or self.max_speculative_blocks == 0:
            return
        time = max(now, self._spec_clock)
        self._spec_clock = time
        self.expire(time)
        blocks = tuple(chain[: self.max_speculative_blocks])
        while self._spec_blocks + len(blocks) > self.max_speculative_blocks:
            self._drop_entry(self._spec_queue.popleft())
        entry = _SpecEntry(state, blocks, time)
        refs = state.spec_refs
        if self.masks:
            bit = state.bit
            spec = self._spec_masks
            for h in blocks:
                count = refs.get(h, 0)
                refs[h] = count + 1
                if not count:
                    spec[h] = spec.get(h, 0) | bit
        else:
            # Without masks no walk reads a combined speculative mask (each peer with entries
            # is asked alone, by its counts: ``_walk_sets``), so none is kept.
            counted = False
            if not refs:
                # The peer's only live entry (most are: its next announcement confirms it):
                # each block counted once, in C. A chain names each prefix once, so its blocks
                # are distinct; if some repeat, they are counted one by one below.
                refs.update(dict.fromkeys(blocks, 1))
                counted = len(refs) == len(blocks)
                if not counted:
                    refs.clear()
            if not counted:
                get = refs.get
                for h in blocks:
                    refs[h] = get(h, 0) + 1
        self._spec_queue.append(entry)
        if state.spec_entries is None:
            state.spec_entries = deque()
        state.spec_entries.append(entry)
        self._spec_holders[state.peer] = state
        state.spec_live += 1
        self._spec_live += 1
        self._spec_blocks += len(blocks)
        self._compact_queues(state)

    def confirm(self, peer: PeerId, now: float) -> None:
        """``peer``'s replica was refreshed at ``now``: drop its entries older than
        ``now - confirm_grace_s`` (what they predicted is in the replica now, or never was)."""
        state = self._states.get(peer)
        if state is not None:
            self._confirm(state, now)

    def expire(self, now: float) -> None:
        """Drop speculative entries older than ``speculative_ttl_s``."""
        cutoff = now - self.speculative_ttl_s
        queue = self._spec_queue
        while queue and (not queue[0].alive or queue[0].time <= cutoff):
            self._drop_entry(queue.popleft())

    def has_speculative(self, peer: PeerId) -> bool:
        """Whether ``peer`` has speculative entries queued (some may be dead already)."""
        state = self._states.get(peer)
        return state is not None and bool(state.spec_entries)

    def speculative_peers(self) -> list[PeerId]:
        """The peers ``has_speculative`` is true of, in time proportional to their number."""
        return list(self._spec_holders)

    def speculative_blocks(self) -> int:
        """How many speculative block references are held (at most the budget)."""
        return self._spec_blocks

    def speculative_holders(self, h: BlockHash) -> list[PeerId]:
        """The peers with a live speculative entry containing ``h`` (for tests and status)."""
        if not self.masks:
            return [s.peer for s in self._by_slot.values() if h in s.spec_refs]
        m = self._spec_masks.get(h, 0)
        return [s.peer for s in self._by_slot.values() if m & s.bit]

    # -------------------------------------------------------------------------- memory

    def memory_entries(self) -> int:
        """Hash-keyed entries the index holds: combined masks plus speculative structures."""
        if self.masks:
            spec_keys = len(self._spec_masks)
        else:  # the hashes a combined speculative mask would have had (none is kept)
            spec_keys = len(set().union(*(s.spec_refs.keys() for s in self._states.values())))
        return len(self._masks) + spec_keys + self._spec_blocks

    def replica_blocks(self) -> int:
        """Elements held by all replicas together (owned by the replicas, bounded by them)."""
        return sum(len(s.replica.digest) for s in self._states.values() if s.replica is not None)

    # ----------------------------------------------------------------------- internals

    def _mark_fresh(self, state: _PeerState, now: float) -> None:
        if now > state.fresh_at:
            state.fresh_at = now
        if state.spec_entries:
            self._confirm(state, now)

    def _confirm(self, state: _PeerState, now: float) -> None:
        entries = state.spec_entries
        if not entries:
            return
        cutoff = now - self.confirm_grace_s
        while entries and (not entries[0].alive or entries[0].time < cutoff):
            self._drop_entry(entries.popleft())
        self._compact_queues(state)

    def _index_block(self, state: _PeerState, h: BlockHash) -> None:
        self._index_blocks(state, (h,))

    def _index_blocks(self, state: _PeerState, hashes: Sequence[BlockHash]) -> None:
        """Give each of ``hashes`` this peer's bit, up to the peer's cap (beyond it the peer is
        marked ``skipped``, for a later rescan)."""
        masks = self._masks
        get = masks.get
        bit = state.bit
        room = self.max_replica_blocks - state.indexed
        for h in hashes:
            m = get(h, 0)
            if m & bit:
                continue
            if room <= 0:
                state.skipped = True
                continue
            masks[h] = m | bit
            room -= 1
        state.indexed = self.max_replica_blocks - room

    def _unindex_block(self, state: _PeerState, h: BlockHash) -> None:
        masks = self._masks
        m = masks.get(h, 0)
        bit = state.bit
        if m & bit:
            m &= ~bit
            if m:
                masks[h] = m
            else:
                del masks[h]
            state.indexed -= 1
        if state.skipped and state.indexed <= (self.max_replica_blocks * 3) // 4:
            # Not now: inside the digest's callback its own state may be mid-update.
            self._pending_rescan[state.peer] = state

    def _rescan(self, state: _PeerState) -> None:
        """Index the replica's hashes that lack this peer's bit, up to the cap."""
        assert state.replica is not None
        digest = state.replica.digest
        masks = self._masks
        bit = state.bit
        cap = self.max_replica_blocks
        complete = True
        for h in digest:
            m = masks.get(h, 0)
            if m & bit:
                continue
            if state.indexed >= cap:
                complete = False
                break
            masks[h] = m | bit
            state.indexed += 1
        state.skipped = not complete

    def _run_pending_rescans(self) -> None:
        pending = self._pending_rescan
        self._pending_rescan = {}
        for state in pending.values():
            self._rescan(state)

    def _drop_entry(self, entry: _SpecEntry) -> None:
        if not entry.alive:
            return
        entry.alive = False
        state = entry.state
        refs = state.spec_refs
        # (without masks no combined speculative masks are kept: ``add_speculative``)
        spec = self._spec_masks if self.masks else None
        if spec is None and state.spec_live == 1:
            # The peer's last live entry (nearly every drop: an entry mostly lives alone until
            # its peer's next announcement): the counts are this entry's blocks alone, so
            # counting each down would empty them.
            refs.clear()
        else:
            self._uncount_blocks(entry, refs, spec)
        state.spec_live -= 1
        self._spec_live -= 1
        self._spec_blocks -= len(entry.blocks)

    def _uncount_blocks(
        self, entry: _SpecEntry, refs: dict[BlockHash, int], spec: dict[BlockHash, int] | None
    ) -> None:
        """Count ``entry``'s blocks down in its peer's ``refs`` (and, with masks, clear the
        peer's bit in ``spec`` where a count reaches 0)."""
        state = entry.state
        for h in entry.blocks:
            count = refs[h] - 1
            if count:
                refs[h] = count
            else:
                del refs[h]
                if spec is not None:
                    m = spec[h] & ~state.bit
                    if m:
                        spec[h] = m
                    else:
                        del spec[h]

    def _compact_queues(self, state: _PeerState) -> None:
        # Dead entries are removed lazily; rebuild a queue once they are the majority so the
        # queues stay within a constant factor of the live entries.
        entries = state.spec_entries
        if entries is not None and len(entries) > 2 * state.spec_live + 8:
            state.spec_entries = deque(e for e in entries if e.alive)
        if not state.spec_entries:
            self._spec_holders.pop(state.peer, None)
        if len(self._spec_queue) > 2 * self._spec_live + 8:
            self._spec_queue = deque(e for e in self._spec_queue if e.alive)

    # ----------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if any internal structure disagrees with the others."""
        states = self._states
        assert len(states) <= self.max_peers
        assert sum(s.allowance for s in states.values()) == self._allocated
        assert self._allocated <= self.replica_budget_blocks
        # (equal, not only within: ``ReplicaBudget._give_minimal`` reads the allowance alone)
        assert all(s.replica is not None and s.replica.max_elements == s.allowance for s in states.values())
        assert not self._all_minimal or all(s.allowance == MIN_ALLOWANCE for s in states.values())
        assert len(self._hits) == self._next_slot
        assert set(self._observers) == set(states)
        assert all(o.armed for o in self._observers.values())
        assert {s.slot: s for s in states.values()} == self._by_slot
        assert all(state.bit == 1 << slot for slot, state in self._by_slot.items())
        assert not set(self._free_slots) & set(self._by_slot)
        assert len(set(self._free_slots)) == len(self._free_slots)
        assert set(self._free_slots) | set(self._by_slot) == set(range(self._next_slot))
        used = 0
        for state in states.values():
            used |= state.bit
        if not self.masks:
            assert not self._masks and not self._pending_rescan, "masks kept without masks"
            assert all(s.indexed == 0 and not s.skipped for s in states.values())
        # Combined masks: no empty mask, no bit of a free slot, each bit a replica element.
        indexed_count = dict.fromkeys(states, 0)
        for h, m in self._masks.items():
            assert m, "an empty mask must be deleted"
            assert m & ~used == 0, f"hash {h:#x} carries a bit of a free slot"
            for state in states.values():
                if m & state.bit:
                    assert state.replica is not None and h in state.replica.digest
                    indexed_count[state.peer] += 1
        for state in states.values():
            assert state.replica is not None
            assert indexed_count[state.peer] == state.indexed
            assert state.indexed <= self.max_replica_blocks
            if not self.masks:
                continue
            if not state.skipped:
                assert state.indexed == len(state.replica.digest)
            else:
                assert len(state.replica.digest) >= state.indexed
        assert all(self._states.get(p) is s for p, s in self._pending_rescan.items())
        for state in states.values():
            replica = state.replica
            assert replica is not None and replica.digest.watch is self._size_watch
            assert max(len(replica.digest), replica.claimed) <= self._size_watch.high, \
                f"{state.peer}: a replica's size or claim above the index's high-water mark"
        # Speculative structures agree with the live entries.
        live = [e for e in self._spec_queue if e.alive]
        assert len(live) == self._spec_live
        assert sum(len(e.blocks) for e in live) == self._spec_blocks
        assert self._spec_blocks <= self.max_speculative_blocks
        times = [e.time for e in live]
        assert times == sorted(times)
        expected_masks: dict[BlockHash, int] = {}
        for state in states.values():
            refs: dict[BlockHash, int] = {}
            mine = [e for e in state.spec_entries or () if e.alive]
            assert len(mine) == state.spec_live
            for e in mine:
                assert e.state is state
                for h in e.blocks:
                    refs[h] = refs.get(h, 0) + 1
            assert refs == state.spec_refs
            for h in refs:
                expected_masks[h] = expected_masks.get(h, 0) | state.bit
        assert sum(s.spec_live for s in states.values()) == self._spec_live
        assert self._spec_holders == {p: s for p, s in states.items() if s.spec_entries}
        if self.masks:
            assert expected_masks == self._spec_masks
        else:
            assert not self._spec_masks, "speculative masks kept without masks"


__all__ = ["MIN_ALLOWANCE", "NEWCOMER_RESERVE", "ReplicaFactory", "ReplicaIndex", "leading"]
