"""llama.cpp alone, for exactness checks of the llama.cpp engine (tests and bench/batch_bench.py).

:class:`LlamaCppReference` runs a prompt through llama-cpp-python's low-level API in a fresh
context of its own: one sequence, no cache, the prompt in chunks of 512 tokens, then one token per
``llama_decode``, greedy. At every step it records the logits' best two values, so a caller can
tell a near-tie (a token that may flip when products are batched or chunked differently) from a
real difference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L
import numpy as np

from peerinfer.engine.llamacpp_load import flash_attn_type


@dataclass(frozen=True, slots=True)
class GreedyRun:
    """Tokens of a lone greedy run; ``gaps[k]``: best minus second-best logit at step ``k``;
    ``logits[k]``: the whole row at step ``k`` (kept only when asked for)."""

    tokens: list[int]
    gaps: list[float]
    logits: list[np.ndarray]
    prefill_s: float
    decode_s: float


class LlamaCppReference:
    """One model, a fresh context per prompt (see the module docstring)."""

    def __init__(self, gguf: str | Path, *, extra_buffers: bool = False, threads: int = 1,
                 ubatch_tokens: int = 32, clock: Callable[[], float] = time.perf_counter,
                 flash_attn: bool | None = None) -> None:
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = extra_buffers
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {gguf}")
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model)))
        self.threads = threads
        #: llama.cpp's n_ubatch: the engine's (see DEFAULT_UBATCH_TOKENS in engine/llamacpp.py).
        self.ubatch_tokens = ubatch_tokens
        #: Flash attention as the engine compared with has it (None: llama.cpp's auto).
        self.flash_attn = flash_attn
        #: What ``prefill_s`` and ``decode_s`` are timed with: a benchmark passes its own clock
        #: (e.g. CPU time) so that the reference is timed like the engine it is compared with.
        self.clock = clock

    def greedy(
        self, prompt: Sequence[int], n: int, *, stop: frozenset[int] = frozenset(),
        keep_logits: bool = False,
    ) -> GreedyRun:
        """``n`` greedy tokens after ``prompt`` (fewer if a token in ``stop`` comes)."""
        cp = L.llama_context_default_params()
        cp.n_ctx = max(512, len(prompt) + n + 16)
        cp.n_batch = 512
        cp.n_ubatch = self.ubatch_tokens
        cp.flash_attn_type = flash_attn_type(self.flash_attn)
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = self.threads
        ctx = L.llama_init_from_model(self.model, cp)
        batch = L.llama_batch_init(512, 0, 1)
        tokens: list[int] = []
        gaps: list[float] = []
        rows: list[np.ndarray] = []

        def run(items: list[tuple[int, int, bool]]) -> None:
            for i, (t, p, lg) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
                batch.seq_id[i][0], batch.logits[i] = 0, lg
            batch.n_tokens = len(items)
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed: {rc}")

        try:
            t0 = self.clock()
            prompt = list(prompt)
            for c in range(0, len(prompt), 512):
                chunk = prompt[c : c + 512]
                run([(t, c + j, c + j == len(prompt) - 1) for j, t in enumerate(chunk)])
            row = (len(prompt) - 1) % 512
            prefill_s = self.clock() - t0
            t1 = self.clock()
            pos = len(prompt)
            for k in range(n):
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(self.n_vocab,))
                best = int(np.argmax(logits))
                top = np.partition(logits, -2)[-2:]
                tokens.append(best)
                gaps.append(float(top.max() - top.min()))
                if keep_logits:
                    rows.append(logits.copy())
                if best in stop or k == n - 1:
                    break
                run([(best, pos, True)])
                row, pos = 0, pos + 1
            decode_s = self.clock() - t1
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)
        return GreedyRun(tokens, gaps, rows, prefill_s, decode_s)

    def close(self) -> None:
        if self.model:
            L.llama_model_free(self.model)
            self.model = None


def first_difference(got: Sequence[int], run: GreedyRun) -> int | None:
    """The first step where ``got`` differs from the lone run (None: identical)."""
    for k, (a, b) in enumerate(zip(got, run.tokens, strict=False)):
        if a != b:
            return k
    return None if len(got) == len(run.tokens) else min(len(got), len(run.tokens))


__all__ = ["GreedyRun", "LlamaCppReference", "first_difference"]
