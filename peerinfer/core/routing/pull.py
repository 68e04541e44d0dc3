"""The pull decision: after the routing policy chose between serving here and forwarding, would
pulling a holder's KV and serving here be faster still? (issue 24; settings, bandwidth and
verification are ``peerinfer.core.kvpull``'s.)

The estimate, for a trusted remote holder ``h`` matching ``m`` prompt tokens of which this node
holds ``l`` (the ``cost`` policy's figures, ``CostPolicy.estimate``)::

    transfer(h) = rtt(h) + B / bandwidth(h)  [+ B / disk_read_rate when h serves from disk]
        where B = (m - l) * kv_bytes_per_token
    pull(h)     = p * (transfer(h) + TTFT(local, as if it held m))
                + (1 - p) * (rtt(h) + TTFT(local))

``p`` is the cost policy's confidence in ``h``'s digest (its age, halving per half-life): with
``1 - p`` the holder has evicted the blocks, the pull brings nothing back after a round trip,
and the prompt is recomputed. ``TTFT(local, as if it held m)`` is the local estimate with ``m``
tokens cached: the local queue, then the prefill of the rest. The transfer and the queue are
added, not overlapped: the node pulls when the request's turn comes (pulled blocks take no
room here while it waits, and what comes is what the holder holds then), holding its slot
until the last byte is in (the simulator executes it so). That also makes the requests queued
behind it wait for the transfer, which this estimate does not count.

The pull is chosen when its best estimate beats the policy's own choice (the local estimate when
the policy serves here, the target's when it forwards) by ``max(min_gain_s, min_gain_fraction *
that)``. Only holders that gain ``min_pull_tokens`` over the local match, that are trusted for
pulls, and whose link has a bandwidth figure are considered; the others are asked to be probed.
A holder with a byte bound (a relayed link's budget, ``limit``) is estimated for the whole
blocks that fit it (the rest recomputed here), and left out when what fits gains too little.

So the pull estimate falls as the bandwidth grows, and the choice to pull is monotonic in every
link's bandwidth; with pulls off (``NodeConfig.kv_pull`` None) this module is never called.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from peerinfer.core.kvpull import PullSettings
from peerinfer.core.routing.candidates import (
    Candidate,
    RouteDecision,
    RouteRequest,
    describe_peer,
)
from peerinfer.core.routing.cost import CostPolicy
from peerinfer.types import PeerId

__all__ = ["PullOption", "consider_pull", "pull_option", "transfer_s"]


@dataclass(frozen=True, slots=True)
class PullOption:
    """Pulling ``tokens`` (``nbytes``) from ``peer``: its transfer and first-token estimates."""

    peer: PeerId
    tokens: int
    nbytes: int
    transfer_s: float
    ttft_s: float


def transfer_s(nbytes: int, rtt_s: float, bandwidth: float, settings: PullSettings) -> float:
    """The time to bring ``nbytes`` of KV over a link of ``bandwidth`` bytes/s: the round trip,
    the bytes at the link's rate, and the holder's disk read when it serves from disk."""
    t = rtt_s + nbytes / bandwidth
    if settings.peer_blocks_on_disk:
        t += nbytes / settings.peer_disk_read_bytes_per_s
    return t


def pull_option(
    policy: CostPolicy,
    request: RouteRequest,
    local: Candidate,
    holder: Candidate,
    bandwidth: float,
    settings: PullSettings,
    local_ttft_s: float | None = None,
) -> PullOption | None:
    """The estimate of pulling ``holder``'s match into ``local`` (None: it gains too little)."""
    prompt = request.prompt_tokens
    matched = min(holder.matched_tokens, max(0, prompt - 1))
    gain = matched - local.matched_tokens
    if gain < settings.min_pull_tokens or not bandwidth > 0.0:
        return None
    nbytes = gain * settings.kv_bytes_per_token
    move = transfer_s(nbytes, holder.rtt_s, bandwidth, settings)
    if local_ttft_s is None:
        local_ttft_s = policy.estimate(request, local)[0]
    hit = policy.estimate(request, replace(local, matched_tokens=matched))[0]
    p = policy.confidence(holder)
    ttft = p * (move + hit) + (1.0 - p) * (holder.rtt_s + local_ttft_s)
    return PullOption(holder.peer, gain, nbytes, move, ttft)


def consider_pull(
    policy: CostPolicy | None,
    request: RouteRequest,
    candidates: Sequence[Candidate],
    decision: RouteDecision,
    settings: PullSettings,
    *,
    trusted: Callable[[PeerId], bool],
    bandwidth: Callable[[PeerId], float | None],
    probe: Callable[[PeerId], None] | None = None,
    limit: Callable[[PeerId], int | None] = lambda peer: None,
    block_size: int = 1,
) -> RouteDecision:
    """``decision``, or a local decision with a pull when pulling beats it (see the module).

    ``trusted(peer)``: whether this node may pull from ``peer``; ``bandwidth(peer)``: the link's
    bytes/s, None when unknown (then ``probe(peer)`` is called for each trusted holder that
    would gain enough). ``limit(peer)``: the KV bytes ``peer`` may still send, None for no
    bound (``within_limit``). ``policy``: the cost policy whose estimates are compared; None only in
    ``"always"`` mode. In ``"always"`` mode a local decision pulls from the trusted holder with
    the longest match beyond this node's, whatever the estimates say (a benchmark baseline).
    """
    local = next(c for c in candidates if c.is_local)
    prompt = request.prompt_tokens
    floor = local.matched_tokens + settings.min_pull_tokens
    best: PullOption | None = None
    bytes_per_block = settings.kv_bytes_per_token * max(1, block_size)

    def within_limit(c: Candidate) -> Candidate:
        """``c`` as a pull may use it: its match cut to the whole blocks beyond this node's
        that its byte bound lets come."""
        bound = limit(c.peer)
        if bound is None:
            return c
        fits = local.matched_tokens + (max(0, bound) // bytes_per_block) * max(1, block_size)
        return c if c.matched_tokens <= fits else replace(c, matched_tokens=fits)

    if settings.mode == "always":
        if not decision.is_local:
            return decision
        longest: Candidate | None = None
        for c in candidates:
            if c.is_local or min(c.matched_tokens, max(0, prompt - 1)) < floor:
                continue
            if not trusted(c.peer):
                continue
            c = within_limit(c)
            if min(c.matched_tokens, max(0, prompt - 1)) < floor:
                continue
            if longest is None or c.matched_tokens > longest.matched_tokens:
                longest = c
        if longest is None:
            return decision
        bw = bandwidth(longest.peer)
        if bw is None:
            if probe is not None:
                probe(longest.peer)
            bw = math.inf  # unknown: the baseline pulls anyway; the transfer measures it
        if policy is not None:
            best = pull_option(policy, request, local, longest, bw, settings)
        if best is None:
            gain = min(longest.matched_tokens, max(0, prompt - 1)) - local.matched_tokens
            nbytes = gain * settings.kv_bytes_per_token
            best = PullOption(longest.peer, gain, nbytes,
                              transfer_s(nbytes, longest.rtt_s, bw, settings), math.nan)
        return _pulling(decision, local, best, "always pull")
    if policy is None:
        raise ValueError("consider_pull: the 'auto' mode needs the cost policy's estimates")
    local_ttft: float | None = None
    for c in candidates:
        if c.is_local or min(c.matched_tokens, max(0, prompt - 1)) < floor:
            continue
        if not trusted(c.peer):
            continue
        c = within_limit(c)
        if min(c.matched_tokens, max(0, prompt - 1)) < floor:
            continue  # what its link may still carry gains too little (nor is it probed)
        bw = bandwidth(c.peer)
        if bw is None:
            if probe is not None:
                probe(c.peer)
            continue
        if local_ttft is None:
            local_ttft = policy.estimate(request, local)[0]
        option = pull_option(policy, request, local, c, bw, settings, local_ttft)
        if option is not None and (best is None or option.ttft_s < best.ttft_s):
            best = option
    if best is None:
        return decision
    if decision.estimated_ttft_s is not None:
        against = decision.estimated_ttft_s
    else:
        against = local_ttft if local_ttft is not None else policy.estimate(request, local)[0]
    margin = max(settings.min_gain_s, settings.min_gain_fraction * against)
    if not against - best.ttft_s > margin:
        return decision
    return _pulling(
        decision, local, best,
        f"pull: est. TTFT {best.ttft_s:.3f} s (transfer {best.transfer_s:.3f} s) beats "
        f"{'local' if decision.is_local else describe_peer(decision.target)} {against:.3f} s",
    )


def _pulling(
    decision: RouteDecision, local: Candidate, option: PullOption, why: str
) -> RouteDecision:
    """A local decision that pulls ``option`` first: the failover order keeps the policy's
    ranking, with this node first."""
    ranked = (local.peer, *(p for p in decision.ranked if p != local.peer))
    estimate = None if math.isnan(option.ttft_s) else option.ttft_s
    return RouteDecision(
        local.peer,
        True,
        local.matched_tokens + option.tokens,
        f"{why}: {option.tokens} tokens ({option.nbytes} bytes) from {describe_peer(option.peer)}; "
        f"instead of: {decision.reason}",
        estimated_ttft_s=estimate,
        ranked=ranked,
        max_outstanding=None,
        pull_from=option.peer,
        pull_tokens=option.tokens,
        pull_bytes=option.nbytes,
    )

