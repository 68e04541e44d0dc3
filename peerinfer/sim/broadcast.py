"""Gossip as a direct broadcast, the simulator's default (``SimConfig(gossip="broadcast")``).

A ``Publish``'s msgpack frame length is the bytes per recipient (``announce_wire_size``
computes it without encoding: the same number) and the announcement reaches every other
node one link delay after it was published: the recipients of each sender are grouped by equal
delay, nearest first, and a group is handed the announcement together (one ``GOSSIP`` event per
group, ``Simulation._gossip``). Each delivery may be lost with probability ``gossip_loss`` (the
pulls then repair the replicas). Without loss, each group's announcements form a shared
``AnnounceRun`` (those that change nothing, and, once it has followers, those whose changes
keep its followers in step): the nodes that follow it (each core decides) are not handed
them, and read them from the run instead (``Simulation.share_runs``; the same decisions).
``peerinfer.sim.gossip`` is the alternative, gossipsub's mesh.
"""

from __future__ import annotations

import random
from dataclasses import fields
from typing import Any

from peerinfer.core.announcerun import RunHolders
from peerinfer.core.messages import PROTOCOL_VERSION, Announce, Load, Record, encode
from peerinfer.core.node import AnnounceReceived, AnnounceRun
from peerinfer.sim.kernel import GOSSIP, SimKernel
from peerinfer.types import PeerId

__all__ = ["Broadcast", "announce_wire_size"]

_U32 = 0xFFFF_FFFF
_U64 = 0xFFFF_FFFF_FFFF_FFFF


def _int_size(v: int) -> int:
    """msgpack's bytes for an integer: the smallest of its formats that holds it."""
    if v >= 0:
        if v < 0x80:
            return 1
        if v < 0x100:
            return 2
        if v < 0x1_0000:
            return 3
        return 5 if v <= _U32 else 9 if v <= _U64 else _too_large(v)
    if v >= -32:
        return 1
    if v >= -0x80:
        return 2
    if v >= -0x8000:
        return 3
    return 5 if v >= -0x8000_0000 else 9 if v >= -(1 << 63) else _too_large(v)


def _too_large(v: int) -> int:
    raise OverflowError(f"msgpack cannot pack the integer {v}")


def _array_head(n: int) -> int:
    return 1 if n < 16 else 3 if n < 0x1_0000 else 5


def _value_size(v: Any) -> int:
    """msgpack's bytes for a value as ``encode`` packs it (``use_bin_type``), for the kinds a
    wire record holds: bool, int, float, None, str, bytes, lists and tuples of those, records."""
    t = type(v)
    if t is int:
        return _int_size(v)
    if t is bool or v is None:
        return 1
    if t is list or t is tuple:
        return _array_head(len(v)) + sum(map(_value_size, v))
    if t is str:
        n = len(v) if v.isascii() else len(v.encode("utf-8"))
        return n + (1 if n < 32 else 2 if n < 0x100 else 3 if n < 0x1_0000 else 5)
    if t is bytes:
        n = len(v)
        return n + (2 if n < 0x100 else 3 if n < 0x1_0000 else 5)
    if t is float:
        return 9
    if isinstance(v, Record):
        return _value_size(v._to_fields())
    raise TypeError(f"no msgpack size for {t.__name__}")


def _hashes_size(hs: tuple[int, ...]) -> int:
    """A list of block hashes: almost every one takes msgpack's 9-byte uint64 (one in 2**32
    is below 2**32), so the exact walk runs only when the smallest says it must."""
    n = len(hs)
    if not n:
        return 1
    if type(hs[0]) is int and min(hs) > _U32 and max(hs) <= _U64:
        # (A non-int among ints would make min/max compare it; a float packs in 9 bytes too.)
        return _array_head(n) + 9 * n
    return _value_size(hs)


#: msgpack's bytes for a non-negative integer, by its bit length (up to 64)
_UINT_SIZE = (1,) * 8 + (2,) + (3,) * 8 + (5,) * 16 + (9,) * 32
#: the sizes of the few distinct senders and speed figures (their values repeat)
_SIZE_OF: dict[object, int] = {}


def _repeated_size(v: str | tuple[int, ...]) -> int:
    size = _SIZE_OF.get(v)
    if size is None:
        if len(_SIZE_OF) >= 4096:
            _SIZE_OF.clear()
        size = _SIZE_OF[v] = _value_size(v)
    return size


#: ``Announce``'s fields as this size function lays them out; another layout falls back on
#: encoding (so a field added to the message cannot make the count silently wrong).
_ANNOUNCE_FIELDS = (
    "sender", "epoch", "prev_epoch", "root", "count", "load", "added", "removed", "truncated",
    "time_ms",
)
_LOAD_FIELDS = ("queued", "running", "slots", "speed", "scaffolds", "disk")
_FRAME_HEAD = _array_head(2 + len(_ANNOUNCE_FIELDS)) + _int_size(PROTOCOL_VERSION) + _int_size(
    Announce.TAG
)


def _announce_size(a: Announce) -> int:
    """The frame's bytes: ``encode``'s ``[version, tag, *fields]`` with ``Load._to_fields``'
    layout (the queue figures and the speed, then the scaffolds when there are scaffolds or a
    disk figure, then the disk figure), every integer non-negative (else ``_encoded_size``)."""
    load = a.load
    epoch, prev, root, count, time_ms = a.epoch, a.prev_epoch, a.root, a.count, a.time_ms
    queued, running, slots = load.queued, load.running, load.slots
    if min(epoch, prev, root, count, time_ms, queued, running, slots) < 0:
        return _encoded_size(a)
    u = _UINT_SIZE
    size = (
        _FRAME_HEAD
        + _repeated_size(a.sender)
        + u[epoch.bit_length()] + u[prev.bit_length()] + u[root.bit_length()]
        + u[count.bit_length()]
        + 1  # the load's array (at most 6 fields)
        + u[queued.bit_length()] + u[running.bit_length()] + u[slots.bit_length()]
        + _repeated_size(load.speed)
        + _hashes_size(a.added)
        + _hashes_size(a.removed)
        + 1  # truncated: a bool
        + u[time_ms.bit_length()]
    )
    if load.scaffolds or load.disk:
        size += _hashes_size(load.scaffolds)
        if load.disk:
            size += _value_size(load.disk)
    return size


def _encoded_size(a: Announce) -> int:
    return len(encode(a))


def announce_wire_size(a: Announce) -> int:
    """``len(encode(a))``, counted without building the frame (publishing counted every
    announcement's bytes by encoding it: 5% of a 64-node run). Exact for every announcement
    the core makes; tests/sim/test_broadcast_size.py compares it with encoding."""
    if type(a) is not Announce or type(a.truncated) is not bool or not _ANNOUNCE_LAYOUT:
        return _encoded_size(a)
    try:
        return _announce_size(a)
    except (AttributeError, IndexError, TypeError):  # a value that is no u64 (bit_length)
        return _encoded_size(a)


_ANNOUNCE_LAYOUT = (
    tuple(f.name for f in fields(Announce)) == _ANNOUNCE_FIELDS
    and Announce.OPTIONAL_TAIL == 0
    and Announce._to_fields is Record._to_fields
    and tuple(f.name for f in fields(Load)) == _LOAD_FIELDS
)


class Broadcast:
    """A run's direct broadcast; it adds to the kernel's anti-entropy figures (``announces``,
    ``announce_bytes``, ``announce_deliveries``, ``announces_lost``)."""

    def __init__(self, sim: SimKernel, n: int, *, share_runs: bool, index_runs: bool = True) -> None:
        """``n``: the run's node slots; ``share_runs``: hand unchanged announcements to their
        followers as one shared run; ``index_runs``: index the runs' sets by block for every
        node's routing (``RunHolders``; the same decisions)."""
        self.sim = sim
        self.share_runs = share_runs
        #: every run's set, indexed once per change for every node's routing
        self.run_holders = RunHolders() if index_runs else None
        self._loss_rng = random.Random(f"{sim.config.seed}:loss")
        self._loss = sim.config.gossip_loss
        delay = sim.delay
        # Gossip recipients of each sender, grouped by equal delay, nearest first.
        self._groups: list[list[tuple[float, list[int]]]] = []
        for s in range(n):
            by_delay: dict[float, list[int]] = {}
            for r in range(n):
                if r != s:
                    by_delay.setdefault(delay[s][r], []).append(r)
            self._groups.append(sorted(by_delay.items()))
        #: announcements with changes pushed onto a run with followers (``_shared_run``)
        self.changes_shared = 0
        # Per sender and group, the run of announcements the group shares (below).
        self._runs_of: list[list[AnnounceRun | None]] = [[None] * len(g) for g in self._groups]

    def publish(self, n: int, announce: Announce, now: float) -> None:
        """Node ``n`` publishes ``announce``: its first group's delivery is scheduled."""
        sim = self.sim
        size = announce_wire_size(announce)
        recipients = sim.config.nodes - 1
        sim.announces += 1
        sim.announce_bytes += size * recipients
        sim.announce_deliveries += recipients
        if recipients:
            # The event a recipient is handed is made where one is handed it (``deliver``):
            # with shared runs most groups hand it to nobody.
            sim.push(now + self._groups[n][0][0], GOSSIP, n, sim.peer_ids[n], announce, 0, now)

    def deliver(self, item: tuple[Any, ...], now: float) -> None:
        """A ``GOSSIP`` event: the announcement reaches one group, and the next is scheduled."""
        sim = self.sim
        _, _, _, s, sender, a, g, sent = item
        groups = self._groups[s]
        cores = sim.cores
        loss = self._loss
        recipients = groups[g][1]
        if not loss and self.share_runs:
            ev, recipients = self._shared_run(s, g, sender, a, recipients, now)
        else:
            ev = AnnounceReceived(sender, a)
        for r in recipients:
            if loss and self._loss_rng.random() < loss:
                sim.announces_lost += 1
                continue
            effects = cores[r].handle(ev, now)
            if effects:
                sim.execute(r, effects, now)
        g += 1
        if g < len(groups):
            sim.push(sent + groups[g][0], GOSSIP, s, sender, a, g, sent)

    def _shared_run(
        self, s: int, g: int, sender: PeerId, a: Announce, recipients: list[int], now: float
    ) -> tuple[AnnounceReceived | None, list[int]]:
        """The group's shared run with ``a`` in it: the event that hands it to the recipients that
        do not follow the run (None: every one follows it), and those recipients (the
        followers take it from the run when they next read; ``AnnounceRun``). Lossless
        gossip only: a loss is drawn per recipient. An announcement with changes extends a run
        that has followers when its delta leads the run's set to the announced one
        (``AnnounceRun.advances``); the followers it would put over their replica allowance
        are handed it first, alone (they refuse it and leave the run, nothing else)."""
        runs = self._runs_of[s]
        run = runs[g]
        over: list[PeerId] = []
        if run is not None and run.extends(a):
            run.push(a, now)
        elif run is not None and run.followers and (after := run.advances(
            a,
            # another reader of the delta's result: a later group, or a recipient handed ``a``
            # (one that does not follow; those over their allowance refuse it unread)
            g + 1 < len(self._groups[s]) or len(run.followers) < len(recipients),
        )) is not None:
            over = run.over_limit(a)
            if over:
                alone = AnnounceReceived(sender, a)
                sim = self.sim
                cores = sim.cores
                index_of = sim.index_of
                for peer in over:
                    r = index_of[peer]
                    effects = cores[r].handle(alone, now)
                    if effects:
                        sim.execute(r, effects, now)
                    if peer in run.followers:  # (a core that stayed would be a bug)
                        raise AssertionError(f"{peer} follows a run over its allowance")
            run.push_changes(a, now, after)
            self.changes_shared += 1
        else:
            run = runs[g] = AnnounceRun(a, now, self.run_holders)
            return AnnounceReceived(sender, a, run), recipients
        followers = run.followers
        if len(followers) == len(recipients):
            return None, []  # every one follows (only the group's recipients can)
        if followers or over:
            ids = self.sim.peer_ids
            handed = set(over)
            recipients = [r for r in recipients if ids[r] not in followers and ids[r] not in handed]
            if not recipients:
                return None, []
        return AnnounceReceived(sender, a, run), recipients
