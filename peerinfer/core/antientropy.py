"""Anti-entropy: keeping a replica of a peer's cached set, by deltas and Merkle reconciliation.

Theory of operation
-------------------
Every peer keeps a ``Replica`` of every other peer's set of block hashes (its digest, see
``peerinfer.core.digest`` for the tree, its summaries and why they decode). Two mechanisms keep
it current:

*Deltas.* Each announcement carries the sender's net changes since its previous epoch (when they
fit). A replica that matched that previous epoch applies them and checks the result against the
announced root and count (``apply_announce``). The cost is the size of the change and there is no
round trip: this is the common path, O(peers x changes) per announce interval.

*Pulls.* A replica that missed an epoch, got a truncated delta, or whose peer restarted, pulls:
a ``Reconciliation`` is the requester's state machine for one pull, and the responder is
``LocalDigest.answer``, a pure function of its current state. If the replica matched an epoch,
the first request offers it (``since_epoch``); a responder whose change log reaches back that far
answers with the net delta, and the pull ends in one round trip. Otherwise the requester runs
*passes* of a Merkle descent:

1. *Size the first comparison.* The requester estimates the number of differences ``d``: at least
   the count difference, or the caller's hint (by default the change rate seen in announcements
   times the epochs missed). It compares the root's ``2**span`` descendants, ``span`` chosen so
   that each holds about ``LAMBDA_FIRST`` differences (at least ``2**MIN_ROOT_SPAN``): the levels
   above would all differ anyway, so the descent skips them. An empty replica lists instead.
2. *Compare.* For each descendant the request carries ``SUMMARY_BITS`` bits: a slice of its
   summary and its count modulo 4. The responder marks the descendants that differ and returns
   each one's count, and, when the count difference is odd (so possibly a single difference), its
   hash: all 64 bits if the difference is +1 modulo 4, the low 32 if -1 (those pick the element
   among the requester's own). A descendant that differs by one element is thereby *decoded*
   without a listing: its missing element is the one whose contribution is the XOR of the two
   hashes, or the extra one is the requester's element with that contribution. A descendant the
   responder holds nothing of is cleared; one it holds a single element of is replaced by it.
3. *Descend.* A descendant that does not decode is planned by a cost model (``_plan``): a
   *listing* of the responder's elements there, an *exchange* (the requester sends fingerprints
   of its own elements; the responder sends the elements whose fingerprint is missing and marks
   the fingerprints it does not hold), or a narrower *comparison* sized by the differences it is
   estimated to hold (``LAMBDA_DESCENT`` per descendant, so that few remain impure). The fraction
   of descendants that differed estimates those differences, so a poor first estimate costs
   rounds, not bytes.
4. *Converge.* After every response, if the replica's root and count equal the responder's
   latest, the pull has converged. When a pass has nothing left to ask and they still differ (a
   slice that collided, a false decode, a fingerprint collision, or a responder that changed), a
   new pass starts with other slice and fingerprint keys, up to ``MAX_PASSES`` passes and
   ``max_rounds`` round trips; then the pull fails, and the caller retries later with another
   ``attempt`` (other keys again). A false decode or collision can never end a pull as
   "converged": the root mixes in the independent check sum ``G``.

The replica is repaired in place: a failed pull leaves it closer to the responder's set, and its
``epoch`` only moves when its root has been verified.

*Cost.* Bytes grow with the difference, not with the tree. A response is batched (``SyncNode``):
no bytes per node beyond its content. For ``d`` differences the first round sends about
``d / LAMBDA_FIRST`` summaries of ``SUMMARY_BITS`` bits and receives a bit per descendant plus
a count and 4 or 8 bytes per differing one; an added element is carried once (its hash is the
element), an evicted one costs 4 bytes. Measured on 10,000 elements with 1% changed (50 evicted,
50 new): ~1.7 kB (2.1% of the 80 kB tree) with a good estimate, ~2.1 kB (2.6%) with none;
``bench/antientropy_bench.py``.

*Round trips.* A pass takes one round trip for the decodable differences (about ``e**-0.5``,
60-70% of them), one more for the nodes that held several (their descendants now hold about
``LAMBDA_DESCENT`` each, so nearly all decode), and rarely a third for what collided again. A
missed difference (a summary collision, probability ``2**-(SUMMARY_BITS - 2)`` per impure node)
costs a short extra pass. Measured for the 1% case: 2 to 5 round trips, 3 typical (plus one if a
delta offer is refused first); the hard cap is ``max_rounds``.

*Hostile responders.* Every answer is checked against the request it answers: no more answers
than queries, at least one, every batched field consumed exactly, bitmaps within their span,
counts of marked descendants within their node's, listed elements distinct, under their node and
as many as claimed, no exchanged element whose fingerprint the requester sent, hashes of empty
and one-element nodes consistent with them, deltas only when offered. Answers are capped per node
(``LIST_CAP``) and per response, the queue of pending queries (``MAX_PENDING``) and the round
trips are capped: the requester's memory and work stay bounded whatever the responder claims. A
violation raises ``ProtocolError`` and ends the pull.

State table of ``Reconciliation`` (in code: ``core/pullstate.py``; any other event is a local
error, ``ClosedError``); its ``state`` is "pulling" while ``ready`` or ``awaiting``::

    phase      event                                      next phase  returns
    --------   ----------------------------------------   ----------  -------------------------
    ready      first_request()                            awaiting    SyncRequest
    awaiting   handle_response: root and count match      converged   None
    awaiting   handle_response: queries left              awaiting    SyncRequest
    awaiting   handle_response: pass over, passes left    awaiting    SyncRequest (next pass)
    awaiting   handle_response: no passes/rounds left     failed      None
    awaiting   handle_response: protocol violation        failed      raises ProtocolError
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from peerinfer.core.digest import (
    DELTA_CAP,
    HASH_DENSITY,
    LIST_CAP,
    CacheObserver,
    DeltaMemo,
    MerkleDigest,
    bitmap_indices,
    contribution,
    fingerprint,
    fingerprint_bits,
    fingerprint_count,
    mix,
    pack_fixed,
    packed_length,
    position_of_contribution,
    summary_of,
    under,
    unpack_elements,
    unpack_fixed,
)
from peerinfer.core.messages import SyncNode, SyncQuery, SyncRequest, SyncResponse, encode
from peerinfer.core.pullstate import STATE_OF, PullEvent, PullPhase, accepts, move
from peerinfer.errors import ProtocolError
from peerinfer.types import BlockHash

__all__ = [
    "DEFAULT_MAX_ROUNDS",
    "MAX_REPLICA_ELEMENTS",
    "MAX_PASSES",
    "Reconciliation",
    "Replica",
]

#: Expected differences per compared descendant in the first round of a pass...
LAMBDA_FIRST = 0.5
#: ... and when descending into a node that did not decode (fewer collisions, fewer rounds).
LAMBDA_DESCENT = 0.2
#: ... and when descending from a comparison too dense to carry hashes.
DENSE_LAMBDA = 0.2
#: When every compared descendant differs, assume this many times the least plausible density.
SATURATION_GROWTH = 2.0
#: The narrowest comparison of the root (a pass that knows little about ``d``).
MIN_ROOT_SPAN = 6
#: A set this small may be listed or exchanged whole on a hint alone.
SMALL_SET = 64
#: Passes per pull (each pass uses other slice and fingerprint keys).
MAX_PASSES = 4
DEFAULT_MAX_ROUNDS = 24
#: Requester-side caps: queries per request, summary bytes per request, pending queries.
MAX_QUERIES_PER_REQUEST = 8192
MAX_REQUEST_SUMMARY_BYTES = 2 * 1024 * 1024
MAX_PENDING = 1 << 18
#: The widest split of a node too large to list in one answer.
_MAX_LIST_SPLIT = 8

_MASK = (1 << 64) - 1
_LOW32 = (1 << 32) - 1

# How a pending node is to be asked about.
_COMPARE = 0  # compare the summaries of its 2**span descendants
_EXCHANGE = 1  # send the fingerprints of our elements; get the missing ones and the absent marks
_LIST = 2  # get all its elements and replace ours

_Spec = tuple[int, int, int, int]  # (level, prefix, span, how): built into a query when sent


def _span_for(differences: float, per_child: float, level: int, minimum: int = 1) -> int:
    want = math.ceil(math.log2(max(differences, 1.0) / per_child))
    return max(1, min(max(want, minimum), SyncQuery.MAX_SPAN, 64 - level))


class _Answers:
    """A cursor over the batched answers of one response; every misstep is ProtocolError."""

    __slots__ = ("_a", "_count", "_bitmap", "_hash", "_element")

    def __init__(self, answers: SyncNode) -> None:
        self._a = answers
        self._count = self._bitmap = self._hash = self._element = 0

    def count(self) -> int:
        counts = self._a.counts
        if self._count >= len(counts):
            raise ProtocolError("a sync response has too few counts")
        self._count += 1
        return counts[self._count - 1]

    def bitmap(self, bits: int) -> list[int]:
        """The marked indices of the next bitmap of ``bits`` bits."""
        size = packed_length(bits, 1)
        data = self._a.bitmaps[self._bitmap : self._bitmap + size]
        if len(data) != size:
            raise ProtocolError("a sync response has too few bitmap bytes")
        self._bitmap += size
        marked = bitmap_indices(data)
        if marked and marked[-1] >= bits:
            raise ProtocolError("a bitmap marks a bit past its end")
        return marked

    def hash(self, size: int) -> int:
        data = self._a.hashes[self._hash : self._hash + size]
        if len(data) != size:
            raise ProtocolError("a sync response has too few hash bytes")
        self._hash += size
        return int.from_bytes(data, "big")

    def elements(self, n: int) -> list[int]:
        data = self._a.elements[self._element : self._element + 8 * n]
        if len(data) != 8 * n:
            raise ProtocolError("a sync response has too few element bytes")
        self._element += 8 * n
        return unpack_elements(data)

    def finish(self) -> None:
        a = self._a
        if (self._count, self._bitmap, self._hash, self._element) != (
            len(a.counts),
            len(a.bitmaps),
            len(a.hashes),
            len(a.elements),
        ):
            raise ProtocolError("a sync response carries bytes that answer nothing")


#: The most elements a peer may announce (4M blocks of 16 tokens: far beyond any home machine's
#: KV cache). A replica refuses announcements over it, so its size stays bounded whatever a
#: hostile peer claims: a delta is applied only from a verified epoch and a pull converges to the
#: announced count, so a replica never holds more than the cap plus one announcement's delta.
MAX_REPLICA_ELEMENTS = 1 << 22


class Replica:
    """Our estimate of one peer's set: its digest and the last epoch it is known to match.

    ``epoch`` is 0 until a root has been verified. ``observer`` is told of every change (the
    peer index uses it). Announcements of more than ``max_elements`` elements are refused
    (``refused`` counts them): the replica keeps its state and asks for no pull. A count
    claimed (``claimed``) raises the digest's ``watch``, if it has one (``SizeWatch``), as the
    digest's own growth does: whoever sets ``_announced`` other than through these methods
    (``AnnounceRun.take_run``) must call ``note_claim``.
    """

    __slots__ = ("digest", "epoch", "max_elements", "refused", "_announced", "_rate")

    def __init__(self, observer: CacheObserver | None = None, *,
                 max_elements: int = MAX_REPLICA_ELEMENTS, memo: DeltaMemo | None = None) -> None:
        if max_elements < 0:
            raise ValueError("max_elements must be >= 0")
        # Lazy: the trie exists only while a pull compares subtrees; ``memo``: delta results
        # shared with other replicas of the same sets (a simulator's). See digest.py for both.
        self.digest = MerkleDigest(observer, lazy=True, memo=memo)
        self.epoch = 0
        self.max_elements = max_elements
        self.refused = 0
        self._announced: tuple[int, int, int] | None = None  # newest (epoch, root, count) heard
        self._rate = 0.0  # smoothed changes per epoch seen in announced deltas

    @property
    def root(self) -> int:
        return self.digest.root

    @property
    def count(self) -> int:
        return len(self.digest)

    @property
    def claimed(self) -> int:
        """The count of the newest announcement taken in (0: none)."""
        announced = self._announced
        return 0 if announced is None else announced[2]

    def note_claim(self) -> None:
        """Raise the digest's ``watch`` to the count claimed (see ``SizeWatch``)."""
        watch = self.digest.watch
        announced = self._announced
        if watch is not None and announced is not None and announced[2] > watch.high:
            watch.high = announced[2]

    def matches(self, root: int, count: int) -> bool:
        return self.digest.root == root and len(self.digest) == count

    def apply_announce(
        self,
        prev_epoch: int,
        epoch: int,
        root: int,
        count: int,
        added: Iterable[int],
        removed: Iterable[int],
        truncated: bool,
    ) -> bool:
        """Take in an announcement; True if a pull is needed (the root still differs).

        A stale epoch (``<= self.epoch``) is ignored (False), and so is a claim of more than
        ``max_elements`` elements (counted in ``refused``). The delta is applied when the
        replica matched ``prev_epoch``; the replica then moves to ``epoch`` only if its root and
        count equal the announced ones.
        """
        if epoch <= self.epoch:
            return False
        if count > self.max_elements:
            self.refused += 1
            return False
        if type(added) is not tuple:
            added = tuple(added)
        if type(removed) is not tuple:
            removed = tuple(removed)
        # The change rate (for sizing pulls) skips the first announcement heard, which may be
        # the peer's whole warm-up rather than a typical epoch.
        if self._announced is not None and not truncated and epoch > prev_epoch:
            per_epoch = (len(added) + len(removed)) / (epoch - prev_epoch)
            self._rate = per_epoch if self._rate == 0.0 else 0.7 * self._rate + 0.3 * per_epoch
        digest = self.digest
        if self._announced is None or epoch >= self._announced[0]:
            self._announced = (epoch, root, count)
            self.note_claim()
        if not truncated and prev_epoch == self.epoch and (added or removed):
            digest.apply_delta(added, removed)
        if self.matches(root, count):
            self.epoch = epoch
            # Verified current: no pull needs the trie until the replica falls behind again.
            digest.flatten()
            return False
        return True

    def take_unchanged(self, times: int, epoch: int, root: int, count: int) -> None:
        """Exactly what ``apply_announce`` does for ``times`` announcements in a row, the last at
        ``epoch``, each chaining from this replica's epoch with no change and announcing this
        replica's own ``root`` and ``count`` (the caller checked: a node keeps such
        announcements and takes them in when the peer's state is next read,
        ``PeerView._defer_unchanged``)."""
        rate = self._rate
        per_epoch = 0.0  # no change in any of them
        for _ in range(times if self._announced is not None else times - 1):
            rate = per_epoch if rate == 0.0 else 0.7 * rate + 0.3 * per_epoch
        self._rate = rate
        # Their epochs ascend, so the last one is the newest heard if any of them is.
        if self._announced is None or epoch >= self._announced[0]:
            self._announced = (epoch, root, count)
            self.note_claim()
        self.epoch = epoch

    def start_pull(
        self,
        session: int,
        target_epoch: int,
        target_root: int,
        attempt: int = 0,
        *,
        target_count: int | None = None,
        estimated_difference: int | None = None,
        max_rounds: int = DEFAULT_MAX_ROUNDS,
    ) -> Reconciliation:
        """A reconciliation of this replica towards the peer's announced ``target_root``.

        ``target_count`` defaults to the count announced with that root; ``estimated_difference``
        to the changes per epoch seen in announcements times the epochs missed (a hint that
        sizes the first comparison; a wrong one costs bytes or rounds, never correctness).
        ``attempt`` picks the slice keys, so a retry does not repeat a collision.
        """
        if target_count is None and self._announced is not None:
            if self._announced[1] == target_root:
                target_count = self._announced[2]
        if estimated_difference is None and self.epoch > 0 and target_epoch > self.epoch:
            if self._rate > 0.0:
                estimated_difference = math.ceil(self._rate * (target_epoch - self.epoch))
        return Reconciliation(
            self,
            session,
            target_epoch,
            target_root,
            target_count,
            attempt=attempt,
            estimated_difference=estimated_difference,
            max_rounds=max_rounds,
        )


class Reconciliation:
    """The requester's state machine for one pull (see the module docstring's state table).

    ``phase``: its row of the state table; ``state``: "pulling", "converged" or "failed".
    ``rounds`` counts responses handled,
    ``passes`` Merkle passes begun, ``bytes_sent``/``bytes_received`` the encoded sizes of the
    requests and responses.
    """

    def __init__(
        self,
        replica: Replica,
        session: int,
        target_epoch: int,
        target_root: int,
        target_count: int | None,
        *,
        attempt: int = 0,
        estimated_difference: int | None = None,
        max_rounds: int = DEFAULT_MAX_ROUNDS,
    ) -> None:
        if max_rounds < 1:
            raise ValueError("max_rounds must be >= 1")
        self.replica = replica
        self.session = session
        self.phase = PullPhase.READY
        self.rounds = 0
        self.passes = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.max_rounds = max_rounds
        # The responder's state as last heard (from the announcement, then from each response).
        self.epoch = target_epoch
        self.root = target_root
        self.count = target_count
        self._attempt = attempt
        self._estimate = estimated_difference
        self._slice = 0
        self._pending: deque[_Spec] = deque()
        self._sent: SyncRequest | None = None

    @property
    def state(self) -> str:
        return STATE_OF[self.phase]

    # ------------------------------------------------------------------ events

    def first_request(self) -> SyncRequest:
        """The opening request: a delta offer if the replica matched an epoch, else pass 1."""
        self.phase = move(accepts(self.phase, PullEvent.FIRST_REQUEST), PullPhase.AWAITING)
        if self.replica.epoch > 0:
            self._slice = self._slice_index(0)
            return self._send(since_epoch=self.replica.epoch)
        self._begin_pass()
        return self._send()

    def handle_response(self, response: SyncResponse) -> SyncRequest | None:
        """Take in the answer to the last request; the next request, or None when finished."""
        allowed = accepts(self.phase, PullEvent.RESPONSE)
        sent = self._sent
        assert sent is not None  # awaiting: a request is out
        if response.session != self.session:
            self.phase = move(allowed, PullPhase.FAILED)
            raise ProtocolError(
                f"sync response for session {response.session}, expected {self.session}"
            )
        self._sent = None
        self.rounds += 1
        self.bytes_received += len(encode(response))
        self.epoch, self.root, self.count = response.epoch, response.root, response.count
        try:
            if response.delta:
                self._take_delta(sent, response)
            else:
                self._take_answers(sent, response)
            phase, request = self._advance()
        except ProtocolError:
            self.phase = move(allowed, PullPhase.FAILED)
            raise
        self.phase = move(allowed, phase)
        return request

    # ------------------------------------------------------------------ passes and requests

    def _slice_index(self, pass_number: int) -> int:
        return (self._attempt * (MAX_PASSES + 1) + pass_number) & 0xFF

    def _advance(self) -> tuple[PullPhase, SyncRequest | None]:
        replica = self.replica
        if self.count is not None and replica.matches(self.root, self.count):
            replica.epoch = self.epoch
            return PullPhase.CONVERGED, None
        if not self._pending:
            if self.passes >= MAX_PASSES:
                return PullPhase.FAILED, None
            self._begin_pass()
        if self.rounds >= self.max_rounds:
            return PullPhase.FAILED, None
        return PullPhase.AWAITING, self._send()

    def _begin_pass(self) -> None:
        self.passes += 1
        self._slice = self._slice_index(self.passes)
        digest = self.replica.digest
        own = len(digest)
        target = self.count
        if target is not None and own == target and digest.root == self.root:
            return  # nothing to ask: the (empty) request confirms the responder's state
        if target == 0:
            for p in digest.positions_under(0, 0):
                digest.discard_position(p)
            return
        estimate = abs(target - own) if target is not None else 1
        if self.passes == 1 and self._estimate is not None:
            estimate = max(estimate, min(self._estimate, own + (target or 0)))
        if own and target is not None and target > SMALL_SET and estimate > abs(target - own):
            # The estimate is only a hint: a wrong one must not buy a listing of the whole set
            # (a comparison that is too wide costs a small multiple; a listing, N / d times).
            span = _span_for(estimate, LAMBDA_FIRST, 0, MIN_ROOT_SPAN)
            self._queue((0, 0, span, _COMPARE))
            return
        self._plan(0, 0, own, target, max(estimate, 1), LAMBDA_FIRST, MIN_ROOT_SPAN)

    def _send(self, since_epoch: int = 0) -> SyncRequest:
        digest = self.replica.digest
        j = self._slice
        queries: list[SyncQuery] = []
        summary_bytes = 0
        pending = self._pending
        while pending and len(queries) < MAX_QUERIES_PER_REQUEST:
            level, prefix, span, how = pending[0]
            if how == _COMPARE:
                pairs, counts = digest.children(level, prefix, span)
                empty = summary_of(0, 0, j)
                summaries = pack_fixed(
                    (
                        summary_of(pair, c, j) if c else empty
                        for pair, c in zip(pairs, counts, strict=True)
                    ),
                    SyncQuery.SUMMARY_BITS,
                )
            elif how == _EXCHANGE:
                own = digest.positions_under(level, prefix)
                bits = fingerprint_bits(len(own))
                summaries = pack_fixed((fingerprint(p, j, bits) for p in own), bits)
            else:
                summaries = b""
            if queries and summary_bytes + len(summaries) > MAX_REQUEST_SUMMARY_BYTES:
                break
            summary_bytes += len(summaries)
            pending.popleft()
            queries.append(SyncQuery(level, prefix, span, summaries))
        request = SyncRequest(self.session, since_epoch, j, tuple(queries))
        self._sent = request
        self.bytes_sent += len(encode(request))
        return request

    def _queue(self, spec: _Spec) -> None:
        if len(self._pending) >= MAX_PENDING:
            raise ProtocolError("the responder's answers would need too many queries")
        self._pending.append(spec)

    def _queue_listing(self, level: int, prefix: int, count: int | None) -> None:
        """List a node, split into enough listings that each fits ``LIST_CAP`` comfortably."""
        split = 0
        if count is not None and count > LIST_CAP // 2:
            split = math.ceil(math.log2(count / (LIST_CAP // 2)))
            split = min(split, _MAX_LIST_SPLIT, 64 - level)
        for i in range(1 << split):
            self._queue((level + split, prefix << split | i, 0, _LIST))

    def _plan(
        self,
        level: int,
        prefix: int,
        own_count: int,
        their_count: int | None,
        estimate: float,
        per_child: float | None = None,
        min_span: int = 1,
    ) -> None:
        """Queue the cheapest way to resolve a node thought to hold ``estimate`` differences.

        Estimated bytes, leaving out the 8 bytes of each element to add (the same for all
        three): a listing ``8 * their_count`` minus those; an exchange ``own_count``
        fingerprints and a bit each; a comparison one summary and one bit per descendant, a
        count and a (partial) hash per difference, and another round for the few that collide.
        """
        if per_child is None:
            per_child = LAMBDA_DESCENT
        if their_count is None or their_count > LIST_CAP:
            if own_count == 0:
                self._queue_listing(level, prefix, their_count)
                return
            if level < 64:
                span = _span_for(estimate, per_child, level, min_span)
                self._queue((level, prefix, span, _COMPARE))
                return
        their = their_count if their_count is not None else 1
        to_add = min(max((estimate + their - own_count) / 2.0, 0.0), float(their))
        listing = 8.0 * (their - to_add)
        exchange = own_count * (fingerprint_bits(own_count) / 8.0 + 0.125)
        if level < 64:
            span = _span_for(estimate, per_child, level, min_span)
            compare = (1 << span) * (SyncQuery.SUMMARY_BITS + 1) / 8.0 + 4.0 * estimate
        else:
            span, compare = 0, math.inf
        best = min(listing, exchange, compare)
        if listing == best or own_count == 0:
            self._queue((level, prefix, 0, _LIST))
        elif exchange == best:
            self._queue((level, prefix, 0, _EXCHANGE))
        else:
            self._queue((level, prefix, span, _COMPARE))

    # ------------------------------------------------------------------ answers

    def _take_delta(self, sent: SyncRequest, response: SyncResponse) -> None:
        if sent.since_epoch == 0:
            raise ProtocolError("a delta answered a request that offered none")
        if response.answers != SyncNode():
            raise ProtocolError("a delta response also carries answers")
        for packed in (response.added, response.removed):
            if len(packed) % 8:
                raise ProtocolError("a packed delta is not a whole number of 8-byte hashes")
        if (len(response.added) + len(response.removed)) // 8 > DELTA_CAP:
            raise ProtocolError("a delta response exceeds the delta cap")
        digest = self.replica.digest
        for h in unpack_elements(response.removed):
            digest.discard(BlockHash(h))
        for h in unpack_elements(response.added):
            digest.add(BlockHash(h))

    def _take_answers(self, sent: SyncRequest, response: SyncResponse) -> None:
        if response.added or response.removed:
            raise ProtocolError("a sync response that is not a delta carries delta elements")
        answers = response.answers
        queries = sent.queries
        if answers.answered > len(queries):
            raise ProtocolError(f"{answers.answered} answers to {len(queries)} queries")
        if queries and not answers.answered:
            raise ProtocolError("a sync response answered none of the queries")
        cursor = _Answers(answers)
        for q in queries[: answers.answered]:
            if q.span:
                self._take_comparison(q, sent.slice, cursor)
            else:
                self._take_exchange(q, sent.slice, cursor)
        cursor.finish()
        # Queries left unanswered (the responder's budget) go first in the next request.
        for q in reversed(queries[answers.answered :]):
            how = _COMPARE if q.span else _EXCHANGE if q.summaries else _LIST
            self._pending.appendleft((q.level, q.prefix, q.span, how))

    def _take_exchange(self, q: SyncQuery, slice_index: int, cursor: _Answers) -> None:
        n_sent = fingerprint_count(len(q.summaries))
        assert n_sent is not None  # we packed them
        count = cursor.count()
        n_elements = cursor.count()
        marked = cursor.bitmap(n_sent)
        if n_elements > LIST_CAP:
            raise ProtocolError(f"an exchange answer claims {n_elements} elements")
        elements = cursor.elements(n_elements)
        digest = self.replica.digest
        if count > LIST_CAP:
            if n_elements or marked:
                raise ProtocolError("an exchange refused as too large carries elements")
            own_count = digest.node_summary(q.level, q.prefix)[1]
            self._plan(q.level, q.prefix, own_count, count, max(2.0, abs(count - own_count)))
            return
        theirs = {mix(h) for h in elements}
        if len(theirs) != n_elements or n_elements > count:
            raise ProtocolError("an exchange answer repeats an element or sends too many")
        for p in theirs:
            if not under(p, q.level, q.prefix):
                raise ProtocolError(f"an element sent is not under node ({q.level}, {q.prefix:#x})")
        own = digest.positions_under(q.level, q.prefix)
        if not n_sent:  # a listing: the node holds exactly these
            if n_elements != count:
                raise ProtocolError(f"a listing of {count} elements sends {n_elements}")
            for p in set(own) - theirs:
                digest.discard_position(p)
        else:
            bits = fingerprint_bits(n_sent)
            sent = unpack_fixed(q.summaries, bits, n_sent)
            held = set(sent)
            if any(fingerprint(p, slice_index, bits) in held for p in theirs):
                raise ProtocolError("an exchange sends an element whose fingerprint we sent")
            absent = {sent[i] for i in marked}
            for p in own:
                if fingerprint(p, slice_index, bits) in absent:
                    digest.discard_position(p)
        for p in theirs:
            digest.add_position(p)

    def _take_comparison(self, q: SyncQuery, slice_index: int, cursor: _Answers) -> None:
        n = 1 << q.span
        node_count = cursor.count()
        marked = cursor.bitmap(n)
        their_counts = [cursor.count() for _ in marked]
        if sum(their_counts) > node_count:
            raise ProtocolError("the counts of differing descendants exceed their node's")
        k = len(marked)
        if not k:
            return
        sent = unpack_fixed(q.summaries, SyncQuery.SUMMARY_BITS, n)
        with_hashes = k <= n * HASH_DENSITY
        own_pairs, own_counts = self.replica.digest.children(q.level, q.prefix, q.span)
        # The fraction of descendants that differ estimates the differences in each one.
        if k < n:
            lam = -math.log1p(-k / n)
        else:
            lam = SATURATION_GROWTH * (math.log(n) + 1.0)  # all differ: d >~ n ln n
        prior = lam / -math.expm1(-lam)
        # Without hashes nothing was decoded and the estimate is still a first look.
        per_child = LAMBDA_DESCENT if with_hashes else DENSE_LAMBDA
        level = q.level + q.span
        for i, their_count in zip(marked, their_counts, strict=True):
            size = 0
            if with_hashes:
                step = (their_count - sent[i]) & 3  # the responder's rule, from what we sent
                size = 8 if step == 1 else 4 if step == 3 else 0
            their_hash = cursor.hash(size) if size else 0
            self._resolve(
                level,
                q.prefix << q.span | i,
                own_pairs[i] & _MASK,
                own_counts[i],
                their_count,
                their_hash,
                size,
                prior,
                per_child,
            )

    def _resolve(
        self,
        level: int,
        prefix: int,
        own_hash: int,
        own_count: int,
        their_count: int,
        their_hash: int,
        hash_size: int,
        prior: float,
        per_child: float,
    ) -> None:
        """Repair one differing node from its count and (partial) hash, or plan a query."""
        digest = self.replica.digest
        step = their_count - own_count
        if their_count == 0:
            if their_hash:
                raise ProtocolError("an empty node with a non-zero hash")
            for p in digest.positions_under(level, prefix):
                digest.discard_position(p)
            return
        if hash_size == 8:
            if their_count == 1:
                # The node holds exactly one element, whose contribution is the node's hash.
                only = position_of_contribution(their_hash)
                if not under(only, level, prefix):
                    raise ProtocolError("the hash of a one-element node is not under the node")
                for p in digest.positions_under(level, prefix):
                    if p != only:
                        digest.discard_position(p)
                digest.add_position(only)
                return
            # One more element there: the XOR of the two hashes is its contribution.
            p = position_of_contribution(own_hash ^ their_hash)
            if step == 1 and under(p, level, prefix) and not digest.contains_position(p):
                digest.add_position(p)
                return
        elif hash_size == 4 and step == -1:
            # One element fewer: the low 32 bits of its contribution pick it among ours.
            low = (own_hash ^ their_hash) & _LOW32
            picks = [
                p
                for p in digest.positions_under(level, prefix)
                if contribution(p) & _LOW32 == low
            ]
            if len(picks) == 1:
                digest.discard_position(picks[0])
                return
        if step % 2 == 0:
            estimate = max(2.0, abs(step), prior)  # it differs with an even count: >= 2
        else:
            estimate = max(3.0 if hash_size else 1.0, abs(step), prior)
        self._plan(level, prefix, own_count, their_count, estimate, per_child)
