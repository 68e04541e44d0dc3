"""Loading models for the Transformers engine: locating, converting (GGUF) and fingerprinting
them, and choosing the device and dtype (see "Loading" in :mod:`peerinfer.engine.hf`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from peerinfer.engine.modelfiles import (
    DEFAULT_MODEL_NAME,
    default_gguf_path,
    gguf_fingerprint,
    models_home,
)
from peerinfer.engine.modelfiles import file_digest as _file_digest
from peerinfer.engine.modelfiles import model_fingerprint as _fingerprint
from peerinfer.errors import ConfigError

_META = "peerinfer-model.json"
_META_FORMAT = 1
_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "use_cache"}
_DIR_FILE_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model"}
_DIR_FILE_NAMES = {"config.json", "tokenizer.json", "vocab.json", "vocab.txt", "merges.txt"}


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
    decoded 1.1x faster than float32; on a CPU without (AMD Zen 2, AVX2 only) it was slower
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




def resolve_model(
    model: str | os.PathLike[str] | None, revision: str | None, home: Path | None
) -> tuple[Path | str, bytes | None, str]:
    """For ``TransformersEngine``: (what to load, its fingerprint if known now, display name) of
    ``model`` (a directory, a GGUF file, a hub id, or None for the default model)."""
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


def hub_fingerprint(name: str, revision: str | None) -> bytes:
    """A hub model's fingerprint: its files' where they can be located, else its id's."""
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


def collect_eos(model: Any, tokenizer: Any, vocab: int) -> frozenset[int]:
    """Every end-of-sequence id the model's config, generation config or tokenizer names."""
    ids: set[int] = set()
    sources = [
        getattr(model.config, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ]
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(i for i in ids if 0 <= i < vocab)


__all__ = [
    "DTYPE_CHOICES",
    "NATIVE_BF16_CPU_FLAGS",
    "auto_dtype",
    "collect_eos",
    "convert_gguf",
    "cpu_flags",
    "directory_fingerprint",
    "hub_fingerprint",
    "resolve_model",
]
