"""Loading a GGUF for the llama.cpp engine: llama-cpp-python itself, llama.cpp's backend and log,
locating the model file, and the child-process probe that keeps a CPU feature from crashing a node.

Everything here runs before a llama context exists; :mod:`peerinfer.engine.llamacpp` (the engine)
builds on it and re-exports its public names.

CPU features: llama.cpp's *extra buffer types* (weight repacking, AMX) are its fastest CPU path,
but a native build on a machine whose AMX support is broken segfaults in ``llama_decode`` (see
``shared/notes/llama-cpp-python-0.3.36.md``). A crash would take the whole node down, so before
the first load of a model with extra buffers on, a **child process** loads it that way and
decodes a small batch; only if the child exits cleanly does the node use them, otherwise it loads
with ``use_extra_bufts=False``. The verdict is kept on disk (``$PEERINFER_HOME/llamacpp-probe.json``,
keyed by the llama-cpp-python version, the CPU's feature flags, the GGUF file and the GPU layers),
so the probe runs once per machine and model. ``extra_buffers=True/False`` (or the environment
variable ``PEERINFER_LLAMACPP_EXTRA_BUFFERS=1/0``) skips the probe.
"""

from __future__ import annotations

import ctypes
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from peerinfer.engine.modelfiles import DEFAULT_MODEL_NAME, default_gguf_path, peerinfer_home
from peerinfer.errors import ConfigError

try:
    import llama_cpp as L
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ConfigError(
        "the llamacpp engine needs llama-cpp-python: pip install 'peerinfer[llama]' "
        f"(it compiles llama.cpp; see the README) ({_exc})"
    ) from _exc

__all__ = [
    "EXTRA_BUFFERS_ENV", "PROBE_CRASH_ENV", "L", "ProbeVerdict", "_init_backend", "_probe_main",
    "flash_attn_type", "probe_extra_buffers", "resolve_gguf",
]


#: The environment variable that forces llama.cpp's extra CPU buffer types on (1) or off (0).
EXTRA_BUFFERS_ENV = "PEERINFER_LLAMACPP_EXTRA_BUFFERS"
#: Test hook: the probe child aborts (SIGABRT) after loading the model, as a CPU-feature crash
#: would, so the fallback can be tested on a machine where the extra buffers work.
PROBE_CRASH_ENV = "PEERINFER_LLAMACPP_PROBE_CRASH"
_PROBE_TIMEOUT_S = 180.0
_PROBE_FILE = "llamacpp-probe.json"

_backend_lock = threading.Lock()
_backend_ready = False


def _init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            _silence_llama_log()
            L.llama_backend_init()
            _backend_ready = True


_LOG_CALLBACK: Any = None


def _silence_llama_log() -> None:
    """llama.cpp logs every load to stderr; keep errors only (``PEERINFER_LLAMACPP_LOG=1``: all)."""
    global _LOG_CALLBACK
    if os.environ.get("PEERINFER_LLAMACPP_LOG") == "1":
        return

    last = [0]

    @L.llama_log_callback  # type: ignore[untyped-decorator]  # llama_cpp has no type hints
    def _log(level: int, text: bytes, user_data: Any) -> None:
        # ggml's levels: 2 info, 3 warn, 4 error, 5 continuation of the previous line.
        if level != 5:
            last[0] = level
        if last[0] == 4:
            sys.stderr.write(text.decode("utf-8", "replace"))

    _LOG_CALLBACK = _log  # keep it alive: llama.cpp holds only the pointer
    L.llama_log_set(_log, ctypes.c_void_p(0))


# --------------------------------------------------------------------------------------------
# Locating the model.


def flash_attn_type(flash_attn: bool | None) -> int:
    """llama.cpp's ``flash_attn_type`` for ``flash_attn`` (None: auto)."""
    if flash_attn is None:
        return int(L.LLAMA_FLASH_ATTN_TYPE_AUTO)
    return int(L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)


def resolve_gguf(model: str | os.PathLike[str] | None, hub_file: str | None = None) -> tuple[Path, str]:
    """(the GGUF file, a display name) for ``model``: None (the default model), a ``.gguf`` file,
    a directory holding exactly one, or a hub repository id with ``hub_file``."""
    if model is None:
        if hub_file is not None:
            raise ConfigError("hub_file needs a hub repository id as the model")
        return default_gguf_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"{path} is a file but not a .gguf model (the llamacpp engine runs GGUF)")
        return path, path.stem
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if hub_file is not None:
            ggufs = [g for g in ggufs if fnmatch.fnmatch(g.name, hub_file)]
        if len(ggufs) != 1:
            raise ConfigError(
                f"{path} holds {len(ggufs)} matching .gguf files; name one (a path, or --hub-file)"
            )
        return ggufs[0], ggufs[0].stem
    name = str(model)
    if name.startswith((".", "~", "/", "\\")) or name.count("/") != 1:
        raise ConfigError(f"no model at {name!r}: not a GGUF file, a directory or a hub repository id")
    if hub_file is None:
        raise ConfigError(
            f"{name!r} looks like a hub repository: name the GGUF file in it too "
            "(hub_file, e.g. '*Q4_K_M.gguf')"
        )
    return _download_from_hub(name, hub_file), f"{name}/{hub_file}"


def _download_from_hub(repo: str, pattern: str) -> Path:
    try:
        import huggingface_hub
    except ImportError as exc:
        raise ConfigError("loading from the hub needs huggingface_hub: pip install huggingface_hub") from exc
    try:
        files = [
            f for f in huggingface_hub.list_repo_files(repo) if fnmatch.fnmatch(Path(f).name, pattern)
        ]
    except Exception as exc:  # network, auth, unknown repo: all mean "cannot list it"
        raise ConfigError(f"cannot list the files of {repo!r} on the hub: {exc}") from exc
    if len(files) != 1:
        raise ConfigError(f"{repo!r} has {len(files)} files matching {pattern!r}: name exactly one")
    try:
        return Path(huggingface_hub.hf_hub_download(repo, files[0]))
    except Exception as exc:
        raise ConfigError(f"cannot download {files[0]!r} from {repo!r}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Never crash on a CPU feature: the extra-buffer probe.


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), else the platform's description."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return f"{platform.machine()} {platform.processor()}"


def _probe_key(gguf: Path, gpu_layers: int) -> str:
    st = gguf.stat()
    raw = "\0".join([
        getattr(L, "__version__", "?"), _cpu_flags(), str(gguf.resolve()), str(st.st_size),
        str(st.st_mtime_ns), str(gpu_layers),
    ])
    return hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """Whether llama.cpp's extra buffer types are safe here, and how that was decided."""

    extra_buffers: bool
    source: str  # "probe", "cached", "forced", "env"
    detail: str = ""


def probe_extra_buffers(gguf: Path, gpu_layers: int = 0, *, home: Path | None = None) -> ProbeVerdict:
    """Decide (once per machine and model, then from the file on disk) whether loading ``gguf``
    with extra buffer types on survives a batched decode, by trying it in a child process."""
    env = os.environ.get(EXTRA_BUFFERS_ENV)
    if env in ("0", "1"):
        return ProbeVerdict(env == "1", "env", f"{EXTRA_BUFFERS_ENV}={env}")
    path = (peerinfer_home() if home is None else home) / _PROBE_FILE
    key = _probe_key(gguf, gpu_layers)
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("extra_buffers"), bool):
        return ProbeVerdict(entry["extra_buffers"], "cached", str(entry.get("detail", "")))
    ok, detail = _run_probe_child(gguf, gpu_layers)
    known[key] = {"extra_buffers": ok, "detail": detail, "gguf": str(gguf), "at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # not cached: the probe runs again next time, which is only slower
    return ProbeVerdict(ok, "probe", detail)


def _run_probe_child(gguf: Path, gpu_layers: int) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "peerinfer.engine.llamacpp", "--probe", str(gguf), str(gpu_layers)]
    try:
        done = subprocess.run(
            cmd, capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False, text=True,
            errors="replace", stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return False, f"the probe did not finish in {_PROBE_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return False, f"the probe could not start: {exc}"
    if done.returncode == 0 and "probe ok" in done.stdout:
        return True, "a batched decode with extra buffers on ran cleanly"
    if done.returncode < 0:
        how = f"died of signal {-done.returncode}"
    else:
        how = f"exited with status {done.returncode}"
    tail = (done.stderr or "").strip().splitlines()[-1:] or [""]
    return False, f"the probe child {how} {tail[0][:200]}".strip()


def _probe_main(gguf: str, gpu_layers: int) -> int:
    """The probe child: load with extra buffers on and decode a small two-sequence batch."""
    _init_backend()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = True
    mp.n_gpu_layers = gpu_layers
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    if not model:
        print("probe: cannot load the model", file=sys.stderr)
        return 3
    if os.environ.get(PROBE_CRASH_ENV) == "1":
        os.abort()  # the test hook: a real crash, as a CPU-feature fault would be
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 512, 128, 128, 2
    cp.n_threads = cp.n_threads_batch = 1
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        return 4
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    ids = [(i * 7919) % n_vocab for i in range(1, 49)]
    batch = L.llama_batch_init(2 * len(ids), 0, 1)
    try:
        for rounds in ((ids, 0), (ids[:1], len(ids))):
            toks, start = rounds
            n = 0
            for s in range(2):
                for j, t in enumerate(toks):
                    batch.token[n], batch.pos[n] = t, start + j
                    batch.n_seq_id[n], batch.seq_id[n][0] = 1, s
                    batch.logits[n] = j == len(toks) - 1
                    n += 1
            batch.n_tokens = n
            if L.llama_decode(ctx, batch) != 0:
                return 5
            row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, n - 1), shape=(n_vocab,))
            if not np.isfinite(row).all():
                return 6
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    print("probe ok", flush=True)
    return 0
