"""One request on the llama.cpp engine: its sampling, and its decoder (a sequence id of the
engine's context, its prompt run in chunks, then one token per step). See
:mod:`peerinfer.engine.llamacpp` for the context, batching and KV reuse it relies on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from peerinfer.core.messages import SamplingParams
from peerinfer.engine.base import Decoder, DecodeRequest, KVSegment
from peerinfer.engine.constraints import TokenGuide, mask_logits_numpy

# --------------------------------------------------------------------------------------------
# Sampling.


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Greedy (temperature 0: the first maximum) or temperature/top-p sampling from ``rng``."""
    if params.temperature == 0.0 or rng is None:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    z -= z.max()
    p = np.exp(z)
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sp = p[order]
        total = sp.sum()
        # Keep the smallest head whose mass reaches top_p (always at least one token).
        keep = (np.cumsum(sp) - sp) < params.top_p * total
        sp = sp * keep
        cum = np.cumsum(sp)
        i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
        return int(order[min(i, len(order) - 1)])
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return min(i, len(p) - 1)


def guided_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None,
                 guide: TokenGuide | None) -> int:
    """``sample_token`` under the request's guide: the constraint's mask applied to a copy of
    the row (``logits`` may be llama.cpp's own buffer), and the raw row's log-softmax noted when
    logprobs are wanted. Without a guide it is ``sample_token`` on the row as is (no copy)."""
    if guide is None:
        return sample_token(logits, params, rng)
    allowed = guide.allowed()
    masked = logits if allowed is None else mask_logits_numpy(logits.copy(), allowed)
    token = sample_token(masked, params, rng)
    if guide.logprobs:
        guide.note_logits(logits, token)
    return token


# --------------------------------------------------------------------------------------------
# The engine.


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where the time to first token of the last request went (benchmarks, calibration):
    ``build_s`` restoring the cached prefix, ``prefill_s`` running the rest of the prompt."""

    cached_tokens: int
    prefill_tokens: int
    build_s: float
    prefill_s: float


class _DecoderEngine(Protocol):
    """What a decoder uses of its engine (:class:`~peerinfer.engine.llamacpp.LlamaCppEngine`):
    named here so that this module need not import the engine's."""

    _ctx: Any
    _swa: int
    prefill_chunk_tokens: int
    last_timings: RequestTimings | None

    def _take_seq(self, owner: Any = None) -> int: ...
    def _give_seq(self, seq: int) -> None: ...
    def _decode(self, items: Sequence[tuple[int, int, int, bool]]) -> None: ...
    def _logits(self, row: int) -> np.ndarray: ...
    def restore_blocks(self, seq: int, payloads: Sequence[bytes]) -> None: ...
    def export_blocks(self, seq: int, ranges: Sequence[tuple[int, int]]) -> list[bytes]: ...
    def prefill_batch(self, decoders: Sequence[Decoder], max_tokens: Sequence[int]) -> list[bool]: ...


class _LlamaDecoder(Decoder):
    """One request: a sequence id of the engine's context, its prompt run in chunks, then one
    token per step, alone (``step``) or in the engine's ``decode_batch``."""

    def __init__(self, engine: _DecoderEngine, request: DecodeRequest) -> None:
        self._engine = engine
        self._request = request
        self._params = request.params
        self._bs = request.block_size
        #: The sequence id (its own KV stream). The engine may lower it when a lower id frees up.
        self._seq = engine._take_seq(self)
        self._closed = False
        #: SWA models: payloads of the blocks exported as soon as they were complete.
        self._early: list[bytes] | None = [] if engine._swa else None
        try:
            t0 = time.perf_counter()
            payloads = [bytes(p) for p in request.prefix.segments]
            engine.restore_blocks(self._seq, payloads)
            if self._early is not None:
                self._early.extend(payloads)
            self._build_s = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise
        self._kv = self._reused = request.prefix.tokens
        self._prompt_left = len(request.tokens) - self._kv
        #: The last prompt position's logits, once prefill is done and until sampled.
        self._held: np.ndarray | None = None
        #: The token the next decode step runs (the last one sampled).
        self._pending = -1
        self._prefill_s = 0.0
        self._rng = np.random.default_rng(request.seed) if self._params.temperature > 0 else None
        self._first = True

    @property
    def _needs_step_alone(self) -> bool:
        """Prefill unfinished, or finished with its logits not sampled: ``step()`` alone."""
        return self._prompt_left > 0 or self._held is not None

    @property
    def prefill_remaining(self) -> int:
        return self._prompt_left

    def prefill(self, max_tokens: int) -> bool:
        if self._prompt_left == 0:
            return True
        engine = self._engine
        n = max(0, min(max_tokens, self._prompt_left))
        chunk = engine.prefill_chunk_tokens
        ran = 0
        while ran < n:
            if ran and self._request.cancel.is_set():
                break
            take = min(chunk, n - ran)
            engine.prefill_batch([self], [take])
            ran += take
        return self._prompt_left == 0

    def _prefilled(self, n: int, logits: np.ndarray | None) -> None:
        """``n`` prompt tokens ran (engine side); ``logits`` when that completed the prompt."""
        self._kv += n
        self._prompt_left -= n
        if self._prompt_left == 0:
            self._held = logits
        self._export_complete_blocks()

    def _export_complete_blocks(self) -> None:
        early = self._early
        if early is None:
            return
        bs = self._bs
        ranges = [(b * bs, bs) for b in range(len(early), self._kv // bs)]
        early.extend(self._engine.export_blocks(self._seq, ranges))

    def step(self) -> int | None:
        if self._prompt_left and not self.prefill(self._prompt_left):
            return None  # cancelled between prefill chunks
        engine = self._engine
        if self._held is not None:
            logits, self._held = self._held, None
            return self._sampled(logits)
        engine._decode([(self._pending, self._kv, self._seq, True)])
        return self._advanced(engine._logits(0))

    def _advanced(self, logits: np.ndarray) -> int:
        """The pending token ran (engine side): count it and sample the next."""
        self._kv += 1
        self._export_complete_blocks()
        return self._sampled(logits)

    def _sampled(self, logits: np.ndarray) -> int:
        token = guided_token(logits, self._params, self._rng, self._request.guide)
        if self._first:
            self._first = False
            self._engine.last_timings = RequestTimings(
                cached_tokens=self._reused,
                prefill_tokens=len(self._request.tokens) - self._reused,
                build_s=self._build_s,
                prefill_s=self._prefill_s,
            )
        self._pending = token
        return token

    @property
    def kv_tokens(self) -> int:
        return self._kv

    def export_segments(self, first_block: int) -> list[KVSegment]:
        bs = self._bs
        n_full = self._kv // bs
        if self._early is not None:
            payloads = self._early[first_block:n_full]
        else:
            ranges = [(b * bs, bs) for b in range(first_block, n_full)]
            payloads = self._engine.export_blocks(self._seq, ranges)
        return [KVSegment(p, len(p)) for p in payloads]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._held = None
        self._early = None
        engine = self._engine
        if engine._ctx is not None:
            engine._give_seq(self._seq)
