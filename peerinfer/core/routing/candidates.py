"""What every routing policy reads and returns: ``Candidate``, ``RouteRequest``,
``RouteDecision``, the ``RoutingPolicy`` protocol, and the small helpers the policies share
(load ratio, reason texts, the failover order). The policies themselves are in the sibling
modules; the algorithm is described in :mod:`peerinfer.core.routing`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from peerinfer.core.messages import Load
from peerinfer.core.quickinit import quick_init
from peerinfer.types import BlockHash, PeerId


@dataclass(frozen=True, slots=True)
class Candidate:
    """One node that could serve the request, with what we know about it.

    ``matched_tokens``: estimated prompt tokens it holds in cache (exact for the local node).
    ``rtt_s``: network round trip to it (ignored for the local node). ``digest_age_s``: seconds
    since its digest was confirmed current (0 for the local node, inf if never).
    ``inflight``: requests we routed there that have not finished.
    """

    peer: PeerId
    is_local: bool
    matched_tokens: int
    load: Load
    rtt_s: float
    digest_age_s: float
    inflight: int = 0


#: A candidate as ``make_candidate``'s arguments: (peer, is_local, matched_tokens, load, rtt_s,
#: digest_age_s, inflight); a policy that reads few of a route's candidates builds only those
#: (``CostPolicy.choose_rows``).
Row = tuple[PeerId, bool, int, Load, float, float, int]

def make_candidate(
    peer: PeerId,
    is_local: bool,
    matched_tokens: int,
    load: Load,
    rtt_s: float,
    digest_age_s: float,
    inflight: int = 0,
) -> Candidate:
    """``Candidate(...)``, as a route's rows (``Row``) give its fields: positionally.

    (It once set the slots through their descriptors, twice as fast as the frozen dataclass's
    ``__init__`` in CPython; compiled (peerinfer/native.py), the constructor is native and
    faster still, and mypyc's classes have no such descriptors.)
    """
    return Candidate(peer, is_local, matched_tokens, load, rtt_s, digest_age_s, inflight)


@quick_init
@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the policy knows of the request: its size and its block-hash chain."""

    prompt_tokens: int
    max_tokens: int
    chain: tuple[BlockHash, ...] = ()
    #: the salted hash of the prompt's scaffold (``PrefixHasher.scaffold_hash``), None if it
    #: has none; only ``scaffold_hash`` reads it
    scaffold: int | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The chosen node, why, and the failover order (``ranked[0] == target``)."""

    target: PeerId
    is_local: bool
    expected_cached_tokens: int
    reason: str
    estimated_ttft_s: float | None = None
    ranked: tuple[PeerId, ...] = ()
    #: For a remote target: the most requests it may have queued or running when the request
    #: arrives for the decision to still hold (None: no limit). The target refuses it as busy
    #: beyond that, and the origin routes again without it (see ``CostPolicy``, "Herding").
    max_outstanding: int | None = None
    #: Pull first (issue 24; only with ``NodeConfig.kv_pull``): serve here after pulling the KV
    #: of ``pull_tokens`` prompt tokens (``pull_bytes``) beyond this node's own match from
    #: ``pull_from`` (``peerinfer.core.routing.pull``). None: no pull, every decision before.
    pull_from: PeerId | None = None
    pull_tokens: int = 0
    pull_bytes: int = 0


class RoutingPolicy(Protocol):
    name: str

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision: ...


# ------------------------------------------------------------------------------- helpers


def describe_peer(peer: PeerId) -> str:
    """A short form of a peer id for reasons and logs (libp2p ids share a long prefix)."""
    return f"peer {peer}" if len(peer) <= 16 else f"peer ..{peer[-8:]}"


def _who(c: Candidate) -> str:
    return "local" if c.is_local else describe_peer(c.peer)


def _outstanding(c: Candidate) -> int:
    load = c.load
    return max(load.queued + load.running, c.inflight)


def _load_ratio(c: Candidate) -> float:
    return _outstanding(c) / max(1, c.load.slots)


def _load_text(c: Candidate) -> str:
    load = c.load
    extra = f", {c.inflight} sent by us" if c.inflight else ""
    return f"{load.queued} queued + {load.running} running on {load.slots} slot(s){extra}"


def _age_text(age_s: float) -> str:
    return "digest never confirmed" if math.isinf(age_s) else f"digest {age_s:.1f} s old"


def _local_index(candidates: Sequence[Candidate]) -> int:
    """The position of the one local candidate; ValueError if there is not exactly one."""
    found = -1
    for i, c in enumerate(candidates):
        if c.is_local:
            if found >= 0:
                raise ValueError("routing: more than one local candidate")
            found = i
    if found < 0:
        raise ValueError("routing: the local node must be among the candidates")
    return found


def _ranked(target: Candidate, ordered: Sequence[Candidate]) -> tuple[PeerId, ...]:
    return (target.peer, *(c.peer for c in ordered if c is not target))
