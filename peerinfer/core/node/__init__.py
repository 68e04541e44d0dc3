"""The node's whole logic as one sans-IO state machine, shared by the real node and the simulator.

Theory of operation
-------------------
A ``NodeCore`` is fed *events* (a client request arrived, an announcement was received, a sync
response came back, the engine finished, a forwarded request failed, a timer is due) together
with the current time, and answers with a list of *effects* (publish this announcement, send
this sync request to that peer, run this request on the local engine, forward it to that peer,
reject it, ping that peer, forget that peer). It never awaits, never reads a clock and never
rolls its own dice: ``now`` is an argument and randomness comes from the ``random.Random`` it is
given. The trio + libp2p shell (``peerinfer.node``) executes the effects over the network;
the simulator (``peerinfer.sim``) executes the same effects in virtual time. No decision is
coded twice.

Where the code is
~~~~~~~~~~~~~~~~~
``NodeCore`` (``machine``) is a thin composer: it feeds each event to the sub-machines it
concerns, in an order written out in its handlers, and owns nothing else but the rebalance
timer. Each sub-machine owns its state and none imports another; they exchange values through
the composer:

* ``requests``: the phase table, the requests held, admission, the engine's fair share;
* ``choice``: the bridge from the peer view, reputation and round trips to the routing policy,
  and what this node advertises of itself (its load, scaffold hints);
* ``announcing``: this node's announcements, the ones received, pulls, refusals;
* ``members``: membership, pings, round trips, liveness;
* ``trust``: judging forward outcomes, audit sampling, bans;
* ``events`` and ``config``: the values in and out, and the tuning.

Below them ``peerinfer.core.peerview.PeerView`` keeps the peer index together with the
announcements not taken in yet (see "Pull"); with lazy announcements off it is the index.

What it decides
~~~~~~~~~~~~~~~
* **Announce.** This node's cache digest (``LocalDigest``) changes when the engine reports
  blocks added or evicted. An announcement (epoch, root, count, load and the changes since the
  previous epoch when they fit) is published every ``announce_interval_s``, and sooner after a
  change, but never more often than ``min_announce_gap_s`` (gossipsub drops bursts).
* **Membership.** A peer is a *member* (it has state here, a replica, and may be a routing
  candidate) only once it answered this node directly: a ``PeerSeen`` with a measured round trip,
  which the shell feeds only for a ping answered over a direct, authenticated (and, in a private
  swarm, admitted) connection. A connection alone (``PeerSeen`` without a round trip) asks for
  that ping. Identities heard of only through relayed gossip are never members: their
  announcements are refused and allocate nothing, so forged identities over one connection cost
  nothing but the refusal (and a ping request the shell drops, having no connection to them).
* **Pull.** An announcement from a member is refused when its epoch is not newer than the last
  one seen from that peer (stale or replayed). Freshness never reads the sender's clock: a
  member is as fresh as the last time *we* received from it (``now``, the receiver's monotonic
  clock), so a skewed or stepped clock elsewhere changes nothing; the sender's epochs only have
  to grow, across its restarts too (the shell persists them). Otherwise the peer's replica
  applies the carried delta; if its root still differs, a pull runs the Merkle reconciliation
  state machine (one session per peer at a time, with a deadline). Each refusal is reported once
  per (peer, reason) through ``take_refusals()``, for the shell to log.
  An announcement that changes nothing and chains from an in-step replica (most of them) waits:
  the node keeps the newest per peer and takes them in when anything next reads the peer index
  (the ``index`` property), with the state eager application would have left
  (``lazy_announcements``; ``PeerView._defer_unchanged`` in peerinfer.core.peerview says when
  waiting cannot change an effect).
  A shell that hands the same announcements to many recipients at once (the simulator) may
  share them as an ``AnnounceRun``: a node that kept the run's newest one follows it and is not
  handed the next ones; it reads them from the run when it next reads that peer (routing reads
  only their loads, freshness and sets, and drops the speculative entries they confirm; a
  rebalance only their claimed counts and freshness; and so for kept ones; everything else
  takes them in), and leaves the run when a
  pull, a rebalance or an emptied replica would make taking one in do more.
* **Replica budget.** All replicas together hold at most ``replica_budget_blocks`` hashes; the
  index splits that budget into per-peer allowances (``PeerIndex.rebalance``, every
  ``rebalance_interval_s``), favouring peers whose replicas help route this node's prompts. An
  announcement claiming more than the sender's allowance is refused; a replica that grew past it
  (a lying delta, a pull) is emptied.
* **Route.** A client request is hashed into its block chain, the peer index estimates every
  peer's match in one walk, and the routing policy picks a target among the local node and
  every live peer; the decision (target, expected cached tokens, reason) is returned in the
  effect so it can be logged. A forwarded request is always served where it lands (no loops).
  After routing, the target is recorded as speculatively holding the prompt's blocks.
* **Pull KV** (issue 24; only with ``NodeConfig.kv_pull``). After the policy, ``Choice`` asks
  ``peerinfer.core.routing.pull.consider_pull`` whether serving here after pulling a trusted
  holder's KV would be faster still; if so the local decision carries ``pull_from`` (the shell
  pulls when the request's turn comes). A link with no recent bandwidth figure is not pulled
  over and gets a ``ProbeLink``; the shell reports every transfer as ``TransferMeasured``.
  Before a pull is used the shell recomputes the tokens ``pull_sample`` names and reports
  ``PullChecked``: a mismatch is a failed audit (a ``BanPeer``). A pull that gives nothing
  otherwise (refused, timed out) is reported as ``PullFailed``: no pulls from that holder for
  ``PULL_HOLDOFF_S`` (for good when its KV format is not this node's). A holder reached only
  through a relay carries a byte bound (``PullLimit``, from the shell): a pull from it is
  planned for the blocks that fit, or not made.
* **Fail over.** A forward that fails, is refused as busy, or gives no first token before its
  deadline goes to the next candidate in the policy's ranking, and finally to the local engine.
  A failure after tokens were streamed resumes locally from the prompt plus the tokens already
  relayed, so the client's stream continues instead of being lost.
* **Admit, fair share.** The local engine runs ``slots`` requests at once (its capacity: the
  engine's ``max_batch_size``); the rest wait, each in its *requester's* share (the origin peer
  of a forwarded request, the client's peer of a direct one, an HTTP client's API key).
  peerinfer.core.fairshare decides between requesters: each is entitled to a weighted part of
  the slots (this node's own front ends weigh more); a free slot goes to a waiting requester
  below its entitlement (own front ends first among those), by least service (tokens
  generated here) per weight; and while one waits below its entitlement with no slot coming,
  the requester furthest above its own yields one: its longest-running generation is
  *preempted* (``PreemptLocal``) once it has made ``preempt_after_tokens`` tokens since it
  (re)started, waits in ``PREEMPTED`` (the engine keeps its state) and resumes
  (``ResumeLocal``) when its turn comes. It is never dropped. Refused as ``busy``, with a
  message naming the limit and a retry hint: a forwarded request when ``max_queue`` requests
  wait and every slot runs, or when more than its ``max_outstanding`` are here (its origin
  has other options); a requester other than this node itself with ``max_queued_per_peer``
  already waiting (default: ``slots``, so one requester has at most twice the slots admitted);
  anything once ``hard_max_queue`` wait. A prompt longer than ``max_prompt_tokens`` or a
  ``max_tokens`` above ``max_new_tokens`` is refused as ``invalid``. Nothing is dropped
  silently: every request ends in exactly one ``Reject`` or one finish.
* **Trust.** Every forward's outcome (served within its digest's claim and the estimated first
  token, or short, slow, timed out, busy while announcing idle, a broken contract) feeds the
  per-peer ``Reputation`` (peerinfer.core.reputation); demoted peers' cache claims count for
  nothing in routing, excluded and banned peers (and, with ``trusted_peers``, every unlisted
  peer) are not candidates. A peer's first answer, then ``audit_rate`` of them, is sent
  for an audit (``AuditForward``); a failed audit bans the peer (``BanPeer``).
* **Liveness.** Peers are pinged when quiet; a peer silent for ``peer_timeout_s`` leaves the
  index (and the candidate set); when it announces again it rejoins with an empty replica.

Request lifecycle
~~~~~~~~~~~~~~~~~
Every request this node holds is in exactly one ``Phase``; ``_TRANSITIONS`` (in ``requests``)
lists every allowed move with its cause, h11-style, and ``Requests.transition`` refuses any other (a
bug in the core: it raises). The bookkeeping each phase implies (the requester queues, the
running count, in-flight counts per peer, the blocks pending locally, the requesters' shares)
changes only in ``Requests.transition``, so ``check_invariants()`` can recount all of it from the
requests::

    ROUTING --> QUEUED --> RUNNING --> DONE            (served here)
       |          ^         |  ^
       |          |         v  |                        (over its share while another waits:
       |          |       PREEMPTED --> DONE             yields, resumes later; cancelled)
       |          ^
       +----> FORWARDED --> RELAYING --> DONE          (served by a peer, relayed)
              |   ^  |         |
              +---+  +--> QUEUED <-+                   (fail over: next peer, or here;
                                                        mid-stream: resume here)

``ROUTING`` lasts only within the handler of the request's arrival; ``DONE`` requests are
forgotten at once. A request that arrived forwarded goes ``ROUTING -> QUEUED`` only.
"""

from peerinfer.core.node.config import NodeConfig
from peerinfer.core.node.events import (
    AnnounceReceived,
    AuditFinished,
    AuditForward,
    BanPeer,
    CacheChanged,
    Cancel,
    CancelForward,
    CancelLocal,
    ClientRequest,
    DropPeer,
    Effect,
    Event,
    Forward,
    ForwardFailed,
    ForwardFinished,
    ForwardFirstToken,
    LocalFinished,
    LocalPreempted,
    LocalStarted,
    NodeStatistics,
    PeerLost,
    PeerSeen,
    PeerSnapshot,
    PingPeer,
    PreemptLocal,
    ProbeLink,
    Publish,
    PullChecked,
    PullFailed,
    PullLimit,
    Reject,
    ResumeLocal,
    RunLocal,
    SendSyncRequest,
    Silence,
    SyncFailed,
    SyncResponseReceived,
    TransferMeasured,
)

# The lifecycle table, for the tests that walk it.
from peerinfer.core.node.machine import NodeCore
from peerinfer.core.node.requests import _TRANSITIONS as _TRANSITIONS
from peerinfer.core.node.requests import Phase
from peerinfer.core.peerview import AnnounceRun

__all__ = [
    "AnnounceReceived",
    "AnnounceRun",
    "AuditFinished",
    "AuditForward",
    "BanPeer",
    "CacheChanged",
    "Cancel",
    "CancelForward",
    "CancelLocal",
    "ClientRequest",
    "DropPeer",
    "Effect",
    "Event",
    "Forward",
    "ForwardFailed",
    "ForwardFinished",
    "ForwardFirstToken",
    "LocalFinished",
    "LocalPreempted",
    "LocalStarted",
    "NodeConfig",
    "NodeCore",
    "NodeStatistics",
    "PeerLost",
    "PeerSeen",
    "PeerSnapshot",
    "Phase",
    "PingPeer",
    "PreemptLocal",
    "ProbeLink",
    "PullChecked",
    "PullFailed",
    "PullLimit",
    "Publish",
    "Reject",
    "ResumeLocal",
    "RunLocal",
    "SendSyncRequest",
    "Silence",
    "SyncFailed",
    "SyncResponseReceived",
    "TransferMeasured",
]
