"""py-libp2p's log records, made to fit a long-running daemon and a short-lived CLI.

py-libp2p configures its own logging when imported: without ``$LIBP2P_DEBUG`` it clears the
``libp2p`` logger's handlers and stops its records from propagating, so every record of
WARNING and above reaches Python's last-resort handler and is printed to stderr, bare and
unnamed, whatever the application configured. One of them is routine in a peer-to-peer swarm:
``basic_host`` logs an ERROR of seven lines each time a stream cannot be opened because the
peer left during the negotiation (a CLI client that got its answer and exited, a node that
stopped), although it also raises the failure, which peerinfer handles and reports in its own
words. ``peerinfer status --json`` printed 14 such lines, and the node it asked 7 more; a node
with a connected client logged a gossipsub WARNING at every publish (``ROUTINE_LIBP2P_RECORDS``).

``route_libp2p_logs`` (called once, when ``peerinfer.net`` is imported, after py-libp2p has
set itself up) lets py-libp2p's records propagate to the application's logging (the CLI's
``-v`` levels, or whatever a library user configured), and demotes those routine records
to DEBUG. With ``$LIBP2P_DEBUG`` set, py-libp2p's own configuration is left as it is.
"""

from __future__ import annotations

import logging
import os

#: The records demoted to DEBUG: (logger, how the message starts). Each is routine in a swarm
#: and raised or handled where it matters:
#: - a stream that could not be opened (the peer left during the negotiation);
#: - a dial that found nobody listening (a peer that stopped; the dial raises);
#: - gossipsub's queue for a peer that never speaks gossip, such as a client
#:   (``peerinfer.client``) that stays connected: a WARNING at every publish once 100 are
#:   queued (bounded; the oldest are dropped). A 3-node llama.cpp cluster bench's nodes logged
#:   1,034-1,482 of these each in a 20-minute run.
ROUTINE_LIBP2P_RECORDS = (
    ("libp2p.host.basic_host", "Failed to open stream to peer"),
    ("libp2p.transport.tcp.tcp", "Failed to open TCP stream"),
    ("libp2p.pubsub.gossipsub", "pending message queue for peer"),
)


class _DemoteRoutine(logging.Filter):
    """Rewrites a routine record as DEBUG; drops it unless its logger is enabled for DEBUG
    (a record's level is checked before filters run, and handlers of level NOTSET would
    otherwise print it)."""

    def __init__(self, logger: logging.Logger, prefix: str) -> None:
        super().__init__()
        self._logger = logger
        self._prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG or not str(record.msg).startswith(self._prefix):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return self._logger.isEnabledFor(logging.DEBUG)


def route_libp2p_logs() -> None:
    """See the module docstring. Idempotent."""
    if os.environ.get("LIBP2P_DEBUG"):
        return
    logging.getLogger("libp2p").propagate = True
    for name, prefix in ROUTINE_LIBP2P_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DemoteRoutine) for f in logger.filters):
            logger.addFilter(_DemoteRoutine(logger, prefix))


__all__ = ["ROUTINE_LIBP2P_RECORDS", "route_libp2p_logs"]
