"""The request phases (``Phase``) as keys of the state machine's table (``_TRANSITIONS``)."""

from __future__ import annotations

from peerinfer.core.node.requests import _TRANSITIONS, Phase


def test_phases_hash_by_identity_and_agree_with_equality() -> None:
    """``Requests.transition`` looks every move up in ``_TRANSITIONS``, several times a
    request: ``Phase`` hashes by identity (a C slot) instead of ``Enum.__hash__`` (a Python
    call hashing the name). The members are singletons compared by identity, so equal phases
    hash alike, and every move the table lists is still found."""
    assert Phase.__hash__ is object.__hash__
    for phase in Phase:
        assert phase == Phase(phase.value) and hash(phase) == hash(Phase(phase.value))
        assert phase in _TRANSITIONS
        for new in _TRANSITIONS[phase]:
            assert new in _TRANSITIONS[phase] and new in {p: None for p in Phase}
    assert Phase.DONE not in _TRANSITIONS[Phase.DONE]
    assert Phase.RELAYING in _TRANSITIONS[Phase.FORWARDED]
