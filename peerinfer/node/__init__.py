"""A running peerinfer node: the libp2p host, the engine and the sans-IO ``NodeCore``, composed.

Theory of operation
-------------------
Everything the node *decides* lives in ``peerinfer.core.node.NodeCore``. This package only
executes its effects and feeds it events, on one trio thread. ``Node`` composes one component
per part; each takes the :class:`~peerinfer.node.context.NodeContext` (the engine, the host,
the core, the nursery, ``feed``, the sink table) and uses only what it names. None decides
anything the core could, and none imports another (the one hand-off between two, an
announcement's sender to the peer keeper, is a callback ``Node`` wires):

=================  ================================================================================
``options``        ``NodeOptions`` (the ``peerinfer node`` flags), protocol names, limits, and the
                   pure builders ``core_config`` and ``host_config``
``context``        ``NodeContext``: what the components share
``sinks``          ``Sink``, ``SinkTable``; request ids composed in one place
``runtime``        ``Node``: serve/shutdown, ``_feed`` events to the core, each effect to its
                   component, the timer, ``statistics()`` (a frozen snapshot)
``door``           ``Door``: ``Node.submit``, the one entry point of every front end (libp2p, HTTP)
``worker``         ``EngineWorker``: the ``BatchScheduler``, the only caller into the engine
``forwarding``     ``Forwarder``: relaying a request to the peer the core chose, checking the answer
``antientropy``    ``AntiEntropy``: announcements out and in, sync rounds and answering them
``peers``          ``PeerKeeper``: status, peer exchange, peer events, liveness pings
``trust``          ``TrustKeeper``: audits, bans, the reputation table on disk
=================  ================================================================================

The HTTP API is not part of the node: ``peerinfer.serve`` runs it beside the node, in one
nursery, and it reads the node through ``Node.submit``, ``Node.status()`` and
``Node.statistics()``.

* ``_feed(event)`` runs ``core.handle(event, now)`` and starts the effects it returns (publish
  an announcement, a sync round, a local run, a forward, a rejection, a ping), each through
  the component that executes it. A timer task calls ``core.tick(now)`` no later than
  ``core.next_deadline()``.
* The engine is synchronous; every call into it runs in a worker thread, one at a time (a
  ``trio.Lock``), so the event loop never blocks on compute. (Tests on the in-memory network
  call it inline instead, ``NodeContext.inline_engine``, to run under trio's virtual clock.) One *engine worker* task owns a
  :class:`~peerinfer.engine.batch.BatchScheduler` and is the only caller into the engine while
  requests run: ``EngineWorker.run_local`` hands it the requests the core started, and it calls
  ``scheduler.step()`` (one prefill chunk and one batched decode step) in the thread while any
  run, routing each event to its request's sink and reporting cache changes to the core in
  the engine's order. The core admits up to the engine's ``max_batch_size`` at once.
* Each request, whoever serves it, has a *sink* (``sinks``): a memory channel whose receiver
  is the stream handler that answers the client (or the forwarding peer). Local runs and forwards write
  ``TokenChunk`` frames into it and end it with ``GenerateDone`` or ``ErrorMessage``.

Protocols (all frames are ``peerinfer.core.messages``, varint length-prefixed):

=========================================  ===============================================
``/peerinfer/generate/1.0.0``              GenerateRequest -> TokenChunk* -> GenerateDone
                                           or ErrorMessage (clients, and peers forwarding)
``/peerinfer/sync/1.0.0``                  SyncRequest -> SyncResponse (one round)
``/peerinfer/status/1.0.0``                StatusRequest -> StatusResponse
``/peerinfer/peers/1.0.0``                 PeerExchange -> PeerExchange (who we know)
gossip ``peerinfer/1/<model>/announce``    Announce (digest root, epoch, load, delta)
=========================================  ===============================================

Membership and clocks (see docs/security.md): in a private swarm (``swarm_key``) the host admits
only peers that prove the key (``peerinfer.net.admission``) before any of the above. A peer
becomes a member of the core only after a ping answered over a direct connection; peers are
exchanged only with members, and what they tell is deduplicated and dialed at a bounded rate.
Every timer runs on trio's monotonic clock; the wall clock (``NodeOptions.wall_clock``, for
tests) only seeds the epochs, which are persisted beside the identity so that they grow across
restarts even if the wall clock stepped back.
"""

from peerinfer.node.door import RoutingRecord, Submission
from peerinfer.node.options import (
    GENERATE_PROTOCOL,
    PEER_DIAL_BURST,
    PEERS_PROTOCOL,
    STATUS_PROTOCOL,
    SYNC_PROTOCOL,
    NodeOptions,
    announce_topic,
)
from peerinfer.node.runtime import Node, NodeStatistics

__all__ = [
    "GENERATE_PROTOCOL",
    "PEERS_PROTOCOL",
    "STATUS_PROTOCOL",
    "SYNC_PROTOCOL",
    "Node",
    "NodeOptions",
    "NodeStatistics",
    "announce_topic",
    "Submission",
    "RoutingRecord",
    "PEER_DIAL_BURST",
]
