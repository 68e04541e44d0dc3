"""A deterministic batching engine for tests: it records how it was driven.

:class:`BatchRecordingEngine` implements the whole batching contract (prefix-cache hooks,
chunked ``Decoder.prefill``, a batched ``prefill_batch`` and ``decode_batch``, ``max_batch_size``,
``kv_bytes_per_token``) without a model. Its "KV state" is the tokens themselves: a decoder
checks that the cached prefix it is handed really is its prompt's, and its next token is a hash
of every token before it, so any mix-up between requests in a batch changes the output. It
records the size of every decode batch and every prefill chunk, so tests can assert that
requests really decoded together. Requests whose prompt contains one of ``fail_tokens`` make
``decode_batch`` raise (before advancing any decoder, as the contract asks), so tests can
check that one failing request does not fail its neighbours; requests whose prompt contains
one of ``fail_prefill_tokens`` make ``prefill_batch`` raise (before advancing any decoder) and
their own ``Decoder.prefill`` raise too. It records the decoders of every ``prefill_batch`` call
(``prefill_batches``). With a ``gate`` (a
``threading.Event``), ``decode_batch`` first waits for it to be set (at most ``gate_timeout_s``),
so a test can let requests pile up before the first batch; ``step_delay_s`` paces every decode
batch (real time), so that a test's clients can act while others still decode.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from peerinfer.engine.base import Decoder, DecodeRequest, Engine, KVSegment

_MODULUS = 1_000_003
#: Ids below this are never generated (they are free for eos and for test markers).
RESERVED_IDS = 4


def _mix(state: int, position: int, token: int) -> int:
    return (state * 31 + (position + 1) * (token + 7)) % _MODULUS


class BatchRecordingEngine(Engine):
    """Deterministic, batching, cache-reusing and observable (see the module docstring)."""

    fingerprint = b"peerinfer-testing-batch-recording/1"
    supports_prefix_cache = True
    thread_safe_tokenizer = True

    def __init__(
        self,
        *,
        max_batch_size: int = 8,
        kv_bytes_per_token: int = 0,
        vocab_size: int = 256,
        max_context_tokens: int = 4096,
        prefill_chunk_tokens: int = 8,
        eos_token_id: int | None = None,
        fail_tokens: frozenset[int] = frozenset(),
        fail_prefill_tokens: frozenset[int] = frozenset(),
        gate: threading.Event | None = None,
        gate_timeout_s: float = 30.0,
        step_delay_s: float = 0.0,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self._vocab = vocab_size
        self._context = max_context_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._eos = frozenset() if eos_token_id is None else frozenset({eos_token_id})
        self.fail_tokens = fail_tokens
        self.fail_prefill_tokens = fail_prefill_tokens
        self.gate = gate
        self.gate_timeout_s = gate_timeout_s
        self.step_delay_s = step_delay_s
        #: The size of every decode batch, in order.
        self.batch_sizes: list[int] = []
        #: The tokens of every prefill chunk run through ``Decoder.prefill``, in order.
        self.prefill_chunks: list[int] = []
        #: The number of decoders of every ``prefill_batch`` call, in order.
        self.prefill_batches: list[int] = []
        #: Decoders open now (a leak shows here).
        self.open_decoders = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_context_tokens(self) -> int:
        return self._context

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def tokenize(self, text: str) -> list[int]:
        return [b % self._vocab for b in text.encode("utf-8")]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in tokens if t >= RESERVED_IDS)

    def next_token(self, state: int) -> int:
        return RESERVED_IDS + state % (self._vocab - RESERVED_IDS)

    def open_decoder(self, request: DecodeRequest) -> Decoder:
        return _RecordingDecoder(self, request)

    def decode_batch(self, decoders: Sequence[Decoder]) -> list[int | None]:
        if self.gate is not None and not self.gate.wait(self.gate_timeout_s):
            raise RuntimeError("the test's gate was never opened")
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        self.batch_sizes.append(len(decoders))
        mine = [d for d in decoders if isinstance(d, _RecordingDecoder)]
        if len(mine) != len(decoders):
            raise TypeError("decode_batch got a decoder of another engine")
        if any(d.poisoned for d in mine):
            raise RuntimeError("a poisoned request is in the batch")
        return [d.step() for d in mine]

    def prefill_batch(self, decoders: Sequence[Decoder], max_tokens: Sequence[int]) -> list[bool]:
        mine = [d for d in decoders if isinstance(d, _RecordingDecoder)]
        if len(mine) != len(decoders) or len(max_tokens) != len(decoders):
            raise TypeError("prefill_batch got a decoder of another engine, or too few counts")
        if any(d.prefill_poisoned for d in mine):
            raise RuntimeError("a prefill-poisoned request is in the prefill batch")
        self.prefill_batches.append(len(mine))
        return [d.prefill(n) for d, n in zip(mine, max_tokens, strict=True)]


class _RecordingDecoder(Decoder):
    def __init__(self, engine: BatchRecordingEngine, request: DecodeRequest) -> None:
        self._engine = engine
        self._bs = request.block_size
        prompt = request.tokens
        reused = [t for segment in request.prefix.segments for t in segment]
        if tuple(reused) != prompt[: request.prefix.tokens]:
            raise AssertionError("the cached prefix handed to the decoder is not the prompt's")
        self._seq: list[int] = []
        self._state = 0
        for t in reused:
            self._feed(t)
        self._pending = list(prompt[len(reused) :])
        self._prompt_left = len(self._pending)
        self.poisoned = bool(engine.fail_tokens.intersection(prompt))
        self.prefill_poisoned = bool(engine.fail_prefill_tokens.intersection(prompt))
        engine.open_decoders += 1
        self._open = True

    def _feed(self, token: int) -> None:
        self._state = _mix(self._state, len(self._seq), token)
        self._seq.append(token)

    @property
    def prefill_remaining(self) -> int:
        return self._prompt_left

    def prefill(self, max_tokens: int) -> bool:
        if self.prefill_poisoned:
            raise RuntimeError("this request's prefill fails")
        n = min(max_tokens, self._prompt_left)
        for t in self._pending[:n]:
            self._feed(t)
        del self._pending[:n]
        self._prompt_left -= n
        self._engine.prefill_chunks.append(n)
        return self._prompt_left == 0

    def step(self) -> int | None:
        if not self._open:
            raise AssertionError("step() after close()")
        for t in self._pending:  # the rest of the prompt, or the last generated token
            self._feed(t)
        self._prompt_left = 0
        token = self._engine.next_token(self._state)
        self._pending = [token]
        return token

    @property
    def kv_tokens(self) -> int:
        return len(self._seq)

    def export_segments(self, first_block: int) -> list[KVSegment]:
        bs = self._bs
        nbytes = bs * self._engine.kv_bytes_per_token
        return [
            KVSegment(tuple(self._seq[i * bs : (i + 1) * bs]), nbytes)
            for i in range(first_block, len(self._seq) // bs)
        ]

    def close(self) -> None:
        if self._open:
            self._open = False
            self._engine.open_decoders -= 1


__all__ = ["RESERVED_IDS", "BatchRecordingEngine"]
