"""Routing policies: given a prompt and the candidate peers, choose who serves it, and say why.

Every policy implements one interface, ``choose(request, candidates, rng) -> RouteDecision``.
It is a pure decision: the candidates carry everything known (matched prefix length, announced
load, round trip, digest age, requests we already sent there), randomness comes from ``rng``,
and the decision carries a human-readable ``reason`` and ``ranked``, the failover order (best
first, every candidate exactly once, the target first; a node's route over rows lists only
the candidates that could matter, ``RowBound``: nothing reads it there). Exactly one candidate
is the local node, and serving locally is always possible. ``round_robin`` keeps a turn
counter; the others keep no state between calls (``scaffold_hash``'s hints are the node's,
``ScaffoldHints``, read through the candidates' loads).

Load below means ``outstanding / slots`` where ``outstanding = max(queued + running, inflight)``:
a peer's announced load already counts the requests we sent it once the announcement catches
up, so the larger of the two figures is used, not their sum.

The policies
------------
``local``
    Always serve locally: the paper's no-routing baseline. Failover order: local, then the
    others by load.

``random``
    A uniformly random candidate (local included). Failover order: a random permutation.

``round_robin``
    Candidates sorted by peer id; the policy's turn counter picks the next one (modulo the
    number of candidates) on each call. Failover order: the rotation starting at the target.

``least_loaded``
    The lowest load; ties prefer the local node (no network hop), then a random one among the
    tied. Failover order: by load.

``longest_prefix``
    The paper's rule: the longest estimated prefix match (``matched_tokens``, the local node's
    from its own radix cache, a remote's from its digest replica); ties broken by the lowest
    load, then at random. With no match anywhere this degrades to least loaded. Failover order:
    by (match descending, load).

``cost`` (the default)
    Estimate each candidate's time to first token (TTFT) and take the smallest::

        TTFT(c) = rtt(c)                      (0 for the local node)
                + wait(c)                     (expected queueing delay)
                + E[prefill(prompt, cached)]  (cost model, cached tokens discounted by staleness,
                                               next to the requests running there)

    * ``wait``: with ``n`` outstanding requests on ``s`` slots (a node runs up to ``s`` at
      once in one batch, ``core/costmodel.py``), a new request waits for a slot only when
      ``n >= s``; then ``n - s + 1`` requests must finish first, the oldest of them half done
      on average, a full batch freeing a slot every ``T / s``: ``(n - s + 0.5) * T / s``. ``T``
      is the mean service time of a request in a full batch, by default the cost model's
      ``service_s(..., running=s)`` of a request shaped like this one with half its prompt
      cached (option ``mean_service_s`` overrides it). Admitted next to ``d = min(n, s - 1)``
      running requests, it also waits for their prefills under way (the engine prefills one
      chunk at a time, oldest first: ``prefill_backlog_s``), and its own prefill is the cost
      model's next to ``d`` decoders (the busy rate, one decode step of theirs per chunk).
      With one slot both extras are 0: the single-slot estimate.
    * Speed: every term is the candidate's own machine's: a node announces its cost model's
      figures in its load (``Load.speed``, ``CostModel.speed()``), and a candidate that
      announced other figures than this node's is estimated with this node's model at its
      figures (``costs_for``, ``CostModel.at_speed``); one that announced none, as this node.
      So a GPU next to CPUs gets the work its speed earns, and a slow peer is not promised
      (and then held to) a fast node's first token.
    * Staleness: a remote's ``matched_tokens`` come from a digest that is ``digest_age_s`` old;
      the peer may have evicted them since. The match is trusted with confidence
      ``p = 0.5 ** (age / staleness_half_life_s)`` (1 for the local node, whose radix cache is
      exact; 0 for a digest never confirmed), and the prefill estimate is the expectation
      ``p * prefill(prompt, matched) + (1 - p) * prefill(prompt, 0)``.
    * Hysteresis: a remote wins only if it beats the local estimate by a margin,
      ``max(min_gain_s, min_gain_fraction * TTFT(local))``. So the policy never picks a remote
      peer unless, by its own estimate, that is better than serving locally; forwarding on a
      near tie is not worth the network risk. Among remotes with equal estimates, the less
      loaded, then a random one, wins.
    * Hot prefixes: the queueing term is the load-aware penalty that keeps a popular prefix from
      piling onto one node. Each request sent to the best holder raises its ``inflight`` (and,
      once announced, its load) by one, so its ``wait`` grows by ``T / s`` per request. As soon
      as ``wait(holder) > prefill(prompt, 0) - prefill(prompt, cached) + rtt differences``, an
      idle node that does not hold the prefix has the smaller TTFT and gets the request; the
      node marks it as a speculative holder (``PeerIndex.add_speculative``), so the next request
      for that prefix sees two holders and spreads over both. Load is shed exactly when waiting
      for the hot holder costs more than recomputing the prefix elsewhere.
    * Extra-work charge (option ``extra_work_weight``, ``w``; 0 by default, so off; 1 while KV
      pulls are on: ``PullSettings.extra_work_weight``). The estimate is this request's own
      first token, so the rule above is greedy: past saturation it sheds a busy holder's
      request onto a *busy* non-holder, whose recompute then delays every request that comes
      there after it, and the extra prefills keep every node full (issue 24's RAG sweep at
      0.4 requests/s: 1.3x the mean TTFT of always forwarding to the longest holder). With
      ``w > 0`` candidates are ranked by a score, ``TTFT(c) + w * E(c) * n(c) / s``, where
      ``E(c) = (M - p * matched(c)) * (prefill_s_per_token - cached_s_per_token)`` is the
      prefill ``c`` would run beyond the best-placed candidate's (``M``: the most expected
      cached tokens among the candidates) and ``n(c)`` its outstanding requests, a stand-in
      for the requests its extra prefill will delay. An idle node is charged nothing, so a hot
      prefix still spreads onto idle peers. The margin, the runner-up and ``max_outstanding``
      are taken on the scores; ``estimated_ttft_s`` stays the estimate.

    * Herding: the queue estimate sees the load a peer last announced and this node's own
      requests in flight there, not what the other nodes sent it meanwhile; on a hot prefix they
      all pick the same best holder at once. So a forward carries a limit, ``max_outstanding``:
      the queue the target may hold on arrival for the decision to still beat the runner-up.
      Served there after waiting ``w``, the first token comes at ``rtt + w + prefill``; refused,
      at about ``rtt + TTFT(runner-up)``; so the target may wait up to ``TTFT(runner-up) -
      prefill(target)``, which ``wait`` above turns into a count. The target refuses a request
      over its limit as busy (one round trip) and the origin routes it again without that
      peer. The other policies set no limit (only the node's ``max_queue`` applies).

``scaffold_hash``
    The rival's rule, modelled on Mesh LLM's cache hints, with their limits: a request is named
    by one salted hash of its exact prompt *scaffold* (the system, developer and tool messages,
    or else the first user message: ``peerinfer.core.prefix.scaffold_messages``), carried in
    ``RouteRequest.scaffold``. Each node advertises, in its announced load
    (``Load.scaffolds``), the scaffolds of the prompts it served lately: at most
    ``MAX_SCAFFOLD_HINTS`` (128) of them, none older than ``SCAFFOLD_HINT_LIFETIME_S`` (120 s)
    (``ScaffoldHints``, kept by the node core). No digest, no partial match, no repair: a
    candidate holds the prompt only if its hints carry exactly that hash; ``matched_tokens``
    is ignored. Among the holders the least loaded with a free slot wins (ties: local, then
    at random); with no holder, or every holder's slots full, the least loaded candidate (ties:
    a holder, then local, then at random), the way a hint-aware load balancer spills. A
    request without a scaffold (a plain completion prompt) has no hint: least loaded.
    Failover order: the holders by load, then the others by load.

Ranked lists are deterministic given the inputs: remaining ties keep the order of the
candidates as given (``cost``) or go by peer id (the others).
"""

from __future__ import annotations

from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel
from peerinfer.core.routing.candidates import (
    Candidate,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    Row,
    describe_peer,
    make_candidate,
)
from peerinfer.core.routing.cost import CostPolicy, RowBound
from peerinfer.core.routing.pull import PullOption, consider_pull
from peerinfer.core.routing.scaffold import (
    MAX_SCAFFOLD_HINTS,
    SCAFFOLD_HINT_LIFETIME_S,
    ScaffoldHashPolicy,
    ScaffoldHints,
)
from peerinfer.core.routing.simple import (
    LeastLoadedPolicy,
    LocalPolicy,
    LongestPrefixPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from peerinfer.errors import ConfigError

POLICY_NAMES = (
    "local", "random", "round_robin", "least_loaded", "longest_prefix", "cost", "scaffold_hash"
)
DEFAULT_POLICY = "cost"

_COST_OPTIONS = frozenset(
    {"staleness_half_life_s", "min_gain_s", "min_gain_fraction", "mean_service_s",
     "extra_work_weight"}
)


def make_policy(name: str, *, costs: CostModel = DEFAULT_COSTS, **options: float) -> RoutingPolicy:
    """A fresh policy by name (one of ``POLICY_NAMES``); ConfigError on an unknown name/option."""
    if name == "cost":
        unknown = set(options) - _COST_OPTIONS
        if unknown:
            raise ConfigError(f"routing policy 'cost' has no option(s) {sorted(unknown)}")
        try:
            return CostPolicy(costs, **options)
        except TypeError as exc:
            raise ConfigError(f"routing policy 'cost': {exc}") from exc
    classes: dict[str, type[LocalPolicy | RandomPolicy | RoundRobinPolicy | LeastLoadedPolicy
                                 | LongestPrefixPolicy | ScaffoldHashPolicy]] = {
        "local": LocalPolicy,
        "random": RandomPolicy,
        "round_robin": RoundRobinPolicy,
        "least_loaded": LeastLoadedPolicy,
        "longest_prefix": LongestPrefixPolicy,
        "scaffold_hash": ScaffoldHashPolicy,
    }
    cls = classes.get(name)
    if cls is None:
        raise ConfigError(
            f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        )
    if options:
        raise ConfigError(f"routing policy {name!r} takes no options, got {sorted(options)}")
    return cls()


__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Candidate",
    "CostPolicy",
    "LeastLoadedPolicy",
    "LocalPolicy",
    "LongestPrefixPolicy",
    "PullOption",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "Row",
    "RowBound",
    "MAX_SCAFFOLD_HINTS",
    "SCAFFOLD_HINT_LIFETIME_S",
    "ScaffoldHashPolicy",
    "ScaffoldHints",
    "consider_pull",
    "describe_peer",
    "make_candidate",
    "make_policy",
]
