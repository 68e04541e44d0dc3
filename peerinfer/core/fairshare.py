"""Fair shares of one node's engine between its requesters: who runs, who waits, who yields.

Pure bookkeeping for ``NodeCore`` (peerinfer.core.node), kept apart so that it can be read,
tested and moved on its own. The core owns the requests and their phases; this module only
decides between *requesters*, from the counts each ``Share`` keeps.

Theory of operation
-------------------
A *requester* is whoever asked: the origin peer of a forwarded request, the client's peer id
for a direct libp2p client, the API key for an HTTP client (its address only when the API has
no keys), or this node itself for in-process callers. Each requester with requests here has a
``Share``: its waiting requests (new ones, and preempted ones that resume first), its running
ones, and a service counter.

* **Entitlement.** The engine has ``slots`` running places. Every requester with requests
  here (running or waiting) is *entitled* to ``slots * weight / total weight`` of them; this
  node's own front ends (``local``: HTTP clients on this machine, in-process callers) weigh
  ``LOCAL_WEIGHT``, every other requester 1. Nobody is held to its entitlement while nobody
  else waits: slots are never left idle (work-conserving).
* **Turns.** When a slot frees, it goes to a waiting requester below its entitlement if there
  is one (this node's own front ends first among those: they "may come first"), else to any
  waiting requester; among equals, the one with the least service per weight (the
  virtual-token-counter rule of Sheng et al., "Fairness in Serving Large Language Models",
  OSDI 2024: service is the tokens a requester's requests generated here), then the one
  running the fewest per weight, then the one served least recently. A newcomer's counter starts at the least counter among the
  requesters already here, so it neither starves them nor is starved by its empty past.
* **Yields.** While a requester below its entitlement waits and no slot is (or is about to
  be) free for it, the requester furthest above its entitlement gives one back: the core
  asks the engine to preempt that requester's longest-running generation once it has made
  ``preempt_after_tokens`` tokens since it (re)started. The generation yields its slot and
  waits to resume; it is never dropped. Local front ends are not exempt: they may come first,
  but they cannot keep every slot while someone else waits.

What the engine's slot count is worth to each requester is thus its entitlement, enforced
within one quantum of tokens; what a flood of requests from one requester buys it is a longer
queue of its own (bounded: ``max_queued_per_peer``), not more of the engine.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from peerinfer.types import RequestId

#: How much more of the engine this node's own front ends are entitled to than any other
#: requester (they "may come first", but not take every slot while others wait).
LOCAL_WEIGHT = 2.0

#: A requester's share of the local engine: (from this node's own front ends, requester).
ShareKey = tuple[bool, str]


@dataclass(slots=True)
class Share:
    """One requester's part of the local engine."""

    #: its new requests waiting for a slot, oldest first
    queue: deque[RequestId] = field(default_factory=deque)
    #: its preempted requests waiting to resume, oldest first (they go before ``queue``)
    paused: deque[RequestId] = field(default_factory=deque)
    #: its requests queued, running or preempted here (the share is forgotten at 0)
    outstanding: int = 0
    running: int = 0
    #: running requests asked to yield their slot that have not yet
    yielding: int = 0
    #: the local start count when it last got a slot (0: none since it arrived)
    last_start: int = 0
    #: tokens its requests generated here (the service counter that orders turns)
    served: float = 0.0

    @property
    def waiting(self) -> int:
        return len(self.queue) + len(self.paused)


def weight(key: ShareKey) -> float:
    return LOCAL_WEIGHT if key[0] else 1.0


def entitlements(shares: Mapping[ShareKey, Share], slots: int) -> dict[ShareKey, float]:
    """Every requester's entitled number of running slots (they sum to ``slots``)."""
    total = sum(weight(k) for k in shares)
    return {k: slots * weight(k) / total for k in shares} if total else {}


def newcomer_service(shares: Iterable[Share]) -> float:
    """Where a new requester's service counter starts: the least one among those here."""
    return min((s.served for s in shares), default=0.0)


def next_turn(shares: Mapping[ShareKey, Share], slots: int) -> ShareKey:
    """Whose waiting request takes a free slot (see "Turns")."""
    entitled = entitlements(shares, slots)
    best: ShareKey | None = None
    best_rank: tuple[bool, bool, float, float, int] | None = None
    for key, share in shares.items():
        if not share.waiting:
            continue
        w = weight(key)
        rank = (share.running >= entitled[key], not key[0], share.served / w, share.running / w,
                share.last_start)
        if best_rank is None or rank < best_rank:
            best, best_rank = key, rank
    assert best is not None, "a slot was offered but nobody waits"
    return best


def yields_needed(shares: Mapping[ShareKey, Share], slots: int, running: int) -> list[ShareKey]:
    """The requesters that must each give one running slot back now, in order (see "Yields").

    A waiting requester below its entitlement wants as many slots as it lacks (at most as
    many as it has waiting); slots already free or already yielding cover that first; each
    further slot is taken from the requester then furthest above its entitlement, among
    those with a running request not yet asked to yield.
    """
    entitled = entitlements(shares, slots)
    wanted = 0
    for key, share in shares.items():
        if share.waiting:
            lack = math.ceil(entitled[key] - share.running - 1e-9)
            wanted += max(0, min(share.waiting, lack))
    coming = slots - running + sum(s.yielding for s in shares.values())
    need = wanted - coming
    if need <= 0:
        return []
    # What each running requester keeps once its pending yields are done.
    keeps = {k: s.running - s.yielding for k, s in shares.items() if s.running > s.yielding}
    out: list[ShareKey] = []
    while need > 0 and keeps:
        key = max(keeps, key=lambda k: (keeps[k] - entitled[k], -shares[k].last_start))
        if keeps[key] - entitled[key] <= 1e-9:
            break  # nobody is above its entitlement: the waiting requester waits its turn
        out.append(key)
        keeps[key] -= 1
        if not keeps[key]:
            del keeps[key]
        need -= 1
    return out


__all__ = [
    "LOCAL_WEIGHT",
    "Share",
    "ShareKey",
    "entitlements",
    "newcomer_service",
    "next_turn",
    "weight",
    "yields_needed",
]
