"""A whole pull run in memory: a ``Replica`` reconciled with a ``LocalDigest`` through the wire
codec, round by round, with the bytes each way counted. For tests and benchmarks of the
anti-entropy protocol (``peerinfer.core.antientropy``); a node's pulls go over the network."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from peerinfer.core.antientropy import DEFAULT_MAX_ROUNDS, Replica
from peerinfer.core.digest import LocalDigest
from peerinfer.core.messages import SyncRequest, SyncResponse, decode, encode

__all__ = ["ReconcileStats", "reconcile_in_memory"]


@dataclass(frozen=True, slots=True)
class ReconcileStats:
    """The outcome of one in-memory pull."""

    state: str
    rounds: int
    passes: int
    bytes_sent: int
    bytes_received: int

    @property
    def bytes_total(self) -> int:
        return self.bytes_sent + self.bytes_received


def reconcile_in_memory(
    replica: Replica,
    local: LocalDigest,
    *,
    session: int = 1,
    attempt: int = 0,
    estimated_difference: int | None = None,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    between_rounds: Callable[[int], None] | None = None,
) -> ReconcileStats:
    """Run a whole pull of ``replica`` from ``local`` through the wire codec, counting bytes.

    ``between_rounds(round)`` (tests) runs after each response is produced, e.g. to change the
    responder mid-pull.
    """
    pull = replica.start_pull(
        session,
        local.epoch,
        local.root,
        attempt,
        target_count=local.count,
        estimated_difference=estimated_difference,
        max_rounds=max_rounds,
    )
    request: SyncRequest | None = pull.first_request()
    while request is not None:
        received = decode(encode(request), SyncRequest)
        assert isinstance(received, SyncRequest)
        answer = decode(encode(local.answer(received)), SyncResponse)
        assert isinstance(answer, SyncResponse)
        if between_rounds is not None:
            between_rounds(pull.rounds + 1)
        request = pull.handle_response(answer)
    return ReconcileStats(pull.state, pull.rounds, pull.passes, pull.bytes_sent, pull.bytes_received)
