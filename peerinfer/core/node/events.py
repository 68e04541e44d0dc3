"""What a ``NodeCore`` is fed (events), what it answers (effects), and the snapshots its queries
return. Plain frozen values: the shells build and read them, the core's parts pass them on."""

from __future__ import annotations

from dataclasses import dataclass

from peerinfer.core.messages import Announce, Load, SamplingParams, SyncRequest, SyncResponse
from peerinfer.core.peerview import AnnounceRun
from peerinfer.core.quickinit import quick_init
from peerinfer.core.routing import RouteDecision
from peerinfer.types import BlockHash, PeerId, RequestId

__all__ = [
    "AnnounceReceived",
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
    "NodeStatistics",
    "PeerLost",
    "PeerSeen",
    "PeerSnapshot",
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

# ---------------------------------------------------------------------------------------------
# Events (inputs)


@quick_init
@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A request to serve. ``forwarded`` requests came from a peer and are never forwarded again."""

    request_id: RequestId
    tokens: tuple[int, ...]
    params: SamplingParams
    forwarded: bool = False
    origin: PeerId | None = None
    #: a forwarded request is refused as busy if more requests than this are queued or
    #: running here when it arrives (the origin's routing assumed no more; None: no limit)
    max_outstanding: int | None = None
    #: who asked, for the fair share of this node's engine: the client's peer id for a direct
    #: client; "" means the origin for a forwarded request, else this node itself (an
    #: in-process caller, the simulator's users)
    requester: str = ""
    #: from this node's own front ends (HTTP on this machine, the in-process API): entitled
    #: to more of the engine than another requester, and first among those below their share
    local: bool = False
    #: the salted hash of the prompt's scaffold (``PrefixHasher.scaffold_hash``; None: none
    #: known): what the ``scaffold_hash`` policy routes by and a server advertises
    scaffold: int | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class AnnounceReceived:
    sender: PeerId
    announce: Announce
    #: the run of announcements this one is the newest of, when the shell hands the same
    #: announcements to several recipients at once (the simulator; see ``AnnounceRun``)
    run: AnnounceRun | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class SyncResponseReceived:
    peer: PeerId
    response: SyncResponse


@quick_init
@dataclass(frozen=True, slots=True)
class SyncFailed:
    peer: PeerId
    session: int
    reason: str


@quick_init
@dataclass(frozen=True, slots=True)
class LocalStarted:
    """The local engine began a request (it left the queue and took a slot)."""

    request_id: RequestId
    cached_tokens: int


@quick_init
@dataclass(frozen=True, slots=True)
class LocalFinished:
    """The local engine finished (or failed) a request; ``cache_added``/``cache_removed`` are
    the engine's cache changes since its previous report. ``generated``: tokens it made since
    it last (re)started (its requester's service; 0 when not known)."""

    request_id: RequestId
    ok: bool
    cache_added: tuple[BlockHash, ...] = ()
    cache_removed: tuple[BlockHash, ...] = ()
    error: str = ""
    generated: int = 0


@quick_init
@dataclass(frozen=True, slots=True)
class LocalPreempted:
    """The local engine preempted a request as ``PreemptLocal`` asked: it left the running set
    (its state kept, to resume) after making ``generated`` tokens since it last (re)started."""

    request_id: RequestId
    generated: int = 0


@quick_init
@dataclass(frozen=True, slots=True)
class CacheChanged:
    """Cache changes reported outside a request (start-up snapshot, a cleared cache).

    ``disk``, when given, is the disk tier's figure announced in this node's load from now on
    (``Load.disk``: per mille of held blocks on disk only, ns to load a token from disk)."""

    added: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()
    disk: tuple[int, int] | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class ForwardFirstToken:
    request_id: RequestId
    peer: PeerId


@quick_init
@dataclass(frozen=True, slots=True)
class ForwardFinished:
    """A forward ended well. ``cached_tokens`` (as the peer reported them) and ``ttft_s`` (as
    the origin measured it) are checked against the decision's promise; ``completion`` is what
    was relayed, for an audit. None/empty: not known (no check)."""

    request_id: RequestId
    peer: PeerId
    cached_tokens: int | None = None
    ttft_s: float | None = None
    completion: tuple[int, ...] = ()


@quick_init
@dataclass(frozen=True, slots=True)
class ForwardFailed:
    """A forward failed. ``reason`` is one of busy, unavailable, timeout, protocol, invalid,
    internal, contract (the result broke the request's contract). ``generated`` holds the token
    ids already relayed to the client (mid-stream failure); the request then resumes locally
    after them, or ends if they were the whole ``max_tokens`` (the shell answered)."""

    request_id: RequestId
    peer: PeerId
    reason: str
    generated: tuple[int, ...] = ()


@quick_init
@dataclass(frozen=True, slots=True)
class PeerSeen:
    """The shell heard from (or connected to) a peer; ``rtt_s`` when a ping measured it."""

    peer: PeerId
    rtt_s: float | None = None
    load: Load | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class PeerLost:
    """The shell lost the connection to a peer, or a ping failed."""

    peer: PeerId


@quick_init
@dataclass(frozen=True, slots=True)
class Cancel:
    """The client went away; stop the request wherever it is."""

    request_id: RequestId


@quick_init
@dataclass(frozen=True, slots=True)
class AuditFinished:
    """An ``AuditForward`` ran: ``ok`` says whether ``peer``'s answer is what the local model
    gives (``detail`` says where it is not)."""

    peer: PeerId
    ok: bool
    detail: str = ""


@quick_init
@dataclass(frozen=True, slots=True)
class TransferMeasured:
    """``nbytes`` came from ``peer`` in ``seconds`` (a KV pull or a ``ProbeLink``, request to
    last byte; ``rtt_s`` of them were the round trip): a sample of the link's bandwidth
    (``peerinfer.core.kvpull.LinkEstimator``). Ignored when pulls are off."""

    peer: PeerId
    nbytes: int
    seconds: float
    rtt_s: float = 0.0


@quick_init
@dataclass(frozen=True, slots=True)
class PullChecked:
    """The tokens of a pull from ``peer`` that the verifier sampled
    (``NodeCore.pull_sample``) were recomputed: ``ok`` when all matched within the tolerance
    (``PullVerifier.judge``). A mismatch discards the pull (the shell's part) and bans
    ``peer`` as a failed audit does."""

    peer: PeerId
    ok: bool
    detail: str = ""


@quick_init
@dataclass(frozen=True, slots=True)
class PullFailed:
    """A pull from ``peer`` gave nothing, judged or not (``PullChecked`` covers a judged one):
    ``reason`` is the holder's refusal (``KvPullDone.refused``: "format", "busy", ...) or
    "failed" (a timeout, the holder gone, bytes that broke the protocol). The core holds off
    pulls from ``peer`` for ``PULL_HOLDOFF_S``, and for good after "format" (its KV format
    is not this node's, and a format does not change while the node runs)."""

    peer: PeerId
    reason: str
    detail: str = ""


@quick_init
@dataclass(frozen=True, slots=True)
class PullLimit:
    """At most ``nbytes`` of KV may come from ``peer`` from now on, or None for no such bound.
    The shell says so for a peer it reaches only through a relay, whose circuit closes past its
    byte limit (``peerinfer.node.kvpull.RELAYED_KV_BYTES``): pulls from it are then planned
    for what fits (the rest recomputed), or not at all. Ignored when pulls are off."""

    peer: PeerId
    nbytes: int | None


Event = (
    ClientRequest
    | AnnounceReceived
    | SyncResponseReceived
    | SyncFailed
    | LocalStarted
    | LocalFinished
    | LocalPreempted
    | CacheChanged
    | ForwardFirstToken
    | ForwardFinished
    | ForwardFailed
    | PeerSeen
    | PeerLost
    | Cancel
    | AuditFinished
    | TransferMeasured
    | PullChecked
    | PullFailed
    | PullLimit
)

# ---------------------------------------------------------------------------------------------
# Effects (outputs)


@quick_init
@dataclass(frozen=True, slots=True)
class Publish:
    announce: Announce


@quick_init
@dataclass(frozen=True, slots=True)
class SendSyncRequest:
    """Send ``request`` to ``peer`` on the sync protocol and feed back its response (or a
    ``SyncFailed``) within ``timeout_s``."""

    peer: PeerId
    request: SyncRequest
    timeout_s: float


@quick_init
@dataclass(frozen=True, slots=True)
class RunLocal:
    """Run ``tokens`` on the local engine and stream the result to the request's client. When
    ``resume_after`` is non-empty the request was partly served elsewhere: those tokens were
    already relayed and are part of ``tokens``; only the new ones go to the client."""

    request_id: RequestId
    tokens: tuple[int, ...]
    params: SamplingParams
    decision: RouteDecision | None
    resume_after: tuple[int, ...] = ()


@quick_init
@dataclass(frozen=True, slots=True)
class Forward:
    """Forward the request to ``peer`` and relay its token stream to the client; report the first
    token, the end or a failure back. ``first_token_timeout_s`` bounds the wait."""

    request_id: RequestId
    peer: PeerId
    tokens: tuple[int, ...]
    params: SamplingParams
    decision: RouteDecision
    first_token_timeout_s: float
    attempt: int
    #: the request's scaffold hash, for the target to advertise (``ClientRequest.scaffold``)
    scaffold: int | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class Reject:
    """Answer the request with an error (``code`` as in messages.ERROR_CODES);
    ``retry_after_s``: when a busy refusal may be worth retrying (0: no hint)."""

    request_id: RequestId
    code: str
    message: str
    retry_after_s: float = 0.0


@quick_init
@dataclass(frozen=True, slots=True)
class PreemptLocal:
    """Preempt the running request once it has made ``after_tokens`` tokens since it last
    (re)started: take it out of the running set, keep its state (its KV where memory allows,
    else its tokens so far, to recompute from the prefix cache), report ``LocalPreempted``.
    A request that ends first reports ``LocalFinished`` as usual."""

    request_id: RequestId
    after_tokens: int


@quick_init
@dataclass(frozen=True, slots=True)
class ResumeLocal:
    """Give the preempted request a slot again: it continues where it yielded."""

    request_id: RequestId


@quick_init
@dataclass(frozen=True, slots=True)
class CancelLocal:
    request_id: RequestId


@quick_init
@dataclass(frozen=True, slots=True)
class CancelForward:
    request_id: RequestId
    peer: PeerId


@quick_init
@dataclass(frozen=True, slots=True)
class PingPeer:
    peer: PeerId


@quick_init
@dataclass(frozen=True, slots=True)
class DropPeer:
    """The peer left the candidate set (silent too long). The shell may disconnect it."""

    peer: PeerId


@quick_init
@dataclass(frozen=True, slots=True)
class AuditForward:
    """Re-score ``peer``'s answer ``completion`` to ``tokens`` (greedy or sampled, as ``params``
    say) with the local model, at low priority (never before a client's work), and feed back
    ``AuditFinished``."""

    peer: PeerId
    tokens: tuple[int, ...]
    params: SamplingParams
    completion: tuple[int, ...]


@quick_init
@dataclass(frozen=True, slots=True)
class BanPeer:
    """``peer`` failed an audit: disconnect and refuse it until ``until`` (node clock)."""

    peer: PeerId
    until: float
    reason: str


@quick_init
@dataclass(frozen=True, slots=True)
class ProbeLink:
    """Measure the link from ``peer``: fetch ``nbytes`` of filler from it and report the
    transfer as ``TransferMeasured`` (asked only with pulls on, when the link has no recent
    bandwidth figure; bounded by ``PullSettings.probe_bytes`` and ``probe_gap_s``)."""

    peer: PeerId
    nbytes: int


Effect = (
    Publish
    | SendSyncRequest
    | RunLocal
    | Forward
    | Reject
    | PreemptLocal
    | ResumeLocal
    | CancelLocal
    | CancelForward
    | PingPeer
    | DropPeer
    | AuditForward
    | BanPeer
    | ProbeLink
)

@quick_init
@dataclass(frozen=True, slots=True)
class Silence:
    """``NodeCore.silence``'s answer: past ``deadline`` the request ends with a timeout error
    saying ``message``; ``waiting``: it waits its turn here (its client may be told it is
    still there: the shell's heartbeat)."""

    deadline: float
    waiting: bool
    message: str


@quick_init
@dataclass(frozen=True, slots=True)
class PeerSnapshot:
    peer_id: PeerId
    digest_age_s: float
    load: Load
    cached_tokens: int
    rtt_s: float | None


@quick_init
@dataclass(frozen=True, slots=True)
class NodeStatistics:
    """A frozen snapshot of counters (trio's ``statistics()`` habit)."""

    requests: int
    served_locally: int
    forwarded: int
    failovers: int
    rejected: int
    #: forwarded requests refused because more were outstanding than the origin assumed
    rejected_over_limit: int
    #: requests that ended after admission: served, failed or cancelled (so requests ==
    #: rejected + completed + those held now)
    completed: int
    announces_sent: int
    announces_refused: int
    #: announcements refused because the sender is not a member (never answered us directly)
    announces_unverified: int
    #: replicas emptied for growing past their allowance of the replica budget
    replicas_emptied: int
    syncs_started: int
    syncs_converged: int
    syncs_failed: int
    #: running generations that yielded their slot (fair share), and resumes of them
    preempted: int
    resumed: int
    queued: int
    running: int
