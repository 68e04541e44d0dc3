"""Membership and liveness: who answered this node directly, when each was last heard, pings and
round trips (see "Membership" and "Liveness" in ``peerinfer.core.node``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from peerinfer.core.node.config import NodeConfig
from peerinfer.core.node.events import Effect, PingPeer
from peerinfer.types import PeerId

__all__ = ["FollowedRecord", "Members"]


class _Run(Protocol):
    @property
    def length(self) -> int: ...

    @property
    def at(self) -> float: ...


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
    last_ping: float = -1e18


class Members:
    """The members (peers that answered this node directly and were not forgotten since), when
    each was last heard and pinged, and their smoothed round trips."""

    __slots__ = ("config", "_members", "rtt", "rtt_version", "_ping_asked", "_liveness_due")

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
        self._members[peer] = _Member(last_seen=now)
        self._liveness_due = -math.inf
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
    ) -> None:
        """Ping the members silent for ``ping_after_s`` (not pinged lately), and have the node
        ``forget`` those silent for ``peer_timeout_s``, in member order. ``followed``: the
        records of the peers whose shared runs the node follows (``PeerView.following``), if it
        follows any: a member whose run moved since the node last looked was last heard at the
        run's newest announcement (``run.at``). Read per member in the loop, not gathered into
        a dict of the moved ones first: every node visits every member about once a second."""
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
