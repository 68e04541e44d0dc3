"""The radix prefix cache's data: its nodes (one cached block each), what ``match`` and ``insert``
return, its statistics, and the observer it tells of every block that enters or leaves it.
:mod:`peerinfer.core.radix` (the cache itself) re-exports them all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from peerinfer.types import BlockHash


class CacheObserver(Protocol):
    """Told of every block entering or leaving the cache (e.g. the Merkle digest)."""

    def block_added(self, h: BlockHash) -> None: ...

    def block_removed(self, h: BlockHash) -> None: ...


class RadixNode:
    """One cached block of ``block_size`` tokens (the root holds none).

    ``hash`` is the chain hash of the whole prefix ending with this block. ``lock_ref`` counts
    pins held on this node or any descendant. ``last_access`` is the logical tick of the last
    operation whose path went through the node. A node that was evicted has ``parent is None``
    (and ``depth > 0``) and is no longer part of the tree.
    """

    __slots__ = (
        "parent",
        "children",
        "key",
        "hash",
        "depth",
        "payload",
        "nbytes",
        "lock_ref",
        "last_access",
    )

    def __init__(
        self,
        parent: RadixNode | None,
        key: tuple[int, ...],
        hash: BlockHash,
        payload: Any = None,
        nbytes: int = 0,
        last_access: int = 0,
    ) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.key = key
        self.hash = hash
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.payload = payload
        self.nbytes = nbytes
        self.lock_ref = 0
        self.last_access = last_access

    @property
    def evicted(self) -> bool:
        """True once the node has been removed from its cache."""
        return self.parent is None and self.depth > 0

    def __repr__(self) -> str:
        return (
            f"RadixNode(depth={self.depth}, hash={self.hash:#018x}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, children={len(self.children)}, "
            f"nbytes={self.nbytes}{', evicted' if self.evicted else ''})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a prompt.

    ``tokens`` is a multiple of ``block_size``; ``nodes`` is the matched path (root excluded) in
    order; ``root_hash`` is the hasher's root, the chain hash of the empty prefix.
    """

    tokens: int
    nodes: tuple[RadixNode, ...]
    root_hash: BlockHash

    @property
    def last_hash(self) -> BlockHash:
        """Chain hash of the matched prefix (``root_hash`` when nothing matched)."""
        return self.nodes[-1].hash if self.nodes else self.root_hash

    @property
    def payloads(self) -> list[Any]:
        """The payload of every matched block, in order."""
        return [n.payload for n in self.nodes]

    @property
    def last_node(self) -> RadixNode | None:
        """The deepest matched node (what a request locks), or None when nothing matched."""
        return self.nodes[-1] if self.nodes else None


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What ``insert`` did.

    ``inserted_blocks``: nodes created. ``cached_tokens``: how many leading tokens of the input
    are now cached (a multiple of ``block_size``). ``nodes``: that cached path. ``unused_payloads``:
    the payloads the cache did not keep (block already cached with another payload, no room, or a
    trailing partial block) in input order; the caller frees them.
    """

    inserted_blocks: int
    cached_tokens: int
    nodes: tuple[RadixNode, ...]
    unused_payloads: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache's size and lifetime counters.

    ``queries``/``query_tokens`` count ``match(touch=True)`` calls and their prompt lengths;
    ``hit_queries``/``hit_tokens`` those that matched at least one block and the matched tokens.
    ``inserted_blocks``/``evicted_blocks`` are lifetime totals. ``reserved_bytes``: the budget
    set aside with ``reserve`` for memory outside the cache (running requests' KV).
    """

    blocks: int
    tokens: int
    bytes: int
    capacity_tokens: int | None
    capacity_bytes: int | None
    locked_blocks: int
    queries: int
    hit_queries: int
    query_tokens: int
    hit_tokens: int
    inserted_blocks: int
    evicted_blocks: int
    reserved_bytes: int = 0


__all__ = ["CacheObserver", "CacheStats", "InsertResult", "MatchResult", "RadixNode"]
