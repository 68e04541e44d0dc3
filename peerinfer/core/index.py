"""The peer index: every known peer's cache replica, combined for one-walk prefix matching.

Theory of operation
-------------------
Each remote peer we know gets a *replica*: our copy of its cache digest (a set of block hashes,
kept in step by gossip and anti-entropy, see ``peerinfer.core.antientropy``). Routing a prompt
needs, for every peer, how many leading blocks of the prompt's hash chain that peer holds. Asking
each replica in turn costs ``peers x depth`` lookups; the index answers for all peers in one walk.

*Slots and masks.* Every peer owns a *slot*, a small integer, and so a bit ``1 << slot``. The
index keeps one combined dict ``BlockHash -> int`` whose value is the bitmask of the peers whose
replica holds that hash. Matching a chain ``h[0], h[1], ...`` is::

    alive = mask(h[0])
    for i = 1, 2, ...:  next = alive & mask(h[i]);  the bits in alive & ~next matched exactly i
                        blocks;  alive = next;  stop when alive == 0
    the bits still alive matched the whole chain

One dict lookup and one big-integer AND per block, whatever the number of peers. Because a
block hash names its whole prefix, "the longest run of leading blocks present" is exactly the
prefix length that peer can serve from its cache (as far as its digest says). Reading the peers
out of a dropped mask costs O(peers) once per walk in total: sparse masks peel off their lowest
bit, dense ones go byte by byte through a table of the slots each byte value stands for.

``candidates()`` turns one walk into the routing policies' input: the local candidate (exact,
from the caller's radix cache) and one ``Candidate`` per known peer with its matched tokens,
announced load, round trip, digest age and in-flight count.

*Without masks* (``PeerIndex(masks=False)``, ``NodeConfig.index_masks``; the simulator's choice
when it shares runs of announcements between recipients). The masks are per node, so every
recipient of an announcement with changes updates its own; without them the replicas' changes
concern the index not at all, and a walk asks each replica (its flat set) and the peer's
speculative entries for the chain's leading blocks instead, O(peers) per route, with the same
``(depth, mask)`` answer. A caller may name, per peer, a newer set to match instead of the
replica's (the set a shared run's waiting changes lead to: ``peerinfer.core.announcerun``).
Nothing is skipped then (``max_replica_blocks`` bounds only the masks; the replica budget
bounds the replicas). When every run the caller follows reports to one ``RunHolders`` (the
simulator's), ``newer`` is a ``RunReads`` view and the walk reads the followed peers' depths
off one walk of the runs' own masks (``RunHolders.walk``: per block, the runs whose set holds
it), and asks the peers not followed one by one (``ReplicaIndex._walk_runs``): the same
answer, in time proportional to the chain's matched length and the holders, not to every peer.

*Incremental upkeep.* The index is the observer of every replica it creates: the digest calls
``block_added(h)`` / ``block_removed(h)`` for each real change, and the peer's observer flips
that peer's bit. A reconciliation therefore updates the index as it goes, in time proportional
to the change. A removed peer's observer is disarmed first (the anti-entropy code may still hold
its replica), then every bit it had is cleared, and only then is its slot reused: a reused slot
never inherits a stale bit. Free slots are handed out lowest first, to keep masks short.

*Speculative entries.* Right after we route a prompt to a peer, that peer will cache it, but its
digest will not say so until its next announcement. ``add_speculative`` records "``peer`` holds
``chain``" in a second mask dict (with per-peer reference counts, because several pending
requests may share blocks). The walk ORs the two masks. An entry goes away when

* the peer's replica is confirmed current at a time later than the entry plus a grace period
  (``confirm``; the grace covers an announcement that was already in flight when we routed),
* it is older than ``speculative_ttl_s`` (``expire``), or
* the speculative budget ``max_speculative_blocks`` is full: the oldest entries go first.

Entry times are clamped to be non-decreasing (``now`` is expected to be monotonic), so the
oldest entry is always at the front of a queue and every removal is amortized O(blocks).

Memory bounds
-------------
* At most ``max_peers`` peers. Adding one more drops the *least recently fresh* peer (never
  fresh counts as oldest; ties go to the earliest added).
* At most ``max_replica_blocks`` indexed hashes per peer. A replica that grows past the cap keeps
  its elements (the replica is the anti-entropy module's object), but the index stops indexing
  the excess: that peer's matches can then only be *under*-estimated, never over, and
  ``overflowed(peer)`` reports it. When the replica shrinks to three quarters of the cap, the
  index rescans it and indexes what it skipped (the hysteresis keeps the rescan amortized; the
  rescan runs at the next query, never inside the digest's own change callback).
* At most ``max_speculative_blocks`` speculative block references in total.
* The replicas together hold at most ``replica_budget_blocks`` elements (the *replica budget*,
  one for all peers). Each peer has an *allowance*, its replica's ``max_elements``, and the
  allowances never sum to more than the budget. ``rebalance(now)`` recomputes them: every peer
  gets up to an equal share (``budget // peers``), enough for twice what it holds or claims
  (headroom for a growing cache, at least ``MIN_ALLOWANCE``); what the shares leave unused goes
  to the *useful* peers, most hits first (a hit: a routed prompt matched at least one of its
  blocks; hits halve at every rebalance), then the most recently fresh. A peer whose prompts
  never hit gets no more than the equal share, however much it claims, so announcements of
  fresh hashes cannot buy memory. A newcomer between rebalances gets what is left unallocated
  (at most an equal share). ``enforce_allowance(peer)`` empties a replica that grew past its
  allowance (a delta or a pull can add elements before the count check): the caller calls it
  after every change it feeds a replica, so at event boundaries the budget is never exceeded,
  and within one event by at most one message's elements.

So the combined mask dict holds at most ``max_peers * max_replica_blocks`` keys and the
speculative structures at most ``2 * max_speculative_blocks`` (``memory_entries`` counts them).
The replicas' own elements are not counted here: a replica refuses announcements of more than
``antientropy.MAX_REPLICA_ELEMENTS`` elements, which bounds it; the index's own structures stay
within the bounds above.

The index never reads a clock: every time is a ``now`` parameter, in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping, Sequence

from peerinfer.core.announcerun import RunReads
from peerinfer.core.merkle import MerkleDigest
from peerinfer.core.messages import Load
from peerinfer.core.replicabudget import MIN_ALLOWANCE, NEWCOMER_RESERVE, _PeerState
from peerinfer.core.replicaindex import ReplicaFactory, ReplicaIndex
from peerinfer.core.routing import Candidate, Row, RowBound, make_candidate
from peerinfer.core.slotmasks import slots_in
from peerinfer.types import BlockHash, PeerId


def _first(item: tuple[int, object]) -> int:
    return item[0]


def _rtt_and_seq(item: tuple[float, int, _PeerState]) -> tuple[float, int]:
    return item[0], item[1]


#: ``PeerIndex.holder_candidates``: the most busy plain non-holders visited, nearest first,
#: before the first idle one (beyond it, every peer is visited)
NEAR_SCAN = 32


class HolderCandidates:
    """``PeerIndex.holder_candidates``'s answer: the pruned list, the positions of its
    stand-ins in it, and ``every()``, the full list of ``candidates()`` (built on demand).
    Asked for ``rows``, the pruned list may come as ``rows`` instead (``candidates`` None):
    each candidate's ``make_candidate`` arguments as a tuple, the local one first, for a
    policy that builds only the candidates it reads (``CostPolicy.choose_rows``); ``plain``
    then says that every row announced the caller's speed (or none). Asked with a ``bound``,
    rows come with ``ttfts``, their scores, and leave out candidates that cannot matter."""

    __slots__ = ("candidates", "stand_ins", "every", "rows", "plain", "ttfts")

    def __init__(
        self, candidates: list[Candidate] | None, stand_ins: set[int],
        every: Callable[[], list[Candidate]], rows: list[Row] | None = None, plain: bool = True,
        ttfts: list[float] | None = None,
    ) -> None:
        self.candidates = candidates
        self.stand_ins = stand_ins
        self.every = every
        self.rows = rows
        self.plain = plain
        self.ttfts = ttfts

    def listed(self) -> list[Candidate]:
        """The pruned list as candidates (built from the rows if it came as rows)."""
        if self.candidates is None:
            assert self.rows is not None
            self.candidates = [make_candidate(*row) for row in self.rows]
        return self.candidates


class PeerIndex(ReplicaIndex):
    """All known peers' replicas, combined so that one chain walk matches every peer, and the
    routing candidates read from them (the state and its upkeep are ``ReplicaIndex``'s)."""

    def candidates(
        self,
        chain: Sequence[BlockHash],
        *,
        block_size: int,
        local_peer: PeerId,
        local_matched_tokens: int,
        local_load: Load,
        now: float,
        rtt_s: Mapping[PeerId, float],
        default_rtt_s: float = 0.05,
        inflight: Mapping[PeerId, int] | None = None,
        exclude: Container[PeerId] = (),
        max_digest_age_s: float = math.inf,
        max_matched_tokens: int | None = None,
        heard: Mapping[PeerId, tuple[Load, float]] | None = None,
        newer: Mapping[PeerId, MerkleDigest] | None = None,
    ) -> list[Candidate]:
        """The local candidate (first) and one per known peer, for a prompt with ``chain``.

        A remote peer's matched tokens are its matched blocks times ``block_size``; the local
        figure comes from the caller's own radix cache (exact, digest age 0). All are capped at
        ``max_matched_tokens`` when given (e.g. prompt length - 1: the engine must run the last
        token). ``inflight`` counts requests this node sent to a peer that have not finished.
        Peers in ``exclude`` (already tried) and peers whose digest is older than
        ``max_digest_age_s`` are left out; the local candidate never is. ``heard`` gives, for
        some peers, a load and a time from announcements the caller received but has not fed
        in yet (each confirming the peer's replica current): the candidate is as if they had
        been (``announced(peer, load, at, fresh=True)``), the index itself is left as it is.
        ``newer``: without masks, the sets some peers' replicas will hold once the caller feeds
        in what it received (matched instead of the replicas': ``_walk``).
        """
        cap = math.inf if max_matched_tokens is None else max_matched_tokens
        matched = self._matched_by_slot(chain, block_size, cap, newer=newer)
        return self._every_candidate(
            matched, cap, local_peer, local_matched_tokens, local_load, now, rtt_s,
            default_rtt_s, inflight, exclude, max_digest_age_s, heard,
        )

    def _matched_by_slot(
        self, chain: Sequence[BlockHash], block_size: int, cap: float, holders: list[int] | None = None,
        newer: Mapping[PeerId, MerkleDigest] | None = None,
    ) -> list[int]:
        """Per slot, the prompt tokens its peer holds (0: none), counting a hit for each holder
        (whose slots are appended to ``holders``, if given)."""
        matched = [0] * self._next_slot
        hits = self._hits
        if type(newer) is RunReads and newer.holders is not None and chain and not self.masks:
            # (``_walk_sets``' walk over the runs, read as the peers' states themselves)
            for depth, group in self._holders_by_depth(chain, newer, newer.holders).items():
                tokens = depth * block_size
                if tokens > cap:
                    tokens = int(cap)
                for state in group:
                    slot = state.slot
                    matched[slot] = tokens
                    hits[slot] += 1.0  # a hit for the replica budget, as below
                    if holders is not None:
                        holders.append(slot)
            return matched
        for depth, mask in self._walk(chain, newer):
            tokens = depth * block_size
            if tokens > cap:
                tokens = int(cap)
            slots = slots_in(mask)
            if holders is not None:
                holders.extend(slots)
            for slot in slots:
                matched[slot] = tokens
                # A hit for the replica budget: this peer's replica helped route a prompt.
                hits[slot] += 1.0
        return matched

    def _every_candidate(
        self,
        matched: list[int],
        cap: float,
        local_peer: PeerId,
        local_matched_tokens: int,
        local_load: Load,
        now: float,
        rtt_s: Mapping[PeerId, float],
        default_rtt_s: float,
        inflight: Mapping[PeerId, int] | None,
        exclude: Container[PeerId],
        max_digest_age_s: float,
        heard: Mapping[PeerId, tuple[Load, float]] | None,
    ) -> list[Candidate]:
        inflight = inflight or {}
        get_inflight = inflight.get
        make = make_candidate
        out = [
            make(
                local_peer,
                True,
                int(min(local_matched_tokens, cap)),
                local_load,
                0.0,
                0.0,
                get_inflight(local_peer, 0),
            )
        ]
        append = out.append
        get_rtt = rtt_s.get
        oldest = now - max_digest_age_s  # fresh_at below this: too old
        heard_get = heard.get if heard else None
        excluding = bool(exclude)  # once: a container's truth may cost a call
        for peer, state in self._states.items():
            fresh_at = state.fresh_at
            load = state.load
            if heard_get is not None:
                news = heard_get(peer)
                if news is not None:
                    load = news[0]
                    if news[1] > fresh_at:
                        fresh_at = news[1]
            if fresh_at < oldest or peer == local_peer or (excluding and peer in exclude):
                continue
            age = now - fresh_at
            append(
                make(
                    peer,
                    False,
                    matched[state.slot],
                    load,
                    get_rtt(peer, default_rtt_s),
                    age if age > 0.0 else 0.0,  # inf when never fresh (fresh_at == -inf)
                    get_inflight(peer, 0) if inflight else 0,
                )
            )
        return out

    def holder_candidates(
        self,
        chain: Sequence[BlockHash],
        *,
        block_size: int,
        local_peer: PeerId,
        local_matched_tokens: int,
        local_load: Load,
        now: float,
        rtt_s: Mapping[PeerId, float],
        default_rtt_s: float = 0.05,
        inflight: Mapping[PeerId, int] | None = None,
        exclude: Container[PeerId] = (),
        max_digest_age_s: float = math.inf,
        max_matched_tokens: int | None = None,
        heard: Mapping[PeerId, tuple[Load, float]] | None = None,
        own_speed: tuple[int, ...] = (),
        plain_loads: bool = False,
        rtt_version: object = None,
        newer: Mapping[PeerId, MerkleDigest] | None = None,
        rows: bool = False,
        bound: RowBound | None = None,
    ) -> HolderCandidates:
        """``candidates()`` pruned for a policy that estimates a plain non-holder by its load and
        round trip alone (``CostPolicy.choose_among_holders``), with the full list at hand.

        Kept, in ``candidates()``'s order: the local candidate, every peer that holds part of
        the prompt (its replica or a speculative entry), and every peer announcing another
        speed than ``own_speed`` or a batch at work (more than one slot, something running:
        estimated otherwise). The rest, the *plain non-holders*, are keyed by ``(outstanding,
        rtt)`` (outstanding: the larger of announced queued + running and ``inflight``); of
        each key on the keys' Pareto front (no other key is at most as large in both and
        smaller in one) the first peer in order is kept as a *stand-in* (its position is in
        ``stand_ins``). An estimate that does not decrease as either grows puts every plain
        non-holder left out at or above some stand-in. The same hits are counted as by
        ``candidates()``, once: ``every()`` builds the full list from the same walk.

        With ``plain_loads`` (the caller knows that no peer announced another speed or more
        than one slot) and ``rtt_version`` (changed whenever ``rtt_s`` changes), the plain
        non-holders are not all visited: in the order of (rtt, position), kept per index and
        rebuilt only when ``rtt_version`` or the peers change, they are taken until the first
        idle one (outstanding 0), at most ``NEAR_SCAN`` of them, and each is a stand-in. Every
        one left out then has at least the last one's rtt and outstanding count (the same
        front, found without visiting the rest). When no idle one comes within the bound, all
        are visited as above.

        With ``rows``, the bounded form's list comes as rows (``HolderCandidates.rows``).
        With a ``bound`` too (``CostPolicy.row_bound``), the bounded form scores each row as
        it makes it, the local one first and then the holders deepest first, and leaves out
        the holders, and the stand-ins' search, whose ``bound.floor`` is above the second-best
        score so far: they cannot matter to the decision (a holder's floor rises as its match
        falls, so the first left out ends the holders). The rows then come with their scores
        (``HolderCandidates.ttfts``). The same hits are counted."""
        cap = math.inf if max_matched_tokens is None else max_matched_tokens
        holders: list[int] | None = [] if plain_loads and rtt_version is not None else None
        matched = self._matched_by_slot(chain, block_size, cap, holders, newer)
        get_inflight = inflight.get if inflight else None

        def every() -> list[Candidate]:
            return self._every_candidate(
                matched, cap, local_peer, local_matched_tokens, local_load, now, rtt_s,
                default_rtt_s, inflight, exclude, max_digest_age_s, heard,
            )

        if holders is not None:
            near = self._near_candidates(
                holders, matched, local_peer, local_matched_tokens, local_load, now, rtt_s,
                default_rtt_s, inflight, exclude, max_digest_age_s, heard, cap, rtt_version,
                own_speed, bound if rows else None,
            )
            if near is not None:
                found, stand_ins, same_speed, ttfts = near
                if rows:
                    return HolderCandidates(None, stand_ins, every, found, same_speed, ttfts)
                return HolderCandidates([make_candidate(*row) for row in found], stand_ins, every)
        make = make_candidate
        kept: list[tuple[int, Candidate]] = [
            (
                -1,
                make(
                    local_peer,
                    True,
                    int(min(local_matched_tokens, cap)),
                    local_load,
                    0.0,
                    0.0,
                    get_inflight(local_peer, 0) if get_inflight is not None else 0,
                ),
            )
        ]
        append = kept.append
        get_rtt = rtt_s.get
        oldest = now - max_digest_age_s
        heard_get = heard.get if heard else None
        excluding = bool(exclude)
        # per plain key (outstanding, rtt): the first peer's position, state, load and age
        plain: dict[tuple[int, float], tuple[int, _PeerState, Load, float]] = {}
        position = -1
        for peer, state in self._states.items():
            fresh_at = state.fresh_at
            load = state.load
            if heard_get is not None:
                news = heard_get(peer)
                if news is not None:
                    load = news[0]
                    if news[1] > fresh_at:
                        fresh_at = news[1]
            if fresh_at < oldest or peer == local_peer or (excluding and peer in exclude):
                continue
            position += 1
            n = load.queued + load.running
            sent = get_inflight(peer, 0) if get_inflight is not None else 0
            if sent > n:
                n = sent
            tokens = matched[state.slot]
            speed = load.speed
            if tokens or (speed and speed != own_speed) or (n and load.slots > 1):
                age = now - fresh_at
                append((position, make(peer, False, tokens, load, get_rtt(peer, default_rtt_s),
                                       age if age > 0.0 else 0.0, sent)))
                continue
            key = (n, get_rtt(peer, default_rtt_s))
            if key not in plain:
                age = now - fresh_at
                plain[key] = (position, state, load, age if age > 0.0 else 0.0)
        stand_in_positions: set[int] = set()
        best_rtt = math.inf
        for key in sorted(plain):  # by outstanding, then rtt: the front's rtts fall
            rtt = key[1]
            if rtt < best_rtt:
                best_rtt = rtt
                pos, state, load, age = plain[key]
                stand_in_positions.add(pos)
                sent = get_inflight(state.peer, 0) if get_inflight is not None else 0
                append((pos, make(state.peer, False, 0, load, rtt, age, sent)))
        kept.sort(key=_first)
        stand_ins = {i for i, (pos, _) in enumerate(kept) if pos in stand_in_positions}
        return HolderCandidates([c for _, c in kept], stand_ins, every)

    def _near_candidates(
        self,
        holders: list[int],
        matched: list[int],
        local_peer: PeerId,
        local_matched_tokens: int,
        local_load: Load,
        now: float,
        rtt_s: Mapping[PeerId, float],
        default_rtt_s: float,
        inflight: Mapping[PeerId, int] | None,
        exclude: Container[PeerId],
        max_digest_age_s: float,
        heard: Mapping[PeerId, tuple[Load, float]] | None,
        cap: float,
        rtt_version: object,
        own_speed: tuple[int, ...],
        bound: RowBound | None = None,
    ) -> tuple[list[Row], set[int], bool, list[float] | None] | None:
        """``holder_candidates``' bounded form (see there), as rows (``make_candidate``'s
        arguments), with whether every row's speed is ``own_speed`` (or none) and, with a
        ``bound``, the rows' scores; None when no idle plain non-holder comes within
        ``NEAR_SCAN`` (searched for unless the bound says no stand-in can matter). Positions
        here are the peers' ``added_seq``, which grows in ``_states``' order."""
        get_inflight = inflight.get if inflight else None
        get_rtt = rtt_s.get
        oldest = now - max_digest_age_s
        heard_get = heard.get if heard else None
        excluding = bool(exclude)
        order = self._rtt_order
        if self._rtt_order_key != (rtt_version, self._membership_changes):
            order = self._rtt_order = sorted(
                ((get_rtt(p, default_rtt_s), st.added_seq, st) for p, st in self._states.items()),
                key=_rtt_and_seq,
            )
            self._rtt_order_key = (rtt_version, self._membership_changes)
        local: Row = (
            local_peer, True, int(min(local_matched_tokens, cap)), local_load, 0.0, 0.0,
            get_inflight(local_peer, 0) if get_inflight is not None else 0,
        )
        # With a bound: the scores by position, the local one's first; the least round trip
        # of any peer (every peer's is in ``order``), under every remote candidate's.
        scores: dict[int, float] = {}
        rtt_floor = 0.0
        if bound is not None:
            scores[-1] = bound.score(local)
            rtt_floor = order[0][0] if order else 0.0
            holders.sort(key=matched.__getitem__, reverse=True)  # deepest first
        kept: list[tuple[int, Row]] = []
        append = kept.append
        by_slot = self._by_slot
        plain = True
        group_tokens = -1
        group_floor = math.inf
        for slot in holders:
            tokens = matched[slot]
            if not tokens:
                continue  # capped to nothing (a one-token prompt): a plain non-holder below
            if bound is not None:
                if tokens != group_tokens:
                    group_tokens = tokens
                    group_floor = bound.floor(tokens, rtt_floor)
                if group_floor > bound.second:
                    break  # (and so is every holder after it: they match no more)
            state = by_slot[slot]
            peer = state.peer
            fresh_at = state.fresh_at
            load = state.load
            if heard_get is not None:
                news = heard_get(peer)
                if news is not None:
                    load = news[0]
                    if news[1] > fresh_at:
                        fresh_at = news[1]
            if fresh_at < oldest or peer == local_peer or (excluding and peer in exclude):
                continue
            age = now - fresh_at
            speed = load.speed
            if speed and speed != own_speed:
                plain = False
            row: Row = (
                peer, False, tokens, load, get_rtt(peer, default_rtt_s),
                age if age > 0.0 else 0.0, get_inflight(peer, 0) if get_inflight is not None else 0,
            )
            append((state.added_seq, row))
            if bound is not None:
                scores[state.added_seq] = bound.score(row)
        stand_in_seqs: set[int] = set()
        visited = 0
        found = False
        if bound is not None and bound.floor(0, rtt_floor) > bound.second:
            # No plain non-holder can matter: the stand-ins' search is left out, and with it
            # the fallback to every peer when it finds no idle one (which decides the same).
            found = True
            order = []
        for rtt, seq, state in order:
            if matched[state.slot]:
                continue  # a holder: taken above
            peer = state.peer
            fresh_at = state.fresh_at
            load = state.load
            if heard_get is not None:
                news = heard_get(peer)
                if news is not None:
                    load = news[0]
                    if news[1] > fresh_at:
                        fresh_at = news[1]
            if fresh_at < oldest or peer == local_peer or (excluding and peer in exclude):
                continue
            n = load.queued + load.running
            sent = get_inflight(peer, 0) if get_inflight is not None else 0
            if sent > n:
                n = sent
            age = now - fresh_at
            speed = load.speed
            if speed and speed != own_speed:
                plain = False
            row = (peer, False, 0, load, rtt, age if age > 0.0 else 0.0, sent)
            append((seq, row))
            if bound is not None:
                scores[seq] = bound.score(row)
            stand_in_seqs.add(seq)
            if n == 0:
                found = True
                break
            visited += 1
            if visited >= NEAR_SCAN:
                break
        if not found:
            return None
        kept.sort(key=_first)
        out = [local]
        out.extend(row for _, row in kept)
        stand_ins = {i + 1 for i, (seq, _) in enumerate(kept) if seq in stand_in_seqs}
        ttfts = None if bound is None else [scores[-1], *(scores[seq] for seq, _ in kept)]
        return out, stand_ins, plain, ttfts


__all__ = ["MIN_ALLOWANCE", "NEWCOMER_RESERVE", "HolderCandidates", "PeerIndex", "ReplicaFactory", "ReplicaIndex"]
