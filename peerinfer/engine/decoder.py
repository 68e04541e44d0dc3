"""What a backend receives and returns for one request: the ``DecodeRequest`` (with its
``CancelToken`` and the ``CachedPrefix`` it reuses), the ``Decoder`` it opens for it, and the
``KVSegment`` blocks it exports. See :mod:`peerinfer.engine.base` for the contract."""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from peerinfer.core.messages import SamplingParams

if TYPE_CHECKING:
    from peerinfer.engine.constraints import TokenGuide

# --------------------------------------------------------------------------------------------
# Cancellation.


@runtime_checkable
class CancelToken(Protocol):
    """Anything with ``is_set()``; ``threading.Event`` is the usual one. Set it from any thread."""

    def is_set(self) -> bool: ...


class _NeverCancelled:
    __slots__ = ()

    def is_set(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> bool:
        if timeout:
            time.sleep(timeout)
        return False


NEVER_CANCELLED: CancelToken = _NeverCancelled()


#: Set by ``deferred_sleeps``: the seconds ``wait_cancelled`` owes instead of sleeping them.
_DEFERRED_SLEEPS: ContextVar[list[float] | None] = ContextVar("deferred_sleeps", default=None)


@contextmanager
def deferred_sleeps() -> Iterator[list[float]]:
    """Inside the block, ``wait_cancelled`` does not sleep: it adds the seconds to the list
    yielded and returns at once, for the caller to sleep them on its event loop afterwards.
    For an engine called inline on trio's thread under its virtual clock (the node's inline
    engine calls, ``NodeContext.inline_engine``: tests on the in-memory network), where a real
    sleep would stall the loop and the clock alike. The cancel token is then looked at once
    per sleep, not during it."""
    token = _DEFERRED_SLEEPS.set([])
    try:
        owed = _DEFERRED_SLEEPS.get()
        assert owed is not None
        yield owed
    finally:
        _DEFERRED_SLEEPS.reset(token)


def wait_cancelled(cancel: CancelToken, seconds: float) -> bool:
    """Sleep ``seconds`` (real time) or until ``cancel`` is set; True if it was set. Inside
    ``deferred_sleeps`` the seconds are owed instead of slept."""
    if seconds <= 0:
        return cancel.is_set()
    owed = _DEFERRED_SLEEPS.get()
    if owed is not None:
        owed.append(seconds)
        return cancel.is_set()
    wait = getattr(cancel, "wait", None)
    if callable(wait):
        return bool(wait(seconds)) or cancel.is_set()
    deadline = time.monotonic() + seconds
    while not cancel.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, 0.005))
    return True


# --------------------------------------------------------------------------------------------
# What a backend receives and returns.


class KVSegment(NamedTuple):
    """One block's KV state as the backend stores it, and the bytes it is accounted for."""

    payload: Any
    nbytes: int


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The cached prefix a request reuses: ``tokens`` (a multiple of the block size) and one
    segment payload per block, in order. Empty when nothing was cached."""

    tokens: int = 0
    segments: tuple[Any, ...] = ()


NO_PREFIX = CachedPrefix()


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Everything a backend needs to serve one validated request.

    ``tokens``: the prompt (non-empty, every id in ``[0, vocab_size)``, shorter than the
    context). ``rng``: seeded from ``params.seed`` when given (repeatable sampling), else from
    the OS. ``prefix``: the cached prefix to reuse (always empty unless the backend supports the
    prefix cache). ``block_size``: the cache's block size. ``guide``: set when the request is
    constrained or wants logprobs (``params.constraint``, ``params.logprobs``): before sampling
    each token the backend masks the logits to ``guide.allowed()`` and, with logprobs, reports
    them with ``guide.note``/``guide.note_logits`` (``peerinfer.engine.constraints``).
    """

    tokens: tuple[int, ...]
    params: SamplingParams
    cancel: CancelToken
    rng: random.Random
    prefix: CachedPrefix = NO_PREFIX
    block_size: int = 16
    guide: TokenGuide | None = None
    #: the last ``continues`` tokens of ``tokens`` are this request's own output from before it
    #: was preempted (its KV given up, recomputed now): a model needs nothing more (it
    #: continues from the whole sequence); a backend whose output is a function of the prompt
    #: alone (the simulated engine) continues the completion of ``tokens[:-continues]``
    continues: int = 0

    @property
    def seed(self) -> int:
        """A 63-bit seed for the backend's own generator, drawn from ``rng`` (call once)."""
        return self.rng.getrandbits(63)


class Decoder(ABC):
    """One request's decoding state, for backends that implement the prefix-cache hooks.

    ``step()`` computes the next token (the first call runs the prompt past ``request.prefix``);
    it returns None when the backend itself decides to stop. ``kv_tokens`` is how many leading
    tokens of ``prompt + generated`` the decoder holds KV state for. ``export_segments(b)``
    returns one segment for each full block from block ``b`` up to ``kv_tokens // block_size``,
    as new storage that the cache may keep (it must not alias the decoder's working memory).
    ``close()`` releases the working memory; it is always called, also after errors.
    """

    @abstractmethod
    def step(self) -> int | None: ...

    def prefill(self, max_tokens: int) -> bool:
        """Run up to ``max_tokens`` more prompt tokens (those past ``request.prefix`` not run yet).

        Return True once the whole prompt has run and the first token's logits are ready (the
        next ``step()`` then only samples). The default does nothing and returns True: ``step()``
        runs the whole prompt, so backends that do not chunk their prefill keep working. The
        :class:`~peerinfer.engine.batch.BatchScheduler` calls it (one chunk per scheduling
        step) so that a long prompt never stalls the requests already decoding.
        """
        return True

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens not run yet (default 0: the backend does not chunk its prefill)."""
        return 0

    @property
    def kv_tokens(self) -> int:
        return 0

    def export_segments(self, first_block: int) -> Sequence[KVSegment]:
        return ()

    def close(self) -> None:
        return None


__all__ = [
    "NEVER_CANCELLED",
    "NO_PREFIX",
    "CachedPrefix",
    "CancelToken",
    "DecodeRequest",
    "Decoder",
    "KVSegment",
    "deferred_sleeps",
    "wait_cancelled",
]
