"""The node's trust chores: audits run at low priority, bans enforced, reputation kept on disk.

The decisions (what to audit, whom to ban, for how long, who is a candidate) are the core's
(``peerinfer.core.reputation`` and ``NodeCore``); this component only executes them for a
running ``Node``, through its :class:`~peerinfer.node.context.NodeContext`:

* **Audits.** ``AuditForward`` effects wait in a bounded queue (``MAX_PENDING_AUDITS``; beyond it
  the oldest is dropped, never a client's work). One task runs them, each only once the local
  engine has had nothing queued or running for a moment (``AUDIT_IDLE_S``, at most
  ``AUDIT_MAX_WAIT_S`` of waiting, after which it runs anyway between two decode steps: the
  engine lock is taken per step, so a client waits at most one audit pass). The verdict goes
  back to the core as ``AuditFinished``; an engine that cannot audit sends nothing.
* **Bans.** ``BanPeer``: the host disconnects the peer and refuses it (``Host.ban``) until the
  core's deadline, then lets it back in (its reputation still low: probation).
* **Persistence.** The score table is saved as small JSON next to the identity key
  (``reputation.json``; written atomically every ``SAVE_INTERVAL_S`` and at shutdown) and
  loaded at start, so a liar is not forgiven by a restart; bans still running are re-applied.
  A node with a throwaway identity keeps no file.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import trio

from peerinfer.core.node import AuditFinished, AuditForward, BanPeer, NodeCore
from peerinfer.core.reputation import Reputation
from peerinfer.engine.audit import AuditVerdict, audit_answer
from peerinfer.net import HostConfig
from peerinfer.node.context import NodeContext
from peerinfer.types import PeerId

logger = logging.getLogger("peerinfer.trust")

MAX_PENDING_AUDITS = 32
AUDIT_IDLE_S = 0.05
AUDIT_MAX_WAIT_S = 10.0
SAVE_INTERVAL_S = 30.0
REPUTATION_FILE = "reputation.json"


class TrustKeeper:
    """Executes a node's audit and ban effects and persists its reputation table."""

    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self._pending: collections.deque[AuditForward] = collections.deque(maxlen=MAX_PENDING_AUDITS)
        self._wake = trio.Event()
        self._path: Path | None = None
        self.audits_run = 0
        self.audits_failed = 0
        self.audits_dropped = 0
        self.audits_unchecked = 0
        #: tokens the audits scored, and the engine time they took (for the cost ratio)
        self.audit_tokens = 0
        self.audit_engine_s = 0.0
        #: the engine has no way to re-score (``audit_answer`` answered None): audits are off
        self.cannot_audit = False

    # ------------------------------------------------------------------ effects

    def queue_audit(self, eff: AuditForward) -> None:
        if self.cannot_audit:
            return
        if len(self._pending) == self._pending.maxlen:
            self.audits_dropped += 1
        self._pending.append(eff)
        self._wake.set()

    async def ban(self, eff: BanPeer) -> None:
        host = self._ctx.host
        if host is None:
            return
        logger.warning("banning %s until %.0f: %s", eff.peer, eff.until, eff.reason)
        try:
            host.ban(eff.peer)
        except Exception:  # the ban is the host's; a failure there must not end the node
            logger.exception("banning %s failed", eff.peer)
        # ``until`` is on the core's clock (the node's monotonic one).
        await trio.sleep(max(0.0, eff.until - self._ctx.now()))
        core = self._ctx.core
        if core is None or not core.reputation.is_banned(eff.peer, self._ctx.now()):
            host.unban(eff.peer)

    # ------------------------------------------------------------------ persistence

    def load(self, host_config: HostConfig) -> None:
        """Load the saved table (if the identity persists) into the core; re-apply bans."""
        core = self._ctx.core
        assert core is not None
        if not host_config.persist_identity:
            return
        self._path = host_config.effective_identity_path().with_name(REPUTATION_FILE)
        now = self._ctx.now()
        try:
            data = json.loads(self._path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning("reputation file %s unreadable (%s); starting afresh", self._path, exc)
            return
        core.reputation = Reputation.from_json(
            data, now, core.config.reputation, time_offset=time.time() - now
        )
        for peer, until in core.reputation.blocked().items():
            if core.reputation.is_banned(peer, now) and self._ctx.nursery is not None:
                self._ctx.nursery.start_soon(self.ban, BanPeer(peer, until, "banned before restart"))

    def save(self) -> None:
        core, path = self._ctx.core, self._path
        if core is None or path is None:
            return
        try:
            fd, tmp = tempfile.mkstemp(prefix=".reputation-", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                offset = time.time() - self._ctx.now()  # saved on the wall clock
                json.dump(core.reputation.to_json(offset), f, separators=(",", ":"))
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("reputation not saved to %s: %s", path, exc)

    # ------------------------------------------------------------------ the task

    async def run(self) -> None:
        next_save = trio.current_time() + SAVE_INTERVAL_S
        try:
            while True:
                with trio.move_on_at(next_save):
                    while not self._pending:
                        self._wake = trio.Event()
                        await self._wake.wait()
                    eff = self._pending.popleft()
                    await self._audit(eff)
                if trio.current_time() >= next_save:
                    next_save = trio.current_time() + SAVE_INTERVAL_S
                    self.save()
        finally:
            self.save()

    async def _audit(self, eff: AuditForward) -> None:
        ctx = self._ctx
        engine, core = ctx.engine, ctx.core
        assert engine is not None and core is not None
        await _wait_engine_idle(ctx, core)
        started = time.perf_counter()
        try:
            verdict: AuditVerdict | None = await ctx.in_engine(
                audit_answer, engine, eff.tokens, eff.params, eff.completion
            )
        except Exception:  # an audit must never take serving down
            logger.exception("audit of %s failed to run", eff.peer)
            return
        self.audit_engine_s += time.perf_counter() - started
        if verdict is None:
            self.cannot_audit = True
            self._pending.clear()
            logger.info("engine %s cannot audit; forwarded answers go unchecked", type(engine).__name__)
            return
        if not verdict.checked:
            # This answer cannot be re-computed (a sampled one from a seed we do not know):
            # it counts neither way, and the peer's probation audit is still owed.
            self.audits_unchecked += 1
            return
        self.audits_run += 1
        self.audit_tokens += verdict.scored_tokens
        if not verdict.ok:
            self.audits_failed += 1
            logger.warning("audit: %s answered wrongly: %s", eff.peer, verdict.describe())
        ctx.feed(AuditFinished(eff.peer, verdict.ok, verdict.describe()))


async def _wait_engine_idle(ctx: NodeContext, core: NodeCore) -> None:
    """Until nothing has been queued or running here for ``AUDIT_IDLE_S`` (bounded by
    ``AUDIT_MAX_WAIT_S``). Woken by the core's moves (``NodeContext.wait_core_moved``), not by
    polling: only a move can make the engine busy or idle."""

    def busy() -> bool:
        stats = core.statistics()
        return bool(stats.queued or stats.running)

    with trio.move_on_after(AUDIT_MAX_WAIT_S):
        while True:
            if busy():
                await ctx.wait_core_moved()
                continue
            with trio.move_on_after(AUDIT_IDLE_S) as quiet:
                while not busy():
                    await ctx.wait_core_moved()
            if quiet.cancelled_caught:
                return  # idle all along


def reputation_line(core: NodeCore, peer: str, now: float) -> str:
    """``score standing: why`` for ``peerinfer status`` (bounded for the wire)."""
    view = core.reputation.view(PeerId(peer), now)
    return f"{view.score:+.1f} {view.why}"[:256]


__all__ = ["REPUTATION_FILE", "TrustKeeper", "reputation_line"]
