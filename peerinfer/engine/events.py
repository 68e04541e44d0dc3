"""What an engine reports: the events of one generation, the cache changes it carries, and
the engine's counters. See :mod:`peerinfer.engine.base` for the contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from peerinfer.core.messages import TokenLogprob
from peerinfer.core.quickinit import quick_init
from peerinfer.core.radix import CacheStats
from peerinfer.types import BlockHash

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True, slots=True)
class Started:
    """The request was accepted; ``cached_tokens`` of its ``prompt_tokens`` come from cache."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Tokens:
    """Newly generated token ids and the newly *stable* text.

    Text is released only once it can no longer change: a multi-byte character split across
    tokens is held until complete, and text that could be the start of a stop sequence is held
    until it is not. So ``text`` may be empty, and a final ``Tokens((), text)`` may flush what
    was held. The concatenated texts are the completion (stop sequence excluded); the
    concatenated ids are every generated token, including an end-of-sequence token.
    """

    token_ids: tuple[int, ...]
    text: str
    #: one entry per token of ``token_ids`` (not for end of sequence) when logprobs were asked
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    """The request ended. ``cache_added``/``cache_removed``: block hashes changed since the last
    report (sorted), for the node's digest."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_added: tuple[BlockHash, ...] = ()
    cache_removed: tuple[BlockHash, ...] = ()


EngineEvent = Started | Tokens | Finished


@quick_init
@dataclass(frozen=True, slots=True)
class CacheChanges:
    """Block hashes that entered and left the engine's cache since the previous report."""

    added: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of an engine's counters. ``cache`` is None for an engine without a cache."""

    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cache: CacheStats | None = None


__all__ = [
    "CacheChanges",
    "EngineEvent",
    "EngineStatistics",
    "FinishReason",
    "Finished",
    "Started",
    "Tokens",
]
