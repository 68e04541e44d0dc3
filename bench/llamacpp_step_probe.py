"""Probe: what one batched ``llama_decode`` step costs at 1, 2, 4 and 8 rows, and why.

The llama.cpp engine decodes every running request's next token in one ``llama_decode`` with
one row per sequence. This probe builds the engine's own context (the parameters
``LlamaCppEngine._open_context`` uses, for the engine's default budget) and variations of it, puts
8 sequences in it the way the engine does (each with its **own** cells of a ``--prompt``-token
prompt, as restored cached blocks and separate prefills leave them: not shared cells), and times
one decode step of R = 1, 2, 4, 8 rows (median of ``--steps``; the rows' new cells are removed
after each step, so every step sees the same context). Every variation shows the step times and
the 8-row step's cost over the 1-row step's (``x8_over_x1``; 8.0 would mean batching gains
nothing).

Variations (``--only a,b`` runs some): ``engine`` (as the engine opens it), ``fa_off`` /
``fa_on`` (flash attention forced; the engine leaves llama.cpp's auto), ``ubatch512``,
``small_ctx`` (a context just big enough for the 8 sequences), ``seq_max9``, ``unified``
(``kv_unified`` true: one KV cache for all sequences, as the engine had it before it gave each
sequence a stream), ``unified_fa_off``, ``no_extra_bufs``, ``v_f32`` (V cells in float32).

``--clock cpu`` (the default) times with the process's CPU time (with one thread, what the wall
clock would read on an idle machine), ``--clock wall`` with the wall clock; either way give the
load (``uptime``) beside the figures. ``--gguf FILE`` probes another GGUF (e.g. a requantized
copy) with the same parameters.

Usage: python bench/llamacpp_step_probe.py [--threads 1] [--prompt 512] [--steps 9] [--only LIST]
       [--clock cpu|wall] [--gguf FILE]
Prints one JSON object per variation, then a summary line.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import llama_cpp as L  # noqa: E402
import numpy as np  # noqa: E402

from peerinfer.engine.llamacpp import LlamaCppEngine  # noqa: E402

ROWS = (1, 2, 4, 8)
N_SEQ = 8


def arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    threads = int(arg("--threads", "1"))
    prompt_len = int(arg("--prompt", "512"))
    steps = int(arg("--steps", "9"))
    only = set(arg("--only", "").split(",")) - {""}
    clock = {"cpu": time.process_time, "wall": time.perf_counter}[arg("--clock", "cpu")]

    # The engine itself, for its context's parameters on this machine (budget, extra buffers).
    eng = LlamaCppEngine(arg("--gguf", "") or None, threads=threads)
    base = {
        "n_ctx": eng.context_tokens,
        "n_batch": eng._n_batch,
        "n_ubatch": min(eng._n_batch, eng.ubatch_tokens),
        "n_seq_max": eng._max_sequences,
        "kv_unified": False,  # a KV stream per sequence, as the engine opens it
        "flash_attn_type": int(L.llama_context_default_params().flash_attn_type),
        "extra_buffers": eng.extra_buffers,
        "type_v": 1,  # GGML_TYPE_F16, llama.cpp's default
    }
    gguf = str(eng.gguf)
    text = " ".join(f"Question {i}: which planet is number {i} from the sun? Answer: C." for i in range(80))
    prompt = eng.tokenize(text)[:prompt_len]
    eng.close()
    assert len(prompt) == prompt_len, len(prompt)

    # Each stream holds n_ctx / n_seq_max cells: just enough for the prompt and the steps.
    small = int(base["n_seq_max"]) * (-(-(prompt_len + 64) // 256) * 256)
    variations: dict[str, dict[str, object]] = {
        "engine": {},
        "fa_off": {"flash_attn_type": 0},
        "fa_on": {"flash_attn_type": 1},
        "ubatch512": {"n_ubatch": base["n_batch"]},
        "small_ctx": {"n_ctx": small},
        "seq_max9": {"n_seq_max": N_SEQ + 1},
        # One unified KV cache for all sequences (the engine before it split the streams).
        "unified": {"kv_unified": True},
        "unified_fa_off": {"kv_unified": True, "flash_attn_type": 0},
        "no_extra_bufs": {"extra_buffers": False},
        # V cells in float32: flash attention then accumulates in float32, not float16.
        "v_f32": {"type_v": 0},
    }
    L.llama_backend_init()
    models: dict[bool, object] = {}
    results = []
    for name, change in variations.items():
        if only and name not in only:
            continue
        p = {**base, **change}
        if p["extra_buffers"] not in models:
            mp = L.llama_model_default_params()
            mp.use_extra_bufts = bool(p["extra_buffers"])
            models[bool(p["extra_buffers"])] = L.llama_model_load_from_file(gguf.encode(), mp)
        model = models[bool(p["extra_buffers"])]
        res = run_variation(model, p, prompt, steps, threads, clock)
        res = {"variation": name, **p, **res}
        results.append(res)
        print(json.dumps(res), flush=True)
    print(json.dumps({"summary": {r["variation"]: {"x1_ms": r["step_ms"]["1"], "x8_ms": r["step_ms"]["8"],
                                                   "x8_over_x1": r["x8_over_x1"]} for r in results},
                      "gguf": os.path.basename(gguf), "clock": arg("--clock", "cpu"), "threads": threads,
                      "prompt_tokens": prompt_len, "load": os.getloadavg()}))


def run_variation(model: object, p: dict[str, object], prompt: list[int], steps: int,
                  threads: int, clock: Callable[[], float]) -> dict[str, object]:
    cp = L.llama_context_default_params()
    cp.n_ctx = int(p["n_ctx"])  # type: ignore[call-overload]
    cp.n_batch = int(p["n_batch"])  # type: ignore[call-overload]
    cp.n_ubatch = int(p["n_ubatch"])  # type: ignore[call-overload]
    cp.n_seq_max = int(p["n_seq_max"])  # type: ignore[call-overload]
    cp.kv_unified = bool(p["kv_unified"])
    cp.flash_attn_type = int(p["flash_attn_type"])  # type: ignore[call-overload]
    cp.type_v = int(p["type_v"])  # type: ignore[call-overload]
    cp.swa_full = True
    cp.no_perf = True
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        return {"error": "cannot create the context"}
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(int(p["n_batch"]), N_SEQ), 0, 1)  # type: ignore[call-overload]

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        for i, (t, pos, s, lg) in enumerate(items):
            batch.token[i], batch.pos[i] = t, pos
            batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = 1, s, lg
        batch.n_tokens = len(items)
        rc = L.llama_decode(ctx, batch)
        assert rc == 0, rc

    try:
        t0 = clock()
        for c in range(0, len(prompt), int(p["n_batch"])):  # type: ignore[call-overload]
            chunk = prompt[c:c + int(p["n_batch"])]  # type: ignore[call-overload]
            decode([(t, c + j, 0, False) for j, t in enumerate(chunk)])
        prefill_s = clock() - t0
        # Sequences 1..7 get their own copies of the cells (saved state restored, as the
        # engine's cache restore leaves them), not cells shared with sequence 0.
        size = int(L.llama_state_seq_get_size(ctx, 0))
        buf = (ctypes.c_uint8 * size)()
        n = int(L.llama_state_seq_get_data(ctx, buf, size, 0))
        for s in range(1, N_SEQ):
            assert L.llama_state_seq_set_data(ctx, buf, n, s) > 0
        step_ms: dict[str, float] = {}
        for rows in ROWS:
            times = []
            for k in range(steps):
                t = clock()
                decode([(prompt[k], len(prompt), s, True) for s in range(rows)])
                times.append(clock() - t)
                np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, rows - 1), shape=(n_vocab,)).argmax()
                for s in range(rows):
                    L.llama_memory_seq_rm(mem, s, len(prompt), -1)
            step_ms[str(rows)] = round(1000 * sorted(times)[len(times) // 2], 2)
        return {
            "prefill_s": round(prefill_s, 3),
            "step_ms": step_ms,
            "x8_over_x1": round(step_ms["8"] / step_ms["1"], 2),
            "tok_s_x8_over_x1": round(8 * step_ms["1"] / step_ms["8"], 2),
        }
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


if __name__ == "__main__":
    main()
