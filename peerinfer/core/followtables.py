"""What a route's walk over the shared runs reads of the peers a node follows
(``ReplicaIndex._holders_by_depth``), kept between routes.

Every route asks which peers are *not* followed (they are asked one by one) and which followed
peer each run slot of ``RunHolders`` stands for. A swarm's node follows nearly every peer, and
both answers change only when a peer joins or leaves the index or ``following``: they are
computed once and kept under those counts (``ReplicaIndex``'s ``_membership_changes`` and
``RunReads.following_changes``; a count of None keeps nothing). Each kept answer is the object
a fresh computation would make, so it iterates in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from peerinfer.core.announcerun import RunHolders, RunReads
from peerinfer.types import PeerId

#: a peer's state in the index (``replicabudget._PeerState``)
State = TypeVar("State")


class FollowTables(Generic[State]):
    """The two kept answers; one per index."""

    __slots__ = (
        "_not_followed", "_not_followed_of", "_not_followed_key",
        "_by_run_slot", "_by_run_slot_of", "_by_run_slot_holders", "_by_run_slot_key",
    )

    def __init__(self) -> None:
        self._not_followed: set[PeerId] = set()
        self._not_followed_of: object = None
        self._not_followed_key: tuple[int | None, int] = (None, -1)
        self._by_run_slot: list[State | None] = []
        self._by_run_slot_of: object = None
        self._by_run_slot_holders: object = None
        self._by_run_slot_key: tuple[int | None, int, int] = (None, -1, -1)

    @property
    def kept_not_followed(self) -> set[PeerId]:
        """The last answer of ``not_followed`` (tests: whether it was kept)."""
        return self._not_followed

    def not_followed(
        self,
        states: Mapping[PeerId, State],
        following: Mapping[PeerId, object],
        following_changes: int | None,
        membership_changes: int,
    ) -> set[PeerId]:
        """The peers of ``states`` not in ``following`` (read, not to be changed): the set
        ``states.keys() - following.keys()`` makes, kept while neither the peers
        (``membership_changes``) nor ``following`` (``following_changes``) change."""
        key = (following_changes, membership_changes)
        if following_changes is None or self._not_followed_of is not following \
                or self._not_followed_key != key:
            self._not_followed = states.keys() - following.keys()
            self._not_followed_of = following
            self._not_followed_key = key
        return self._not_followed

    def by_run_slot(
        self,
        states: Mapping[PeerId, State],
        reads: RunReads,
        holders: RunHolders,
        membership_changes: int,
    ) -> list[State | None]:
        """Per slot of ``holders``, the state of the peer this node follows through the run in
        that slot (the slot's sender, followed, through the run holding the slot: the run a
        node follows is alive, so it keeps its slot), else None: what a route's walk over the
        runs reads of each run. Kept while neither the peers, nor the peers followed
        (``RunReads.following_changes``: a followed peer's run changes only with them), nor
        the number of slots change."""
        following = reads.following
        changes = reads.following_changes
        senders = holders.senders
        key = (changes, membership_changes, len(senders))
        if (changes is None or self._by_run_slot_of is not following
                or self._by_run_slot_holders is not holders or self._by_run_slot_key != key):
            by_run_slot: list[State | None] = [None] * len(senders)
            for peer, kept in following.items():
                run = kept.run
                slot = -1 if run is None else run.holder_slot
                if 0 <= slot < len(senders) and senders[slot] == peer:
                    by_run_slot[slot] = states.get(peer)
            self._by_run_slot = by_run_slot
            self._by_run_slot_of = following
            self._by_run_slot_holders = holders
            self._by_run_slot_key = key
        return self._by_run_slot


__all__ = ["FollowTables"]
