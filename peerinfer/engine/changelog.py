"""The engine's record of its cache's changes between two reports (``Engine.take_cache_changes``):
the net set difference, so that a block added and evicted in between is in neither (see
:mod:`peerinfer.engine.base`, "Prefix cache hooks")."""

from __future__ import annotations

from collections.abc import Container

from peerinfer.engine.events import CacheChanges
from peerinfer.types import BlockHash


class ChangeLog:
    """A cache observer that keeps the net set difference since the last ``take()``.

    With a disk tier (``elsewhere``) the engine reports the blocks it holds in memory *or* on
    disk: a block moving between the two is no change. The radix cache tells it of memory
    changes (``block_added``/``block_removed``, skipped while the block is on disk); the engine
    tells it of disk-only changes through ``_added``/``_removed``.
    """

    __slots__ = ("added", "removed", "elsewhere")

    def __init__(self) -> None:
        self.added: set[BlockHash] = set()
        self.removed: set[BlockHash] = set()
        self.elsewhere: Container[BlockHash] = ()

    # (``_added`` and ``_removed`` inlined: the cache calls these once per block it adds or
    # evicts, the hottest calls of a simulated request that misses)
    def block_added(self, h: BlockHash) -> None:
        if h not in self.elsewhere:
            if h in self.removed:
                self.removed.discard(h)
            else:
                self.added.add(h)

    def block_removed(self, h: BlockHash) -> None:
        if h not in self.elsewhere:
            if h in self.added:
                self.added.discard(h)
            else:
                self.removed.add(h)

    def _added(self, h: BlockHash) -> None:
        if h in self.removed:
            self.removed.discard(h)
        else:
            self.added.add(h)

    def _removed(self, h: BlockHash) -> None:
        if h in self.added:
            self.added.discard(h)
        else:
            self.removed.add(h)

    def take(self) -> CacheChanges:
        out = CacheChanges(tuple(sorted(self.added)), tuple(sorted(self.removed)))
        self.added = set()
        self.removed = set()
        return out


__all__ = ["ChangeLog"]
