"""Announcements: this node's own (its digest's epochs, published on a schedule), the ones it
receives (checked, applied to the sender's replica, or left to wait in the peer view) and the
pulls that repair a replica an announcement could not (see "Announce" and "Pull" in
``peerinfer.core.node``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from peerinfer.core.antientropy import Reconciliation
from peerinfer.core.digest import LocalDigest
from peerinfer.core.index import PeerIndex
from peerinfer.core.messages import Announce, Load
from peerinfer.core.node.config import NodeConfig
from peerinfer.core.node.events import (
    Effect,
    Publish,
    SendSyncRequest,
    SyncFailed,
    SyncResponseReceived,
)
from peerinfer.core.peerview import AnnounceRun, PeerView
from peerinfer.errors import ProtocolError
from peerinfer.types import PeerId

__all__ = ["Announcing"]

#: ``Announce``'s fields in the order ``_make_announce`` takes them
_ANNOUNCE_FIELDS = (
    "sender", "epoch", "prev_epoch", "root", "count", "load", "added", "removed", "truncated",
    "time_ms",
)


def _announce_maker() -> Callable[..., Announce]:
    """A function that makes an ``Announce`` from its fields, in order, equal to
    ``Announce(*values)``, without the frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` call per field: twice the cost, at every announcement a node
    makes): the object is made empty and each slot set through its descriptor. ``Announce``
    itself when it is not a frozen slotted dataclass of exactly ``_ANNOUNCE_FIELDS`` without
    ``__post_init__``."""
    try:
        if (
            tuple(f.name for f in fields(Announce)) != _ANNOUNCE_FIELDS
            or getattr(Announce, "__slots__", None) != _ANNOUNCE_FIELDS
            or hasattr(Announce, "__post_init__")
        ):
            return Announce
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9 = (
            vars(Announce)[name].__set__ for name in _ANNOUNCE_FIELDS
        )
    except (TypeError, KeyError, AttributeError):  # pragma: no cover - another layout
        return Announce
    new = object.__new__

    def make(sender: PeerId, epoch: int, prev_epoch: int, root: int, count: int, load: Load,
             added: tuple[int, ...], removed: tuple[int, ...], truncated: bool,
             time_ms: int) -> Announce:
        a = new(Announce)
        s0(a, sender)
        s1(a, epoch)
        s2(a, prev_epoch)
        s3(a, root)
        s4(a, count)
        s5(a, load)
        s6(a, added)
        s7(a, removed)
        s8(a, truncated)
        s9(a, time_ms)
        return a

    return make


_make_announce = _announce_maker()


@dataclass(slots=True)
class _Pull:
    """What this node knows of a member's announcements, and its pull session (one at a time)."""

    last_announce_epoch: int = 0
    announced_root: int = 0
    sync: Reconciliation | None = None
    sync_session: int = 0
    sync_deadline: float = 0.0
    sync_target_epoch: int = 0
    sync_attempt: int = 0
    pull_wanted: bool = False


class Announcing:
    """This node's digest and announcement schedule; per member, its announced epoch and root
    and its pull; the epochs heard from every sender (members or not, bounded); the refusals to
    report. Reads and writes the peer index through the peer ``view``."""

    def __init__(self, config: NodeConfig, view: PeerView, *, epoch_base: int, now: float) -> None:
        self.config = config
        self._view = view
        self.local = LocalDigest(epoch_base=epoch_base)
        self._pulls: dict[PeerId, _Pull] = {}
        #: whether some member may have a pull running
        self._pulls_may_run = False
        self.next_announce = now
        self._last_announce = -1e18
        self._next_session = 1
        self._last_epochs: dict[PeerId, int] = {}
        #: (peer, reason) pairs already reported, and those not yet taken by the shell
        self._refusals_seen: dict[tuple[PeerId, str], None] = {}
        self._refusals: list[tuple[PeerId, str, str]] = []
        self.stats = dict.fromkeys(
            (
                "announces_sent",
                "announces_refused",
                "announces_unverified",
                "replicas_emptied",
                "syncs_started",
                "syncs_converged",
                "syncs_failed",
            ),
            0,
        )

    # ------------------------------------------------------------------ members

    def join(self, peer: PeerId) -> None:
        self._pulls[peer] = _Pull()

    def leave(self, peer: PeerId) -> None:
        del self._pulls[peer]

    def members(self) -> set[PeerId]:
        """The peers this part keeps state for (the node's members: ``check_invariants``)."""
        return set(self._pulls)

    def pull_idle(self, peer: PeerId) -> bool:
        """Whether ``peer`` is a member with no pull running or wanted."""
        st = self._pulls.get(peer)
        return st is not None and st.sync is None and not st.pull_wanted

    def check_invariants(self) -> None:
        """Pulls run only in sessions handed out, with a deadline the node's next tick sees;
        the tables kept for non-members stay bounded."""
        for peer, st in self._pulls.items():
            if st.sync is not None:
                assert self._pulls_may_run, f"a pull of {peer} runs unseen by the deadlines"
                assert 0 < st.sync_session < self._next_session, f"pull session of {peer}"
        bound = 4 * self.config.max_peers
        assert len(self._last_epochs) <= bound and len(self._refusals_seen) <= bound, \
            "per-sender tables unbounded"
        assert len(self._refusals) <= 1024, "refusals to report unbounded"

    # ------------------------------------------------------------------ our announcements

    def due(self, now: float) -> bool:
        """Whether an announcement is due: the interval passed, or a change waits and the
        minimum gap since the last one passed."""
        if now >= self.next_announce:
            return True
        return (
            self.local.has_pending_changes()
            and now >= self._last_announce + self.config.min_announce_gap_s
        )

    def publish(self, now: float, load: Load, me: PeerId) -> Publish:
        """Seal the digest's epoch and announce it with ``load`` (``due`` said so)."""
        prev_epoch, epoch, root, count, added, removed, truncated = self.local.seal()
        self._last_announce = now
        self.next_announce = now + self.config.announce_interval_s
        self.stats["announces_sent"] += 1
        return Publish(
            _make_announce(me, epoch, prev_epoch, root, count, load, added, removed, truncated,
                           max(0, int(now * 1000)))
        )

    def announce_soon(self, now: float) -> None:
        """Announce again one gap from now rather than a whole interval later (a new member
        holds no digest of ours)."""
        self.next_announce = min(self.next_announce, now + self.config.min_announce_gap_s)

    def deadlines(self) -> list[float]:
        """When the schedule and the running pulls next need a tick."""
        out = [self.next_announce]
        if self.local.has_pending_changes():
            out.append(self._last_announce + self.config.min_announce_gap_s)
        if self._pulls_may_run:
            for st in self._pulls.values():
                if st.sync is not None:
                    out.append(st.sync_deadline)
        return out

    def next_deadline(self, floor: float) -> float:
        """``min(floor, *self.deadlines())``, without the list."""
        deadline = self.next_announce if self.next_announce < floor else floor
        if self.local.has_pending_changes():
            gap = self._last_announce + self.config.min_announce_gap_s
            if gap < deadline:
                deadline = gap
        if self._pulls_may_run:
            for st in self._pulls.values():
                if st.sync is not None and st.sync_deadline < deadline:
                    deadline = st.sync_deadline
        return deadline

    # ------------------------------------------------------------------ refusals

    def refuse(self, peer: PeerId, reason: str, detail: str) -> None:
        self.stats["announces_refused"] += 1
        key = (peer, reason)
        seen = self._refusals_seen
        if key in seen:
            return
        seen[key] = None
        if len(seen) > 4 * self.config.max_peers:
            del seen[next(iter(seen))]
        if len(self._refusals) < 1024:
            self._refusals.append((peer, reason, detail))

    def refuse_unverified(self, peer: PeerId) -> None:
        """Refuse an announcement from a non-member."""
        self.stats["announces_unverified"] += 1
        self.refuse(peer, "not a member", "it has not answered this node directly yet")

    def take_refusals(self) -> list[tuple[PeerId, str, str]]:
        out, self._refusals = self._refusals, []
        return out

    # ------------------------------------------------------------------ receiving

    def accept_epoch(self, sender: PeerId, a: Announce) -> bool:
        """Refuse a member's announcement whose epoch is not newer than the last one seen from
        it (stale or replayed), else remember it as the member's announced epoch and root."""
        last_epoch = self._last_epochs.get(sender, 0)
        if a.epoch <= last_epoch:
            self.refuse(sender, "stale epoch", f"epoch {a.epoch} <= {last_epoch} (a replay?)")
            return False
        self._remember_epoch(sender, a.epoch)
        st = self._pulls[sender]
        st.last_announce_epoch = a.epoch
        st.announced_root = a.root
        return True

    def last_epoch(self, sender: PeerId) -> int:
        """The newest epoch seen from ``sender`` (0: none remembered)."""
        return self._last_epochs.get(sender, 0)

    def heard_through_run(self, peer: PeerId, run: AnnounceRun) -> None:
        """What receiving each of a followed run's announcements does here at once."""
        st = self._pulls[peer]
        st.last_announce_epoch = run.epoch
        st.announced_root = run.root
        self._remember_epoch(peer, run.epoch)

    def apply(
        self, sender: PeerId, a: Announce, index: PeerIndex, now: float, effects: list[Effect]
    ) -> None:
        """Apply ``sender``'s accepted announcement to its replica in ``index`` (the peer view's
        answer to ``offer``): refuse a claim over its allowance, empty a replica grown past it,
        record load and freshness, and pull when the root still differs."""
        replica = index.add_peer(sender)
        refused = replica.refused
        needs_pull = replica.apply_announce(
            a.prev_epoch, a.epoch, a.root, a.count, a.added, a.removed, a.truncated
        )
        if replica.refused != refused:
            # Claims a set larger than its allowance of the replica budget.
            self.refuse(
                sender, "over its replica allowance",
                f"claims {a.count} blocks, allowance {replica.max_elements}",
            )
        if len(replica.digest) > index.allowance(sender):
            index = self._view.index  # emptying it may rebalance every peer's allowance
        if index.enforce_allowance(sender):
            self.replica_emptied(sender)
            return
        # The load, and if the replica now matches, its freshness (which also confirms the
        # speculative entries for the peer).
        index.announced(sender, a.load, now, fresh=replica.epoch == a.epoch)
        if not needs_pull:
            return
        st = self._pulls[sender]
        st.pull_wanted = True
        if st.sync is None:
            self._start_pull(sender, st, now, effects)

    def _remember_epoch(self, peer: PeerId, epoch: int) -> None:
        # Kept apart from the member state, which is dropped when a peer goes quiet, so that a
        # replay of an old announcement cannot resurrect a forgotten peer's stale digest.
        epochs = self._last_epochs
        epochs.pop(peer, None)
        epochs[peer] = epoch
        if len(epochs) > 4 * self.config.max_peers:
            del epochs[next(iter(epochs))]

    def replica_emptied(self, peer: PeerId) -> None:
        """The index emptied ``peer``'s replica (over its allowance): drop its pull."""
        self.stats["replicas_emptied"] += 1
        st = self._pulls.get(peer)
        if st is not None:
            st.sync = None
            st.pull_wanted = False

    # ------------------------------------------------------------------ pulls

    def _start_pull(self, peer: PeerId, st: _Pull, now: float, effects: list[Effect]) -> None:
        view = self._view
        replica = view.index.replica(peer)
        if replica is None:
            return
        view.leave_run(peer)  # a pull running: its announcements no longer wait
        session = self._next_session
        self._next_session += 1
        st.pull_wanted = False
        st.sync_session = session
        st.sync_deadline = now + self.config.sync_timeout_s
        st.sync_target_epoch = st.last_announce_epoch
        st.sync = replica.start_pull(
            session, st.last_announce_epoch, st.announced_root, attempt=st.sync_attempt
        )
        self._pulls_may_run = True
        self.stats["syncs_started"] += 1
        effects.append(SendSyncRequest(peer, st.sync.first_request(), self.config.sync_timeout_s))

    def on_sync_response(
        self,
        ev: SyncResponseReceived,
        now: float,
        effects: list[Effect],
        heard: Callable[[PeerId, float], None],
    ) -> None:
        """A pull's response: the next request, or the pull's end. ``heard``: the node's note
        that the peer answered (a valid response of the running session)."""
        st = self._pulls.get(ev.peer)
        if st is None or st.sync is None or ev.response.session != st.sync_session:
            return
        index = self._view.index
        if st.sync.replica is not index.replica(ev.peer):
            st.sync = None  # the replica was emptied (replica budget) while the pull ran
            return
        try:
            nxt = st.sync.handle_response(ev.response)
        except ProtocolError:
            self._finish_sync(ev.peer, st, now, ok=False, effects=effects)
            return
        if self._view.index.enforce_allowance(ev.peer):
            self.replica_emptied(ev.peer)
            return
        heard(ev.peer, now)
        if nxt is not None:
            st.sync_deadline = now + self.config.sync_timeout_s
            effects.append(SendSyncRequest(ev.peer, nxt, self.config.sync_timeout_s))
            return
        self._finish_sync(ev.peer, st, now, ok=st.sync.state == "converged", effects=effects)

    def _finish_sync(
        self, peer: PeerId, st: _Pull, now: float, *, ok: bool, effects: list[Effect]
    ) -> None:
        st.sync = None
        if ok:
            self.stats["syncs_converged"] += 1
            st.sync_attempt = 0
            self._view.index.mark_fresh(peer, now)
            self._view.index.confirm(peer, now)
        else:
            self.stats["syncs_failed"] += 1
            st.sync_attempt += 1  # the next pull uses another hash slice
        if st.pull_wanted:
            self._start_pull(peer, st, now, effects)

    def on_sync_failed(self, ev: SyncFailed, now: float, effects: list[Effect]) -> None:
        st = self._pulls.get(ev.peer)
        if st is not None and st.sync is not None and st.sync_session == ev.session:
            st.pull_wanted = False  # retry on the next announcement, not in a tight loop
            self._finish_sync(ev.peer, st, now, ok=False, effects=effects)

    def check_deadlines(self, now: float, effects: list[Effect]) -> None:
        if not self._pulls_may_run:
            return
        running = False
        for peer, st in list(self._pulls.items()):
            if st.sync is not None and st.sync_deadline <= now:
                st.pull_wanted = False
                self._finish_sync(peer, st, now, ok=False, effects=effects)
            running = running or st.sync is not None
        self._pulls_may_run = running
