"""Membership and liveness: who answered this node directly, when each was last heard, pings and
round trips (see "Membership" and "Liveness" in ``peerinfer.core.node``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar, Protocol

from peerinfer.core.node.config import NodeConfig
from peerinfer.core.node.events import Effect, PingPeer
from peerinfer.types import PeerId

__all__ = ["FollowedRecord", "Members", "RunClock"]


class _Run(Protocol):
    @property
    def length(self) -> int: ...

    @property
    def at(self) -> float: ...

    @property
    def sender(self) -> str: ...


class RunClock(Protocol):
    """The shell's record of its shared runs by their newest announcement's time
    (``peerinfer.core.announcerun.RunHolders``), where every run the node follows is listed."""

    def stale(self, before: float) -> Sequence[_Run]: ...


class FollowedRecord(Protocol):
    """What the liveness loop reads of a followed peer's record (``peerinfer.core.peerview``'s
    ``_Kept``): its shared run, and how far into it the node last looked."""

    @property
    def run(self) -> _Run | None: ...

    @property
    def cursor(self) -> int: ...


@dataclass(slots=True)
class _Member:
    last_seen: float
    #: the order members joined in (the loop's order: the dict's)
    seq: int = 0
    last_ping: float = -1e18


class Members:
    """The members (peers that answered this node directly and were not forgotten since), when
    each was last heard and pinged, and their smoothed round trips."""

    __slots__ = ("config", "_members", "rtt", "rtt_version", "_ping_asked", "_liveness_due",
                 "_joined", "_marked")

    #: test hook: each check that reads the run clock also runs the loop over every member
    #: (on copies) and requires the same pings and forgets (``tests/sim/test_sim_lazy.py``)
    check_clock: ClassVar[bool] = False
    #: how many checks read the run clock (``clock_checks``), and the members they visited for
    #: a stale run (``clock_stale_visits``), for those tests: it ran. Counted on an object, not
    #: as class attributes: CPython drops what it specialized for a class's attribute reads
    #: (its instances' too) whenever an attribute of the class is written, here every tick.
    counts: ClassVar[SimpleNamespace] = SimpleNamespace(clock_checks=0, clock_stale_visits=0)

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._members: dict[PeerId, _Member] = {}
        #: smoothed round trips per member
        self.rtt: dict[PeerId, float] = {}
        #: grows whenever ``rtt`` changes (the index keeps peers in rtt order for routing)
        self.rtt_version = 0
        #: when we last asked the shell to ping a non-member (bounded, oldest forgotten)
        self._ping_asked: dict[PeerId, float] = {}
        #: no member can be due for a ping or be forgotten before this time (``check`` skips
        #: its loop until then)
        self._liveness_due = -math.inf
        self._joined = 0
        #: members joined or marked gone since the last check (the clock's check visits them)
        self._marked: set[PeerId] = set()

    def __contains__(self, peer: object) -> bool:
        return peer in self._members

    def __iter__(self) -> Iterator[PeerId]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def join(self, peer: PeerId, now: float) -> bool:
        """Make ``peer`` a member (heard at ``now``) if it is not one; True if it is new."""
        if peer in self._members:
            return False
        self._joined += 1
        self._members[peer] = _Member(last_seen=now, seq=self._joined)
        self._liveness_due = -math.inf
        self._marked.add(peer)
        return True

    def leave(self, peer: PeerId) -> None:
        del self._members[peer]
        self.rtt.pop(peer, None)
        self.rtt_version += 1

    def heard(self, peer: PeerId, at: float) -> None:
        """``peer`` (a member) was heard from at ``at``."""
        self._members[peer].last_seen = at

    def mark_gone(self, peer: PeerId) -> None:
        """``peer`` may be gone: it is due for a ping, and forgotten unless heard from again."""
        self._members[peer].last_seen = -1e18
        self._liveness_due = -math.inf
        self._marked.add(peer)

    def note_rtt(self, peer: PeerId, rtt_s: float) -> None:
        # Smoothed like TCP's SRTT so one slow ping does not swing routing.
        old = self.rtt.get(peer)
        self.rtt[peer] = rtt_s if old is None else 0.8 * old + 0.2 * rtt_s
        self.rtt_version += 1

    def ask_ping(self, peer: PeerId, now: float, effects: list[Effect]) -> None:
        """Ask the shell to ping a non-member (it will, over a direct connection only)."""
        asked = self._ping_asked
        last = asked.get(peer)
        if last is not None and now - last < self.config.ping_after_s:
            return
        asked.pop(peer, None)
        asked[peer] = now
        if len(asked) > 4 * self.config.max_peers:
            del asked[next(iter(asked))]
        effects.append(PingPeer(peer))

    def forget_ping_ask(self, peer: PeerId) -> None:
        self._ping_asked.pop(peer, None)

    def check_invariants(self) -> None:
        """Round trips are kept for members only, and the ping requests stay bounded."""
        assert set(self.rtt) <= set(self._members), "a round trip kept for a non-member"
        assert len(self._ping_asked) <= 4 * self.config.max_peers, "ping requests unbounded"

    def check(
        self,
        now: float,
        effects: list[Effect],
        *,
        forget: Callable[[PeerId], None],
        followed: Mapping[PeerId, FollowedRecord] | None,
        clock: RunClock | None = None,
    ) -> None:
        """Ping the members silent for ``ping_after_s`` (not pinged lately), and have the node
        ``forget`` those silent for ``peer_timeout_s``, in member order. ``followed``: the
        records of the peers whose shared runs the node follows (``PeerView.following``), if it
        follows any: a member whose run moved since the node last looked was last heard at the
        run's newest announcement (``run.at``). Read per member in the loop, not gathered into
        a dict of the moved ones first: every node visits every member about once a second.

        ``clock``: where every run the node follows is listed by its newest announcement's
        time (``PeerView.run_clock``), the check visits only the members that can be due
        (``_check_by_clock``), not every member."""
        if clock is not None and followed:
            self._check_by_clock(now, effects, forget, followed, clock)
            return
        self._marked.clear()
        if now < self._liveness_due:
            return
        cfg = self.config
        # The earliest time any peer can be due again (peers are only heard later; a -1e18
        # "gone" mark or a new peer resets it to -inf meanwhile): the loop is skipped until then.
        self._liveness_due = due = math.inf
        ping_after, timeout = cfg.ping_after_s, cfg.peer_timeout_s
        # Forgetting a member in the loop changes no other member's run (it leaves its own).
        record_of = followed.get if followed else None
        for peer, st in list(self._members.items()):
            last_seen = st.last_seen
            if record_of is not None:
                record = record_of(peer)
                if record is not None:
                    run = record.run
                    if run is not None and run.length != record.cursor:
                        last_seen = run.at
            silent = now - last_seen
            if silent >= timeout:
                forget(peer)
                continue
            if silent >= ping_after and now - st.last_ping >= ping_after:
                st.last_ping = now
                effects.append(PingPeer(peer))
            # Due again at the first of: forgotten, or pinged (silent, and not pinged lately).
            last_ping = st.last_ping
            nxt = (last_seen if last_seen > last_ping else last_ping) + ping_after
            if last_seen + timeout < nxt:
                nxt = last_seen + timeout
            if nxt < due:
                due = nxt
        # A margin: ``now - last_seen >= limit`` may hold a rounding error before the sum.
        if due < math.inf:
            due -= 1e-6 * (1.0 + abs(due))
        self._liveness_due = min(self._liveness_due, due)

    def _check_by_clock(
        self,
        now: float,
        effects: list[Effect],
        forget: Callable[[PeerId], None],
        followed: Mapping[PeerId, FollowedRecord],
        clock: RunClock,
    ) -> None:
        """``check``, visiting only the members that can be due: those the node does not
        follow through a run, those joined or marked gone since the last check, and those
        whose followed run is stale (its newest announcement at least the smaller limit
        old: ``RunClock.stale``). A followed member was last heard at its run's newest time or
        later (the node reads ``run.at`` while the run moved, and took that time in when it
        last caught up: ``PeerView._catch_up``; a member heard directly since only later), so
        one whose run is newer is neither silent for ``ping_after_s`` nor for
        ``peer_timeout_s``. The loop's skip until its computed due time
        (``_liveness_due``) skips only checks where no member is due, so visiting every
        member that can be due at every check acts as it does (``check_clock`` cross-checks
        that)."""
        cfg = self.config
        ping_after, timeout = cfg.ping_after_s, cfg.peer_timeout_s
        smaller = ping_after if ping_after < timeout else timeout
        # (the margin: ``now - last_seen >= limit`` may hold a rounding error before the sum)
        before = now - smaller + 1e-6 * (1.0 + abs(now))
        members = self._members
        if Members.check_clock:
            assert followed.keys() <= members.keys(), "a followed peer that is not a member"
        # The node follows only members' runs (it follows a run from a member's announcement,
        # and leaves a peer's run before forgetting it), so as many followed as members are
        # every member: none is visited for not being followed (nearly every check of a
        # swarm in steady state), without the set difference over every member.
        due: set[PeerId] = (
            set() if len(followed) == len(members) else members.keys() - followed.keys()
        )
        if self._marked:
            due |= self._marked & members.keys()
            self._marked.clear()
        record_of = followed.get
        for stale in clock.stale(before):
            peer = PeerId(stale.sender)
            record = record_of(peer)
            if record is not None and record.run is stale and peer in members:
                due.add(peer)
                Members.counts.clock_stale_visits += 1
        Members.counts.clock_checks += 1
        expected: list[tuple[PeerId, bool]] | None = None
        if Members.check_clock:
            expected, every_due = self._loop_actions(now, followed)
        acted: list[tuple[PeerId, bool]] = []
        self._liveness_due = math.inf
        for peer in sorted(due, key=lambda p: members[p].seq) if len(due) > 1 else due:
            st = members.get(peer)
            if st is None:
                continue
            last_seen = st.last_seen
            record = record_of(peer)
            if record is not None:
                run = record.run
                if run is not None and run.length != record.cursor:
                    last_seen = run.at
            silent = now - last_seen
            if silent >= timeout:
                acted.append((peer, True))
                forget(peer)
                continue
            if silent >= ping_after and now - st.last_ping >= ping_after:
                acted.append((peer, False))
                st.last_ping = now
                effects.append(PingPeer(peer))
        if expected is not None:
            assert acted == expected, f"liveness by the clock {acted} != the loop's {expected}"
            self._liveness_due = min(self._liveness_due, every_due)
        else:
            # (the loop, if a later check runs it, starts over)
            self._liveness_due = -math.inf

    def _loop_actions(
        self, now: float, followed: Mapping[PeerId, FollowedRecord]
    ) -> tuple[list[tuple[PeerId, bool]], float]:
        """What ``check``'s loop would do now, changing nothing: the members it would forget
        (True) or ping (False), in order, and the time it would skip to (for ``check_clock``)."""
        if now < self._liveness_due:
            return [], self._liveness_due
        cfg = self.config
        ping_after, timeout = cfg.ping_after_s, cfg.peer_timeout_s
        due = math.inf
        out: list[tuple[PeerId, bool]] = []
        for peer, st in self._members.items():
            last_seen = st.last_seen
            record = followed.get(peer)
            if record is not None:
                run = record.run
                if run is not None and run.length != record.cursor:
                    last_seen = run.at
            silent = now - last_seen
            if silent >= timeout:
                out.append((peer, True))
                continue
            last_ping = st.last_ping
            if silent >= ping_after and now - last_ping >= ping_after:
                out.append((peer, False))
                last_ping = now
            nxt = (last_seen if last_seen > last_ping else last_ping) + ping_after
            if last_seen + timeout < nxt:
                nxt = last_seen + timeout
            if nxt < due:
                due = nxt
        if due < math.inf:
            due -= 1e-6 * (1.0 + abs(due))
        return out, due

