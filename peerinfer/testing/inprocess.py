"""Real nodes in the test's own process: libp2p on 127.0.0.1, ephemeral ports, under trio.

``node_options(**overrides)`` is a node that touches nothing outside the test: loopback only,
a throwaway identity, no mDNS, the simulated engine, announcements every 0.3 s, seed 1.
``open_nodes(count, make)`` starts nodes one after another in one nursery, each bootstrapping
from one started before it, and stops them all when the block ends, whatever happened.
``wait_until`` (from :mod:`peerinfer.testing.waiting`) bounds every wait on them.

These nodes run in real time. ``open_nodes`` also starts nodes of an in-memory network
(``make`` returns ``MemNetwork.node(...)``, :mod:`peerinfer.testing.memnet`), which run under
trio's virtual clock. A test that needs only the core's decisions drives
``peerinfer.core.node.NodeCore`` by hand instead (tests/core/).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

import trio

from peerinfer.node import Node, NodeOptions
from peerinfer.serve import serve_node
from peerinfer.testing.waiting import wait_for, wait_until

__all__ = ["LOOPBACK", "node_options", "open_nodes", "wait_for", "wait_until"]

#: Listen on 127.0.0.1 only, on a port the kernel picks.
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def node_options(**overrides: Any) -> NodeOptions:
    """The options of an in-process test node, with ``overrides`` on top."""
    base: dict[str, Any] = dict(
        engine="simulated",
        listen=(LOOPBACK,),
        mdns=False,
        persist_identity=False,
        policy="longest_prefix",
        announce_interval_s=0.3,
        seed=1,
    )
    base.update(overrides)
    return NodeOptions(**base)


@asynccontextmanager
async def open_nodes(
    count: int,
    make: Callable[[int, tuple[str, ...]], Node],
    *,
    topology: Literal["chain", "star"] = "chain",
) -> AsyncIterator[list[Node]]:
    """Start ``count`` nodes built by ``make(i, bootstrap)`` (each with its HTTP API where its
    options name one: ``peerinfer.serve.serve_node``) and yield them, all serving.

    ``bootstrap`` is empty for the first node; after it, the previous node's address
    (``"chain"``: peer exchange must do the rest) or the first node's (``"star"``). Each node
    has started listening before the next is made. Leaving the block cancels them all.
    """
    async with trio.open_nursery() as nursery:
        started: list[Node] = []
        for i in range(count):
            bootstrap: tuple[str, ...] = ()
            if started:
                seed = started[-1] if topology == "chain" else started[0]
                bootstrap = (seed.addresses()[0],)
            node = make(i, bootstrap)
            await nursery.start(serve_node, node)
            started.append(node)
        try:
            yield started
        finally:
            nursery.cancel_scope.cancel()
