"""What a node's components share, declared in one place: :class:`NodeContext`.

Each component of a :class:`~peerinfer.node.Node` (the door, the engine worker, the forwarder,
anti-entropy, the peer keeper, the trust keeper) takes the context and uses only what it names.
``Node.serve`` fills in ``engine``, ``host``, ``core``, ``nursery`` and ``topic`` as they come
up; before that they are None (a component called then does nothing, or asserts).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from peerinfer.core.node import Event, NodeCore
from peerinfer.engine.base import Engine
from peerinfer.engine.decoder import deferred_sleeps
from peerinfer.net import NodeHost
from peerinfer.node.options import NodeOptions
from peerinfer.node.sinks import SinkTable

T = TypeVar("T")


@dataclass(eq=False)
class NodeContext:
    """The node's shared state and services, for its components."""

    options: NodeOptions
    #: Feed the core one event and execute the effects it returns (``Node._feed``).
    feed: Callable[[Event], None]
    engine: Engine | None = None
    host: NodeHost | None = None
    core: NodeCore | None = None
    #: The node's task nursery, for the tasks components start (None: not serving).
    nursery: trio.Nursery | None = None
    #: The gossip topic of our model (and swarm key).
    topic: str = ""
    #: Shutting down: no new request is taken, no spare stream opened.
    closing: bool = False
    sinks: SinkTable = field(default_factory=SinkTable)
    #: When the engine worker last completed a step (written by it; waiting requests wait as
    #: long as it moves, ``NodeCore.silence``).
    engine_progress_at: float = -math.inf
    #: Anti-entropy bytes by (kind, direction): ("announce"|"sync", "sent"|"received").
    traffic: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    #: Engines are not thread-safe: one call at a time, in a worker thread (``in_engine``).
    engine_lock: trio.Lock = field(default_factory=trio.Lock)
    #: Call the engine on trio's thread instead of a worker thread (``in_thread``). Only for
    #: tests on the in-memory network (``peerinfer.testing.memnet``) under trio's virtual
    #: clock, which jumps whenever every task waits and would not wait for a thread; the
    #: simulated engine's sleeps are then slept in virtual time after each call
    #: (``deferred_sleeps``). A real engine would block the event loop: never in production.
    inline_engine: bool = False
    #: Set (and renewed) each time the core handled an event or ticked (``note_core_moved``).
    _core_moved: trio.Event = field(default_factory=trio.Event, init=False, repr=False)

    @staticmethod
    def now() -> float:
        # Monotonic: a wall-clock step (sleep, NTP, a user) must not move any timer.
        return trio.current_time()

    @property
    def peer_id(self) -> str:
        assert self.host is not None, "the node is not running"
        return self.host.peer_id

    def note_core_moved(self) -> None:
        """The core handled an event or ticked (``Node._execute``): wake whoever waits."""
        self._core_moved.set()
        self._core_moved = trio.Event()

    async def wait_core_moved(self) -> None:
        """Until the core next handles an event or ticks."""
        await self._core_moved.wait()

    async def in_engine(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one engine call in the worker thread (engines are not thread-safe)."""
        async with self.engine_lock:
            return await self.in_thread(fn, *args, **kwargs)

    async def in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` in a worker thread (the caller holds ``engine_lock`` where it must);
        with ``inline_engine``, on trio's thread, then sleep what the engine owes."""
        if not self.inline_engine:
            return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))
        with deferred_sleeps() as owed:
            result = fn(*args, **kwargs)
        await trio.sleep(sum(owed))  # a checkpoint even when nothing is owed
        return result


__all__ = ["NodeContext"]
