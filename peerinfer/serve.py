"""Run a node and its HTTP API together: the one place that composes the two front ends.

The node (``peerinfer.node``) knows nothing of HTTP; the HTTP API (``peerinfer.http``) reads the
node through its public face. :func:`serve_node` starts them as sibling tasks of one nursery:
the node first (its HTTP API needs it running), then, if ``NodeOptions.http`` names an address,
the API, whose URL it records as ``Node.http_url``. A bad or unsafe HTTP address is refused
before the (slow) model load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from peerinfer.http import check_exposure, parse_http_address, serve_http
from peerinfer.node import Node

if TYPE_CHECKING:
    # trio's own ``trio.TaskStatus``, as mypy sees it: libp2p depends on trio-typing, whose
    # trio-stubs shadow trio's inline types and name the class here.
    from trio_typing import TaskStatus


async def serve_node(
    node: Node, *,
    task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``node``, and its HTTP API if its options ask for one, until cancelled;
    ``task_status.started(node)`` once both accept."""
    opts = node.options
    http_address = parse_http_address(opts.http) if opts.http is not None else None
    if http_address is not None:
        check_exposure(http_address[0], opts.api_keys)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.serve)
        if http_address is not None:
            node.http_url = await nursery.start(serve_http, node, *http_address, opts.api_keys)
        task_status.started(node)


__all__ = ["serve_node"]
