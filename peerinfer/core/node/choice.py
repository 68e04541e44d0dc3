"""Choice: the bridge from what this node knows of its peers (the peer view, reputation, round
trips) to the routing policy (``peerinfer.core.routing``), and what this node advertises of
itself in its load (see "Route" and "Trust" in ``peerinfer.core.node``).

It decides where a prompt goes; it moves no request (the node does, with the decision).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

from peerinfer.core.kvpull import LinkEstimator
from peerinfer.core.merkle import MerkleDigest
from peerinfer.core.messages import Load, SamplingParams
from peerinfer.core.node.config import NodeConfig
from peerinfer.core.peerview import PeerView
from peerinfer.core.reputation import Reputation
from peerinfer.core.routing import (
    Candidate,
    CostPolicy,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    ScaffoldHints,
    consider_pull,
    make_policy,
)
from peerinfer.types import BlockHash, PeerId

__all__ = ["MAX_PULL_HOLDOFFS", "PULL_HOLDOFF_S", "Choice"]

#: How long this node pulls nothing from a holder after a pull from it gave nothing (refused
#: as busy or untrusted, timed out, the holder gone): the request that pull was for was
#: recomputed, and the next ones should not wait on the same holder again at once.
PULL_HOLDOFF_S = 30.0
#: Holders remembered as held off (the expired, then the oldest, are forgotten beyond).
MAX_PULL_HOLDOFFS = 4096


class Choice:
    """The routing policy and what it reads: this node's announced speed and scaffold hints,
    whether every peer's load is plain, the peer view and the peers' reputation."""

    def __init__(
        self,
        config: NodeConfig,
        view: PeerView,
        reputation: Reputation,
        rng: random.Random,
        *,
        block_size: int,
    ) -> None:
        self.config = config
        self._me = config.peer_id
        self._view = view
        self.reputation = reputation
        self._block_size = block_size
        self.rng = rng
        pull = config.kv_pull
        # With pulls on, the cost policy charges a placement for the extra prefill it puts
        # before later requests (``PullSettings.extra_work_weight``; off with pulls off, so
        # the routing without pulls is the greedy choice it always was).
        options = (
            {"extra_work_weight": pull.extra_work_weight}
            if pull is not None and config.policy == "cost" and pull.extra_work_weight
            else {}
        )
        self.policy: RoutingPolicy = make_policy(config.policy, costs=config.costs, **options)
        #: the scaffolds this node served lately, advertised in its load (only for the
        #: ``scaffold_hash`` policy, whose hints they are), and the live ones as last read
        self._hints = ScaffoldHints() if config.policy == "scaffold_hash" else None
        self._scaffolds: tuple[int, ...] = ()
        #: announced in every load, so that peers estimate this node at its own speed
        self._speed: tuple[int, ...] = config.costs.speed()
        #: announced in every load: the disk tier's share and load time (``Load.disk``)
        self.disk: tuple[int, ...] = ()
        #: ``load()``'s last answer (the speed is fixed for a node's life)
        self._last_load: Load | None = None
        #: no peer has announced another speed than this node's or more than one slot (then
        #: routing finds the best non-holders among the nearest: ``PeerIndex.holder_candidates``)
        self._plain_loads = True
        #: pulls (``config.kv_pull``): each peer link's bandwidth, measured from transfers, and
        #: the probes asked for since the node last took them (``take_probes``)
        self.links: LinkEstimator | None = (
            LinkEstimator.for_settings(pull) if pull is not None else None
        )
        self._probes: list[tuple[PeerId, int]] = []
        #: may this node pull at all: a private swarm's members, or an open swarm by option
        self._pull_allowed = pull is not None and (config.private_swarm or pull.open_swarm)
        #: holders not to pull from until then (``note_pull_failed``; inf: never)
        self._pull_holdoff: dict[PeerId, float] = {}
        #: the KV bytes each holder may still send (``note_pull_limit``: a relayed link's
        #: budget); absent: no such bound
        self._pull_limits: dict[PeerId, int] = {}

    def load(self, queued: int, running: int) -> Load:
        """This node's load as announced, with ``queued`` and ``running`` requests: the last
        one made when nothing in it changed (a ``Load`` is frozen; every route and every
        announcement asks for it, mostly with the same figures; a retuned config may change
        the slots)."""
        last = self._last_load
        slots = self.config.costs.slots
        if (
            last is not None and last.queued == queued and last.running == running
            and last.slots == slots and last.scaffolds is self._scaffolds and last.disk is self.disk
        ):
            return last
        last = self._last_load = Load(
            queued=queued, running=running, slots=slots,
            speed=self._speed, scaffolds=self._scaffolds, disk=self.disk,
        )
        return last

    def refresh_hints(self, now: float) -> None:
        """Forget the scaffold hints that aged out by ``now`` (``load()`` advertises the rest)."""
        if self._hints is not None:
            self._scaffolds = self._hints.current(now)

    def served_scaffold(self, scaffold: int | None, now: float) -> None:
        """A request with ``scaffold`` is served here from now on: advertised as a hint (Mesh
        LLM's, at admission)."""
        if self._hints is not None and scaffold is not None:
            self._hints.served(scaffold, now)
            self.refresh_hints(now)

    def note_load(self, load: Load) -> None:
        """A peer announced ``load``: routing's shortcut for plain loads holds while all are."""
        if load.slots > 1 or load.speed and load.speed != self._speed:
            self._plain_loads = False

    def decide(
        self,
        prompt_tokens: int,
        params: SamplingParams,
        chain: tuple[BlockHash, ...],
        now: float,
        exclude: Sequence[PeerId],
        scaffold: int | None,
        *,
        local_matched_blocks: int,
        queued: int,
        running: int,
        rtt: Mapping[PeerId, float],
        rtt_version: int,
        inflight: Mapping[PeerId, int],
    ) -> RouteDecision:
        """The policy's choice for a prompt of ``prompt_tokens`` hashed into ``chain``, among
        this node (holding ``local_matched_blocks`` of it, with ``queued`` and ``running``
        requests) and every peer not in ``exclude``; ``rtt``, ``rtt_version`` and ``inflight``:
        the members' round trips and forwards in flight."""
        bs = self._block_size
        cfg = self.config
        if self._hints is not None:
            self.refresh_hints(now)  # the local candidate's load: its live hints
        index, heard, newer = self._view.for_routing()
        request = RouteRequest(
            prompt_tokens=prompt_tokens, max_tokens=params.max_tokens, chain=chain, scaffold=scaffold
        )
        options = dict(
            block_size=bs,
            local_peer=self._me,
            local_matched_tokens=local_matched_blocks * bs,
            local_load=self.load(queued, running),
            now=now,
            rtt_s=rtt,
            default_rtt_s=cfg.default_rtt_s,
            inflight=inflight,
            exclude=_Excluded(exclude, self.reputation.blocked(), cfg.trusted_peers, now),
            max_digest_age_s=cfg.max_digest_age_s,
            # Never count the last prompt token as cached: the engine must run it for logits.
            max_matched_tokens=max(0, prompt_tokens - 1),
            heard=heard,
            newer=newer,
        )
        among_holders = getattr(self.policy, "choose_among_holders", None)
        if among_holders is None or not cfg.route_among_holders:
            candidates = self._believed(
                index.candidates(chain, **options), now  # type: ignore[arg-type]
            )
            decision: RouteDecision | None = self.policy.choose(request, candidates, self.rng)
        else:
            # Only the peers holding part of the prompt, and the plain non-holders' stand-ins
            # (PeerIndex.holder_candidates); every candidate only when a stand-in could win.
            # The cost policy without the charge, when no candidate needs believing otherwise
            # and no pull reads the list: the list as rows, of which the policy builds only
            # the candidates it reads (``CostPolicy.choose_rows``, the same decision).
            policy = self.policy
            by_rows = policy if (
                type(policy) is CostPolicy and not policy.extra_work_weight
                and not self._pull_allowed and not self.reputation.demoted()
            ) else None
            # Over rows, the candidates that cannot matter are left out as the index makes
            # them (``CostPolicy.row_bound``; the decision is the same but for ``ranked``,
            # which nothing reads on this path: no pull).
            bound = by_rows.row_bound(request) if by_rows is not None else None
            pruned = index.holder_candidates(
                chain, own_speed=self._speed, plain_loads=self._plain_loads,
                rtt_version=rtt_version, rows=by_rows is not None, bound=bound,
                **options,  # type: ignore[arg-type]
            )
            if by_rows is not None and pruned.rows is not None and pruned.plain:
                decision = by_rows.choose_rows(
                    request, pruned.rows, self.rng, pruned.stand_ins, bound, pruned.ttfts
                )
            elif pruned.ttfts is not None:
                # (not met: a node notes every load, and plain loads make plain rows) Rows
                # were left out of the list: decide over every candidate instead.
                candidates = self._believed(pruned.every(), now)
                decision = self.policy.choose(request, candidates, self.rng)
            else:
                candidates = self._believed(pruned.listed(), now)
                decision = among_holders(request, candidates, self.rng, pruned.stand_ins)
            if decision is None:
                candidates = self._believed(pruned.every(), now)
                decision = self.policy.choose(request, candidates, self.rng)
        assert decision is not None
        if self._pull_allowed:
            # Every holder is among the candidates either way (the pruned list keeps them).
            decision = self._consider_pull(request, candidates, decision, now)
        return decision

    def _consider_pull(
        self, request: RouteRequest, candidates: list[Candidate], decision: RouteDecision,
        now: float,
    ) -> RouteDecision:
        """``decision``, or serving here after a pull when that is faster (issue 24,
        ``peerinfer.core.routing.pull``). The candidates are already the peers routing may
        use (tried, banned, excluded and untrusted peers left out; demoted peers' matches
        zeroed), and this node may pull in its swarm (``_pull_allowed``)."""
        settings = self.config.kv_pull
        links = self.links
        assert settings is not None and links is not None
        policy = self.policy if isinstance(self.policy, CostPolicy) else None

        def probe(peer: PeerId) -> None:
            nbytes = links.probe(peer, now)
            if nbytes is not None:
                self._probes.append((peer, nbytes))

        return consider_pull(
            policy, request, candidates, decision, settings,
            trusted=lambda peer: self.may_pull_from(peer, now) and not self.pull_held_off(peer, now),
            bandwidth=lambda peer: links.bandwidth(peer, now),
            probe=probe,
            limit=self._pull_limits.get,
            block_size=self._block_size,
        )

    def may_pull_from(self, peer: PeerId, now: float) -> bool:
        """Whether this node may pull KV from ``peer`` now: pulls are on and allowed in this
        swarm, ``peer`` is trusted (``trusted_peers``) and reputation does not block it."""
        if not self._pull_allowed:
            return False
        trusted = self.config.trusted_peers
        if trusted is not None and peer not in trusted:
            return False
        until = self.reputation.blocked().get(peer)
        return until is None or not until > now

    def note_pull_failed(self, peer: PeerId, reason: str, now: float) -> None:
        """A pull from ``peer`` gave nothing (``PullFailed``): no pulls from it for
        ``PULL_HOLDOFF_S``, or ever after a "format" refusal. (Not a judgement of the peer:
        it still serves requests, and this node still serves its pulls.)"""
        holdoff = self._pull_holdoff
        holdoff[peer] = math.inf if reason == "format" else now + PULL_HOLDOFF_S
        if len(holdoff) > MAX_PULL_HOLDOFFS:
            for p in [p for p, until in holdoff.items() if until <= now]:
                del holdoff[p]
            while len(holdoff) > MAX_PULL_HOLDOFFS:
                del holdoff[next(iter(holdoff))]

    def note_pull_limit(self, peer: PeerId, nbytes: int | None) -> None:
        """At most ``nbytes`` of KV may come from ``peer`` from now on (None: no bound), as
        the shell says of a relayed link (``PullLimit``). Bounded like the hold-offs: the
        oldest bound goes first (a peer without one is only pulled from in full, and the
        shell still bounds what it asks for)."""
        limits = self._pull_limits
        limits.pop(peer, None)
        if nbytes is None:
            return
        limits[peer] = max(0, nbytes)
        while len(limits) > MAX_PULL_HOLDOFFS:
            del limits[next(iter(limits))]

    def pull_limit(self, peer: PeerId) -> int | None:
        """The KV bytes ``peer`` may still send (``note_pull_limit``), None for no bound."""
        return self._pull_limits.get(peer)

    def pull_held_off(self, peer: PeerId, now: float) -> bool:
        """Whether pulls from ``peer`` are held off after a failed one (``note_pull_failed``)."""
        until = self._pull_holdoff.get(peer)
        return until is not None and until > now

    def note_transfer(
        self, peer: PeerId, nbytes: int, seconds: float, now: float, rtt_s: float = 0.0
    ) -> None:
        """A transfer of ``nbytes`` from ``peer`` took ``seconds``: a bandwidth sample."""
        if self.links is not None:
            self.links.observe(peer, nbytes, seconds, now, rtt_s)

    def take_probes(self) -> list[tuple[PeerId, int]]:
        """The bounded probes (peer, bytes) asked for since the last call."""
        probes, self._probes = self._probes, []
        return probes

    def _believed(self, candidates: list[Candidate], now: float) -> list[Candidate]:
        """``candidates`` as routing believes them: a demoted peer's cache promises count for
        nothing, and a claim to be faster than this node only once proven."""
        demoted = self.reputation.demoted()
        if demoted:
            # A peer whose claims did not hold: its cache promises count for nothing in the
            # choice (it still answers for them if chosen on load: see digest_claim).
            candidates = [
                replace(c, matched_tokens=0) if demoted.get(c.peer, now) > now else c
                for c in candidates
            ]
        own = self._speed
        if any(c.load.speed and c.load.speed != own for c in candidates):
            # A claim to be faster than this node is believed only once proven (reputation.py,
            # "Speed claims"): announcing speed 0 would otherwise win every choice.
            candidates = [self._with_believed_speed(c, now) for c in candidates]
        return candidates

    def believed_speed(self, peer: PeerId, speed: tuple[int, ...], now: float) -> tuple[int, ...] | None:
        """What routing believes of ``peer``'s announced ``speed`` when that differs from the
        claim (None: the claim is believed): until ``peer`` has proven to be faster than this
        node, each figure is at least this node's own (slower claims are always believed)."""
        own = self._speed
        if not speed or speed == own or len(speed) != len(own):
            return None
        believed = tuple(max(a, b) for a, b in zip(speed, own, strict=True))
        if believed == speed or self.reputation.speed_proven(peer, now):
            return None
        return believed

    def _with_believed_speed(self, c: Candidate, now: float) -> Candidate:
        believed = None if c.is_local else self.believed_speed(c.peer, c.load.speed, now)
        if believed is None:
            return c
        # () is "as this node" to the cost policy.
        return replace(c, load=replace(c.load, speed=() if believed == self._speed else believed))

    def digest_claim(
        self,
        peer: PeerId,
        chain: Sequence[BlockHash],
        prompt_tokens: int,
        newest: MerkleDigest | None = None,
    ) -> int:
        """The prompt tokens ``peer``'s own announced digest says it holds: what it is held to
        (not this node's speculative entries, nor routing's discounts). ``newest``: its set
        as the announcements with changes waiting for it leave it (``PeerView.
        waiting_changes_of``), else its replica's."""
        replica = self._view.as_is.replica(peer)  # unchanged announcements leave the digest alone
        if replica is None:
            return 0
        n = (replica.digest if newest is None else newest).leading(chain)
        return min(n * self._block_size, max(0, prompt_tokens - 1))


class _Excluded:
    """The peers a routing decision leaves out: those already tried, those reputation blocks
    (banned, or scored below the candidate threshold) until a later time, and, when the node
    trusts only some peers, every other one. A container, so the index asks ``peer in it``."""

    __slots__ = ("_tried", "_blocked", "_trusted", "_now")

    def __init__(
        self,
        tried: Sequence[PeerId],
        blocked: Mapping[PeerId, float],
        trusted: frozenset[PeerId] | None,
        now: float,
    ) -> None:
        self._tried, self._blocked, self._trusted, self._now = tried, blocked, trusted, now

    def __bool__(self) -> bool:
        return bool(self._tried or self._blocked or self._trusted is not None)

    def __contains__(self, peer: object) -> bool:
        if peer in self._tried:
            return True
        trusted = self._trusted
        if trusted is not None and peer not in trusted:
            return True
        until = self._blocked.get(peer)  # type: ignore[call-overload]
        return until is not None and bool(until > self._now)
