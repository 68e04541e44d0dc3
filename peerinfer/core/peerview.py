"""The peer view: the peer index as a node reads it, with the announcements it has received but
not yet taken in (lazy announcements, and the runs a simulator shares between recipients).

See "Pull" in ``peerinfer.core.node`` for why announcements that change nothing may wait.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from peerinfer.core.antientropy import Replica
from peerinfer.core.messages import Announce, Load
from peerinfer.types import PeerId


class AnnounceRun:
    """One sender's announcements that change nothing, as a shell hands them to a group of
    recipients at one time (the simulator: all recipients at one link delay), shared by them.

    A run starts with one announcement (``length`` 1); ``push`` appends one that ``extends``
    it: no change, chaining from the run's newest epoch, announcing the same root and count.
    Each recipient still decides for itself: one that kept the run's newest announcement for
    later (``NodeCore._defer_unchanged``) *follows* the run (it joins ``followers``), and the
    shell then stops handing it the run's announcements. It takes in those pushed since it
    last looked (their number, the newest ``epoch``, ``load`` and arrival time ``at``) when it
    next reads the sender's state, exactly as if it had been handed each; it leaves the run
    as soon as taking the next one in at once could do more than that (a pull, a rebalance,
    a replica emptied or replaced, the sender forgotten). Every recipient outside
    ``followers`` is handed every announcement, with the run, as usual.

    Why: with N nodes, each announcement otherwise costs N - 1 calls, although nearly all of
    them change nothing; a shared run costs one ``push`` plus the recipients that do not follow.
    """

    __slots__ = ("sender", "root", "count", "epoch", "load", "at", "length", "followers")

    def __init__(self, announce: Announce, at: float) -> None:
        self.sender = announce.sender
        self.root = announce.root
        self.count = announce.count
        self.epoch = announce.epoch
        self.load = announce.load
        self.at = at
        self.length = 1
        self.followers: set[PeerId] = set()

    def extends(self, a: Announce) -> bool:
        """Whether ``a`` may be pushed: it changes nothing since the run's newest one."""
        return (
            a.prev_epoch == self.epoch < a.epoch
            and a.root == self.root
            and a.count == self.count
            and a.sender == self.sender
            and not (a.added or a.removed or a.truncated)
            # (a recipient notes another speed or slot count when it is handed one)
            and a.load.slots == self.load.slots
            and a.load.speed == self.load.speed
        )

    def push(self, a: Announce, at: float) -> None:
        """Append ``a`` (which ``extends`` the run), delivered to the group at ``at``."""
        self.epoch = a.epoch
        self.load = a.load
        self.at = at
        self.length += 1


@dataclass(slots=True)
class _Kept:
    """One peer's announcements that change nothing, kept for later (``_defer_unchanged``).

    ``times`` of them are not taken in yet (0: none), the newest at ``epoch`` with ``load``,
    heard at ``at``. The check that let them wait stays true while the peer's replica is the
    same object at the same epoch with the same flat summary (``replica_epoch``, ``summary``)
    and the announcements keep announcing ``root`` and ``count``: then the next one may wait
    without checking the digest again. While the node follows a shared ``run`` of the peer's
    announcements, ``cursor`` is the run's length when it last took the run's newest ones.
    """

    replica: Replica
    summary: tuple[int, int]
    replica_epoch: int
    root: int
    count: int
    epoch: int
    load: Load
    at: float
    times: int = 0
    run: AnnounceRun | None = None
    cursor: int = 0




class _Heard(Mapping[PeerId, tuple[Load, float]]):
    """What routing reads of the announcements a node received and has not taken in, per
    peer: the newest load and arrival time, from its followed run if that moved since the
    node last looked (newer), else from its kept announcement. A view, read per peer asked
    (routing asks only the peers it considers), not a dict built per decision."""

    __slots__ = ("_following", "_unapplied")

    def __init__(self, following: dict[PeerId, _Kept], unapplied: dict[PeerId, _Kept]) -> None:
        self._following, self._unapplied = following, unapplied

    def get(self, peer: PeerId, default: object = None) -> Any:
        kept = self._following.get(peer)
        if kept is not None:
            run = kept.run
            if run is not None and run.length != kept.cursor:
                return run.load, run.at
        kept = self._unapplied.get(peer)
        if kept is not None:
            return kept.load, kept.at
        return default

    def __getitem__(self, peer: PeerId) -> tuple[Load, float]:
        news = self.get(peer)
        if news is None:
            raise KeyError(peer)
        return news  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[PeerId]:
        return (p for p in {**self._unapplied, **self._following} if self.get(p) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return bool(self._following or self._unapplied)
