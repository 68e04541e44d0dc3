"""KV pulls in the shell (issue 24): serving the KV of cached blocks to peers, pulling it before
a request the core serves here after a pull (``RouteDecision.pull_from``), checking a sample of
what came, and the bounded link probes the core asks for (``ProbeLink``). Every decision (pull
or not, from whom, which blocks to check, what a mismatch costs the peer) is the core's.

The protocol, ``/peerinfer/kv/1.0.0`` (messages in ``peerinfer.core.messages``, "KV pulls"): the
puller sends one ``KvPullRequest`` (the engine's KV format, the hashes of a run of blocks in
chain order, or a number of filler bytes); the holder answers ``KvBlocks`` frames (at most
``KV_FRAME_TARGET_BYTES`` of blocks each) and one final ``KvPullDone`` (the blocks sent: the
leading run of the hashes that it holds, or why it refused). The stream is kept for the next
pull (``host.streams``). It is admitted like every other protocol: in a private swarm nothing
is served to a peer before it proved the swarm key (``peerinfer.net.streams``).

Bounds (the holder's): at most ``MAX_KV_PULL_BLOCKS`` blocks and ``MAX_PULL_BYTES`` bytes per
pull (encoded no further than that: ``Engine.encode_blocks``'s budget), blocks of at most
``MAX_KV_BLOCK_BYTES`` (one frame; a larger one is refused as "too_large"),
``MAX_KV_FILLER_BYTES`` of filler per probe, ``PULLS_SERVED_AT_ONCE`` pulls served at once
(the engine encodes them under its one lock), one pull and one probe per peer at a time,
each within ``PULL_TIMEOUT_S`` (then its stream is reset), and per peer ``PULL_RATE_PER_PEER`` pulls a
second (bursts of ``PULL_BURST_PER_PEER``; ``peerinfer.net.pacing.TokenBucket``); beyond them
it answers "busy". The holder serves only when it runs with pulls on, to a peer it would pull
from itself (``Choice.may_pull_from``: a member of its private swarm, or any peer of an open
swarm with the explicit opt-in; never a banned or untrusted one), and only in its own KV
format. The puller's: ``PULL_FIRST_FRAME_TIMEOUT_S`` for the first frame of a pull's answer
(the holder encodes under its engine's lock, which a batch may hold a while),
``PULL_FRAME_TIMEOUT_S`` between the others, ``PULL_TIMEOUT_S`` in all; and over a relayed
connection at most ``RELAYED_KV_BYTES`` of KV asked for in the connection's life, pulls and
probes together (a relay closes a circuit after its byte limit, and with it the peer's only
connection): a pull asks for the blocks that fit what is left (the rest is recomputed), and
none when nothing is left (the request is recomputed, the holder not blamed). The core knows
what is left for each peer reached only through relays (``PullLimit``: told at connection,
after each charge, and every ``PULL_LIMIT_REFRESH_S`` while a bound stands), so it plans
pulls that fit rather than ones the budget would cut short.

Any failure of a pull (refused, timed out, the holder gone, bytes that do not decode, a sampled
token whose KV does not match its recompute) leaves the request to be served here by recomputing:
a pull never loses a request. Pulled blocks whose bytes are exactly what this node's engine
computed for them earlier (``peerinfer.engine.kvmemo``) are taken without a recompute. A mismatch, and bytes that are not blocks of the format, are
reported as ``PullChecked(ok=False)``: the core bans the holder as a liar. Any other pull that
gave nothing for the holder's part (refused, no answer, the holder gone, the protocol broken)
is reported as ``PullFailed``: the core pulls nothing from that holder for a while.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from peerinfer.core.messages import (
    KV_FRAME_TARGET_BYTES,
    MAX_FRAME_BYTES,
    MAX_KV_FILLER_BYTES,
    MAX_KV_PULL_BLOCKS,
    KvBlocks,
    KvPullDone,
    KvPullRequest,
    decode,
    encode,
)
from peerinfer.core.node import (
    ProbeLink,
    PullChecked,
    PullFailed,
    PullLimit,
    RunLocal,
    TransferMeasured,
)
from peerinfer.engine.base import Engine
from peerinfer.engine.kvmemo import known_blocks
from peerinfer.errors import EngineError, PeerInferError, ProtocolError
from peerinfer.net.api import Stream
from peerinfer.net.context import PeerEvent
from peerinfer.net.host import Host, relayed_connection
from peerinfer.net.pacing import TokenBucket
from peerinfer.net.relay import RelaySettings
from peerinfer.net.streampool import StreamUse
from peerinfer.node.context import NodeContext
from peerinfer.node.options import KV_PROTOCOL, logger
from peerinfer.types import BlockHash, PeerId

#: The most bytes of blocks one pull is answered with (a 4,096-token prompt of the default model
#: in float32 is 189 MB): the rest of the run is not sent, and the puller recomputes it.
MAX_PULL_BYTES = 256 * 1024 * 1024
#: The largest block a holder sends (alone in a frame, with room for the frame's own few bytes):
#: beyond it the pull is refused as "too_large" (the puller's frame limit would refuse it).
MAX_KV_BLOCK_BYTES = MAX_FRAME_BYTES - 64
#: Pulls (and probes) a holder serves at once, all peers together; beyond: "busy".
PULLS_SERVED_AT_ONCE = 2
#: Pulls (and probes) one peer may start per second, and in a burst; beyond: "busy".
PULL_RATE_PER_PEER = 2.0
PULL_BURST_PER_PEER = 4
#: Peers whose pull rate is remembered (the least recently seen are forgotten beyond).
MAX_RATE_PEERS = 4096
#: The puller's wait for each frame of an answer (a stalled or vanished holder costs this), and
#: for the whole pull: generous, since the core chose the pull knowing the link's bandwidth, and
#: py-libp2p moved only about 10 MB/s on a loaded 2-core machine's loopback (docs/performance.md).
PULL_FRAME_TIMEOUT_S = 5.0
#: The puller's wait for the first frame of a pull's answer: the holder sends nothing before
#: its engine thread encoded the blocks, and that waits for the engine's lock (a running batch
#: step, another pull's encoding). A stalled holder costs this much before the recompute.
PULL_FIRST_FRAME_TIMEOUT_S = 20.0
PULL_TIMEOUT_S = 120.0
#: Extra receive window a puller gives the holder on a KV stream (the muxer's default is 256
#: KiB): about 1.4x the loopback throughput (``peerinfer.net.muxer.widen_receive_window``).
PULL_WINDOW_BYTES = 4 * 1024 * 1024
#: The most bytes of KV (pulls and probes together) the puller asks for over one relayed
#: connection in its whole life: a relay closes a circuit after its byte limit (both
#: directions, every stream on it: forwards, gossip, pings), and closing it loses the peer.
#: The relay's limit is not known here (py-libp2p 0.8.1 reads the Limit its STATUS and STOP
#: messages carry and drops it), so this is a quarter of peerinfer's default limit
#: (``RelaySettings.circuit_bytes``, ``--relay-circuit-bytes``): three quarters stay for the
#: rest. A relay configured with less than this budget still closes circuits under pulls.
RELAYED_KV_BYTES = RelaySettings().circuit_bytes // 4
#: How often the bounds told to the core (``PullLimit``) are checked again for the peers that
#: have one: a direct connection that opened beside a relayed one lifts the bound.
PULL_LIMIT_REFRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class PullOutcome:
    """What one pull did (tests, the benchmark): blocks received and adopted, bytes, seconds
    from the request to the last byte, the holder's refusal or the failure, the check, and
    whether the holder is to blame for nothing coming (``blame``)."""

    peer: str
    asked: int = 0
    received: int = 0
    adopted_tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    refused: str = ""
    failure: str = ""
    checked: int = 0
    ok: bool | None = None
    #: the holder's part in a pull that gave nothing, unjudged (reported as ``PullFailed``):
    #: its refusal code, or "failed" (no answer, the holder gone, the protocol broken)
    blame: str = ""
    #: pulled blocks whose bytes this engine had computed itself: checked for free
    #: (``peerinfer.engine.kvmemo``)
    known: int = 0


class KvExchange:
    """Serves pulls (:meth:`serve_kv`, the protocol's handler), pulls before a local run
    (:meth:`run_local`, in place of the engine worker's for a decision that pulls) and probes
    links (:meth:`probe`). ``run_after``: the engine worker's ``run_local``."""

    def __init__(self, ctx: NodeContext, run_after: Callable[[RunLocal], Awaitable[None]]) -> None:
        self._ctx = ctx
        self._run_after = run_after
        self._serving = trio.Semaphore(PULLS_SERVED_AT_ONCE)
        #: (peer, "pull" or "probe") being served now: one of each per peer at a time, whatever
        #: its streams
        self._serving_peers: set[tuple[str, str]] = set()
        self._rates: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        #: the last pulls' outcomes, newest last (tests, the benchmark)
        self.outcomes: collections.deque[PullOutcome] = collections.deque(maxlen=64)
        #: relayed connection -> KV bytes asked for over it so far (``RELAYED_KV_BYTES``); an
        #: entry goes with its connection
        self._relayed_asked: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        #: peer -> the byte bound last told to the core (``PullLimit``); only bounded peers
        self._limits_told: dict[str, int] = {}
        self._limits_checked_at = float("-inf")

    # ------------------------------------------------------------------ the holder's side

    def _refusal(self, peer: str, request: KvPullRequest) -> tuple[str, str]:
        """("", "") when ``peer``'s pull may be served now, else (code, detail)."""
        ctx = self._ctx
        core, engine = ctx.core, ctx.engine
        if ctx.options.kv_pull is None or core is None or engine is None or ctx.closing:
            return "off", "this node does not serve KV pulls"
        if not core.choice.may_pull_from(PeerId(peer), ctx.now()):
            return "untrusted", "this node exchanges KV only with peers it trusts for it"
        if not request.filler_bytes:
            fmt = engine.kv_format()
            if fmt is None or request.format != fmt:
                return "format", f"this node's KV format is {fmt}"
        bucket = self._rates.get(peer)
        if bucket is None:
            bucket = self._rates[peer] = TokenBucket(PULL_RATE_PER_PEER, PULL_BURST_PER_PEER)
            while len(self._rates) > MAX_RATE_PEERS:
                self._rates.popitem(last=False)
        self._rates.move_to_end(peer)
        if not bucket.take(ctx.now()):
            return "busy", f"more than {PULL_RATE_PER_PEER:g} pulls a second"
        return "", ""

    async def serve_kv(self, stream: Stream) -> None:
        """Answer pulls on ``stream``, one after another (the puller keeps the stream)."""
        peer = stream.remote_peer
        async for frame in stream:
            request = decode(frame, expected=KvPullRequest)
            assert isinstance(request, KvPullRequest)
            code, detail = self._refusal(peer, request)
            if code:
                logger.info("refused a KV pull from %s: %s", peer, detail)
                await stream.send(encode(KvPullDone(0, code, detail[:512])))
                continue
            # A probe is not a pull: the core probes a link while it may pull over it.
            kind = (peer, "probe" if request.filler_bytes else "pull")
            if kind in self._serving_peers:
                await stream.send(encode(KvPullDone(0, "busy", f"serving this peer another {kind[1]}")))
                continue
            try:
                self._serving.acquire_nowait()
            except trio.WouldBlock:
                await stream.send(encode(KvPullDone(0, "busy", "serving other pulls")))
                continue
            self._serving_peers.add(kind)
            try:
                # A serve holds a slot: a puller that stops reading (or a stalled link) must not
                # hold it for longer than a puller waits for the whole answer.
                with trio.move_on_after(PULL_TIMEOUT_S) as scope:
                    await self._serve_one(stream, request)
            finally:
                self._serving_peers.discard(kind)
                self._serving.release()
            if scope.cancelled_caught:
                logger.info("a KV pull by %s took over %g s; its stream is reset", peer, PULL_TIMEOUT_S)
                await stream.reset()
                return

    async def _serve_one(self, stream: Stream, request: KvPullRequest) -> None:
        """One pull (or probe) answered on ``stream``."""
        ctx = self._ctx
        if request.filler_bytes:
            await self._send_filler(stream, request.filler_bytes)
            return
        engine = ctx.engine
        assert engine is not None
        blocks = await ctx.in_engine(engine.encode_blocks, list(request.hashes), MAX_PULL_BYTES)
        big = max((len(b) for b in blocks), default=0)
        if big > MAX_KV_BLOCK_BYTES:
            await stream.send(encode(KvPullDone(0, "too_large", (
                f"a KV block of {big} bytes does not fit one frame")[:512])))
            return
        sent = 0
        total = 0
        batch: list[bytes] = []
        batch_bytes = 0
        for block in blocks:
            if batch and batch_bytes + len(block) > KV_FRAME_TARGET_BYTES:
                await stream.send(encode(KvBlocks(tuple(batch))))
                batch, batch_bytes = [], 0
            batch.append(block)
            batch_bytes += len(block)
            total += len(block)
            sent += 1
        if batch:
            await stream.send(encode(KvBlocks(tuple(batch))))
        await stream.send(encode(KvPullDone(sent)))
        ctx.traffic["kv", "sent"] += total

    async def _send_filler(self, stream: Stream, nbytes: int) -> None:
        left = min(nbytes, MAX_KV_FILLER_BYTES)
        while left > 0:
            n = min(left, KV_FRAME_TARGET_BYTES)
            await stream.send(encode(KvBlocks(filler=bytes(n))))
            left -= n
        await stream.send(encode(KvPullDone(0)))
        self._ctx.traffic["kv-probe", "sent"] += nbytes

    # ------------------------------------------------------------------ the puller's side

    async def run_local(self, eff: RunLocal) -> None:
        """Pull what ``eff.decision`` says (if anything), then hand the request to the engine
        worker, whatever became of the pull."""
        decision = eff.decision
        if decision is not None and decision.pull_from is not None:
            outcome: PullOutcome
            try:
                with trio.fail_after(PULL_TIMEOUT_S):
                    outcome = await self._pull(eff, decision.pull_from, decision.expected_cached_tokens)
            except trio.TooSlowError:
                outcome = PullOutcome(decision.pull_from, failure=f"no answer in {PULL_TIMEOUT_S:g} s",
                                      blame="failed")
            except (PeerInferError, trio.BrokenResourceError, trio.ClosedResourceError,
                    trio.EndOfChannel) as exc:
                outcome = PullOutcome(decision.pull_from, failure=f"{type(exc).__name__}: {exc}",
                                      blame="failed")
            except Exception as exc:  # a bug here must not lose the request
                logger.exception("KV pull from %s failed", decision.pull_from)
                outcome = PullOutcome(decision.pull_from, failure=f"{type(exc).__name__}: {exc}")
            self.outcomes.append(outcome)
            if outcome.blame:
                # The core holds off pulls from that holder a while (for good: another format).
                self._ctx.feed(PullFailed(PeerId(outcome.peer), outcome.blame,
                                          (outcome.refused or outcome.failure)[:200]))
            if outcome.failure or outcome.refused:
                logger.info("request %s: no KV from %s (%s); recomputing here", eff.request_id,
                            outcome.peer, outcome.failure or outcome.refused)
            else:
                logger.info("request %s: pulled %d tokens of KV (%d bytes) from %s in %.3f s",
                            eff.request_id, outcome.adopted_tokens, outcome.nbytes, outcome.peer,
                            outcome.seconds)
        await self._run_after(eff)

    async def _pull(self, eff: RunLocal, peer: str, target_tokens: int) -> PullOutcome:
        ctx = self._ctx
        engine, host, core = ctx.engine, ctx.host, ctx.core
        assert engine is not None and host is not None and core is not None
        if not engine.verifies_kv_blocks:
            return PullOutcome(peer, failure="this engine cannot verify pulled KV blocks")
        if ctx.sinks.get(eff.request_id) is None:
            return PullOutcome(peer, failure="the client left")
        tokens = eff.tokens
        plan = await ctx.in_engine(_plan, engine, tokens, target_tokens)
        if plan is None:
            return PullOutcome(peer, failure="nothing to pull (the prefix is cached here now)")
        fmt, first_block, hashes, block_bytes = plan
        blocks: list[bytes] = []
        received = [0]
        started = trio.current_time()
        # Every block of the format has one length: a block of another is refused as it comes,
        # and what may be buffered is bounded by the blocks asked for (where the engine does not
        # say the length, the first block's fixes it for the rest, within the byte cap).
        size = [block_bytes]

        cache = engine.radix_cache
        # Over a relayed connection the blocks asked for are bounded by bytes before they are
        # asked for: where the engine does not fix a block's length, by its KV bytes a token.
        block_estimate = block_bytes or engine.kv_bytes_per_token * (cache.block_size if cache else 1)
        asked = [hashes]

        async def exchange(use: StreamUse) -> KvPullDone | None:
            stream = use.stream
            if stream.remote_peer != peer:
                raise ProtocolError(f"a stream to {peer} reached {stream.remote_peer}")
            budget = self._relayed_budget(stream)
            if budget is not None:
                asked[0] = hashes[: budget // block_estimate if block_estimate > 0 else 0]
                if not asked[0]:
                    use.keep()
                    return None
                self._charge(stream, len(asked[0]) * block_estimate)
            await stream.send(encode(KvPullRequest(fmt, asked[0])), timeout=PULL_FRAME_TIMEOUT_S)
            await _widen(stream)
            wait = PULL_FIRST_FRAME_TIMEOUT_S
            while True:
                frame = await stream.receive(timeout=wait)
                wait = PULL_FRAME_TIMEOUT_S
                msg = decode(frame, expected=(KvBlocks, KvPullDone))
                if isinstance(msg, KvPullDone):
                    if not msg.refused and msg.blocks != len(blocks):
                        raise ProtocolError(f"{peer} says it sent {msg.blocks} blocks, came {len(blocks)}")
                    use.keep()
                    return msg
                assert isinstance(msg, KvBlocks)
                if msg.filler:
                    raise ProtocolError(f"{peer} answered a pull with filler")
                for block in msg.blocks:
                    if size[0] is None:
                        size[0] = len(block)
                    if len(block) != size[0]:
                        raise ProtocolError(
                            f"{peer} sent a KV block of {len(block)} bytes, the format's are {size[0]}"
                        )
                blocks.extend(msg.blocks)
                received[0] += sum(len(b) for b in msg.blocks)
                if len(blocks) > len(asked[0]) or received[0] > min(MAX_PULL_BYTES, len(asked[0]) * (size[0] or 0)):
                    raise ProtocolError(f"{peer} sent more than the pull asked for")

        done = await host.streams.exchange(peer, KV_PROTOCOL, exchange, timeout=PULL_FRAME_TIMEOUT_S)
        seconds = trio.current_time() - started
        if done is None:  # nobody's fault: the holder is not blamed
            return PullOutcome(peer, failure=(
                f"the relayed connection carried its {RELAYED_KV_BYTES} bytes of KV already"))
        hashes = asked[0]
        nbytes = received[0]
        ctx.traffic["kv", "received"] += nbytes
        if done.refused:
            return PullOutcome(peer, len(hashes), refused=f"{done.refused}: {done.detail}",
                               blame=done.refused)
        if nbytes:
            ctx.feed(TransferMeasured(PeerId(peer), nbytes, seconds))
        if not blocks:
            return PullOutcome(peer, len(hashes), nbytes=nbytes, seconds=seconds,
                               failure="the holder had none of the blocks", blame="failed")
        # Check a sample before anything is used: recompute those tokens' KV from the KV before.
        cache = engine.radix_cache
        bs = 1 if cache is None else cache.block_size
        positions = core.pull_sample(len(blocks), bs, engine.verify_run_tokens)
        # Blocks whose bytes are what this engine computed itself need no recompute.
        known = await ctx.in_engine(known_blocks, engine, [BlockHash(h) for h in hashes[:len(blocks)]],
                                    blocks)
        if known:
            positions = tuple(t for t in positions if t // bs not in known)
        verifier = core.trust.pull_verifier
        try:
            errors = await ctx.in_engine(engine.token_errors, tokens, first_block, blocks, positions)
        except ProtocolError as exc:
            ctx.feed(PullChecked(PeerId(peer), False, f"blocks that do not decode: {exc}"[:200]))
            return PullOutcome(peer, len(hashes), len(blocks), 0, nbytes, seconds,
                               failure=f"undecodable: {exc}", checked=len(positions), ok=False)
        except EngineError as exc:  # our own blocks went meanwhile: nobody's lie
            return PullOutcome(peer, len(hashes), len(blocks), 0, nbytes, seconds, failure=str(exc))
        if verifier is None:
            # Pulls were turned off meanwhile: nothing judges (the holder is not blamed: no
            # PullChecked), and nothing is used.
            return PullOutcome(peer, len(hashes), len(blocks), 0, nbytes, seconds,
                               failure="pulls were turned off", checked=len(positions))
        verdict = verifier.judge(errors, bs)
        ok, detail = verdict.ok, verdict.detail
        if positions:
            ctx.feed(PullChecked(PeerId(peer), ok, detail[:200]))
        if not ok:
            logger.warning("KV pulled from %s failed its check: %s", peer, detail)
            return PullOutcome(peer, len(hashes), len(blocks), 0, nbytes, seconds,
                               failure=f"mismatch: {detail}", checked=len(positions), ok=False)
        try:
            adopted = await ctx.in_engine(_adopt, engine, tokens, first_block, blocks)
        except ProtocolError as exc:
            # Bytes that are not blocks of the format the peer said it serves: a lie too.
            ctx.feed(PullChecked(PeerId(peer), False, f"blocks that do not decode: {exc}"[:200]))
            return PullOutcome(peer, len(hashes), len(blocks), 0, nbytes, seconds,
                               failure=f"undecodable: {exc}", checked=len(positions), ok=False)
        return PullOutcome(peer, len(hashes), len(blocks), adopted, nbytes, seconds,
                           checked=len(positions), ok=True, known=len(known))

    # ------------------------------------------------------------------ relayed connections

    def _relayed_budget(self, stream: object) -> int | None:
        """The bytes of KV still to be asked for over ``stream``'s connection (``RELAYED_KV_BYTES``
        in its life); None when it is not relayed (then only the other bounds hold)."""
        conn = relayed_connection(stream)
        if conn is None:
            return None
        return max(0, RELAYED_KV_BYTES - self._relayed_asked.get(conn, 0))

    def _charge(self, stream: object, nbytes: int) -> None:
        """Count ``nbytes`` asked for over ``stream``'s relayed connection (when it is one):
        charged when asked, so that pulls and probes at once share the budget."""
        conn = relayed_connection(stream)
        if conn is not None:
            self._relayed_asked[conn] = self._relayed_asked.get(conn, 0) + nbytes
            peer = getattr(stream, "remote_peer", None)
            if isinstance(peer, str):
                self.tell_pull_limit(peer)

    def pull_limit(self, peer: str) -> int | None:
        """The KV bytes still to be asked of ``peer`` when it is reached only through relays:
        the most any of its relayed connections has left (a new stream may take any of them);
        None when a direct connection exists, or none at all."""
        host = self._ctx.host
        conns = host.relayed_connections(peer) if isinstance(host, Host) else []
        if not conns:
            return None
        return max(max(0, RELAYED_KV_BYTES - self._relayed_asked.get(c, 0)) for c in conns)

    def tell_pull_limit(self, peer: str) -> None:
        """Tell the core ``peer``'s bound (``PullLimit``) when it changed, so that it plans
        pulls that fit rather than ones the budget would cut short."""
        if self._ctx.options.kv_pull is None or self._ctx.core is None:
            return
        limit = self.pull_limit(peer)
        if self._limits_told.get(peer) == limit:
            return
        if limit is None:
            del self._limits_told[peer]
        else:
            self._limits_told[peer] = limit
        self._ctx.feed(PullLimit(PeerId(peer), limit))

    def refresh_pull_limits(self) -> None:
        """Check the bounded peers' bounds again (at most every ``PULL_LIMIT_REFRESH_S``): a
        direct connection opened, or the relayed ones closed."""
        now = trio.current_time()
        if now - self._limits_checked_at < PULL_LIMIT_REFRESH_S:
            return
        self._limits_checked_at = now
        for peer in list(self._limits_told):
            self.tell_pull_limit(peer)

    async def link_event_loop(self, events: trio.MemoryReceiveChannel[PeerEvent]) -> None:
        """A peer connected or went: its bound as it stands now (``tell_pull_limit``)."""
        async for ev in events:
            if ev.kind in ("connected", "disconnected", "unresponsive"):
                self.tell_pull_limit(ev.peer_id)

    # ------------------------------------------------------------------ probes

    async def probe(self, eff: ProbeLink) -> None:
        """Fetch ``eff.nbytes`` of filler from the peer and report the transfer (bounded by
        ``MAX_KV_FILLER_BYTES``); a failure reports nothing (the core asks again later)."""
        ctx = self._ctx
        host = ctx.host
        assert host is not None
        nbytes = max(1, min(eff.nbytes, MAX_KV_FILLER_BYTES))
        received = [0]
        asked = [nbytes]

        async def exchange(use: StreamUse) -> KvPullDone | None:
            budget = self._relayed_budget(use.stream)
            if budget is not None:
                asked[0] = min(nbytes, budget)
                if asked[0] <= 0:
                    use.keep()
                    return None
                self._charge(use.stream, asked[0])
            await use.stream.send(encode(KvPullRequest("", (), asked[0])), timeout=PULL_FRAME_TIMEOUT_S)
            await _widen(use.stream)  # measured as a pull moves
            while True:
                msg = decode(await use.stream.receive(timeout=PULL_FRAME_TIMEOUT_S),
                             expected=(KvBlocks, KvPullDone))
                if isinstance(msg, KvPullDone):
                    use.keep()
                    return msg
                assert isinstance(msg, KvBlocks)
                received[0] += len(msg.filler)
                if received[0] > asked[0]:
                    raise ProtocolError(f"{eff.peer} sent more filler than asked for")

        started = trio.current_time()
        try:
            with trio.fail_after(PULL_TIMEOUT_S):
                done = await host.streams.exchange(eff.peer, KV_PROTOCOL, exchange,
                                                   timeout=PULL_FRAME_TIMEOUT_S)
        except (PeerInferError, trio.TooSlowError, trio.BrokenResourceError,
                trio.ClosedResourceError, trio.EndOfChannel) as exc:
            logger.info("link probe of %s failed: %s", eff.peer, exc)
            return
        except Exception:  # a probe runs in the node's nursery: a bug here must not end the node
            logger.exception("link probe of %s failed", eff.peer)
            return
        seconds = trio.current_time() - started
        ctx.traffic["kv-probe", "received"] += received[0]
        if done is None:
            logger.info("link probe of %s: its relayed connection carried its KV budget already", eff.peer)
            return
        if done.refused or received[0] < asked[0]:
            logger.info("link probe of %s: %s", eff.peer, done.detail or "short answer")
            return
        ctx.feed(TransferMeasured(eff.peer, received[0], seconds))


async def _widen(stream: object) -> None:
    """More receive window for a bulk answer, where the stream type offers it (a libp2p
    ``FramedStream`` does; another transport's stream may not)."""
    widen = getattr(stream, "widen_receive_window", None)
    if widen is not None:
        await widen(PULL_WINDOW_BYTES)


def _plan(
    engine: Engine, tokens: Sequence[int], target_tokens: int
) -> tuple[str, int, tuple[int, ...], int | None] | None:
    """Engine thread: (format, first block, hashes, the encoded length of a block if the engine
    says it) of the run to pull so that ``target_tokens`` of ``tokens`` are cached (never the
    block holding the prompt's last token: the engine prefills at least one), starting after
    what is cached here now; None: nothing to pull."""
    cache = engine.radix_cache
    fmt = engine.kv_format()
    if cache is None or fmt is None:
        return None
    bs = cache.block_size
    have = cache.match(tuple(tokens), touch=False).tokens // bs
    end = min(max(0, len(tokens) - 1) // bs, target_tokens // bs, have + MAX_KV_PULL_BLOCKS)
    if end <= have:
        return None
    chain = cache.hasher.chain(tokens[: end * bs])
    return fmt, have, tuple(int(h) for h in chain[have:end]), engine.encoded_block_bytes()


def _adopt(engine: Engine, tokens: Sequence[int], first_block: int, blocks: Sequence[bytes]) -> int:
    """Engine thread: adopt ``blocks`` (blocks ``first_block ..`` of ``tokens``) after the
    cached ones; the tokens cached afterwards (0 when the blocks before went meanwhile)."""
    cache = engine.radix_cache
    assert cache is not None
    bs = cache.block_size
    if cache.match(tuple(tokens[: first_block * bs]), touch=False).tokens < first_block * bs:
        return 0
    placeholders: list[bytes] = [b""] * first_block  # cached: adopt_blocks skips them
    return engine.adopt_blocks(tokens, [*placeholders, *blocks])


__all__ = [
    "MAX_KV_BLOCK_BYTES",
    "MAX_PULL_BYTES",
    "PULLS_SERVED_AT_ONCE",
    "PULL_BURST_PER_PEER",
    "PULL_FIRST_FRAME_TIMEOUT_S",
    "PULL_FRAME_TIMEOUT_S",
    "PULL_RATE_PER_PEER",
    "PULL_TIMEOUT_S",
    "PULL_WINDOW_BYTES",
    "RELAYED_KV_BYTES",
    "KvExchange",
    "PullOutcome",
]

