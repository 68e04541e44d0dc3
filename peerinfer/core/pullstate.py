"""The state table of one anti-entropy pull (``peerinfer.core.antientropy.Reconciliation``),
in the manner of h11's ``_state.py``: the phases, the events that move them, and for each
(phase, event) the phases it may lead to. A call in a phase with no row is a local error
(``ClosedError``): the table is the protocol, and a missing transition is the error.
"""

from __future__ import annotations

import enum

from peerinfer.errors import ClosedError


class PullPhase(enum.Enum):
    """Where one pull is (the state table of ``peerinfer.core.antientropy``'s docstring)."""

    READY = "ready"  # made: first_request() opens it
    AWAITING = "awaiting"  # a request is out: handle_response() takes its answer
    CONVERGED = "converged"  # the replica matches the responder's root and count
    FAILED = "failed"  # out of passes or rounds, or the responder broke the protocol


class PullEvent(enum.Enum):
    FIRST_REQUEST = "first_request()"
    RESPONSE = "handle_response()"


#: The state table: for each (phase, event), the phases it may lead to (which one, the
#: response decides: the rows of the module docstring). No row: ``ClosedError``.
TRANSITIONS: dict[tuple[PullPhase, PullEvent], frozenset[PullPhase]] = {
    (PullPhase.READY, PullEvent.FIRST_REQUEST): frozenset({PullPhase.AWAITING}),
    (PullPhase.AWAITING, PullEvent.RESPONSE): frozenset(
        {PullPhase.AWAITING, PullPhase.CONVERGED, PullPhase.FAILED}
    ),
}

#: What ``Reconciliation.state`` says in each phase.
PULLING = "pulling"
CONVERGED = "converged"
FAILED = "failed"
STATE_OF = {
    PullPhase.READY: PULLING,
    PullPhase.AWAITING: PULLING,
    PullPhase.CONVERGED: CONVERGED,
    PullPhase.FAILED: FAILED,
}


def accepts(phase: PullPhase, event: PullEvent) -> frozenset[PullPhase]:
    """The phases ``event`` may lead to from ``phase``; ``ClosedError`` if it has no row."""
    allowed = TRANSITIONS.get((phase, event))
    if allowed is None:
        raise ClosedError(f"{event.value} is not possible in phase {phase.value} of this reconciliation")
    return allowed


def move(allowed: frozenset[PullPhase], to: PullPhase) -> PullPhase:
    """``to``, checked against the phases ``accepts`` allowed (a bug of ours otherwise)."""
    assert to in allowed, f"no row of the state table leads to {to.value} here"
    return to


__all__ = ["CONVERGED", "FAILED", "PULLING", "STATE_OF", "TRANSITIONS", "PullEvent", "PullPhase", "accepts", "move"]
