"""Probe: how the llama.cpp engine should reuse a cached prefix (engine/llamacpp.py's choice).

Two ways to give a new sequence a cached prefix's KV in one llama.cpp context:
  shared cells  - cached blocks stay in the context under cache-owner sequences and a hit
                  ``llama_memory_seq_cp``s them (no copy), but every cached cell stays in the KV
                  range each decode step attends over (masked);
  saved state   - a block is the bytes of ``llama_state_seq_get_data``; a hit restores them
                  (``llama_state_seq_set_data``), so the context holds running requests only.
It prints, for the default model (or --gguf), one thread (or --threads): the time to prefill a
512-token prefix, to export it as 32 blocks of 16, to restore them, to seq_cp it; and the time of
one decode step of 8 sequences with 0, 4,096 and 16,384 other (cached) cells in the context.

It was written for, and measured on, the engine's unified KV cache (one stream for all
sequences). The engine now gives each sequence a KV stream of its own (``kv_unified`` false), in
which the shared-cells alternative cannot exist (a stream holds one sequence's cells, and
``llama_memory_seq_cp`` copies only whole streams), so the probe refuses to run on it; its
figures stay in the engine's module docstring and docs/performance.md as the record of the choice.

Usage: python bench/llamacpp_reuse_probe.py [--threads N] [--gguf FILE]
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import llama_cpp as L  # noqa: E402

from peerinfer.engine.llamacpp import LlamaCppEngine  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    threads = int(argv[argv.index("--threads") + 1]) if "--threads" in argv else 1
    gguf = argv[argv.index("--gguf") + 1] if "--gguf" in argv else None
    # 40 MiB budget: a small context of its own; the probe then makes one of 32k cells.
    eng = LlamaCppEngine(gguf, threads=threads, capacity_bytes=1 << 30, max_sequences=60)
    if eng.sequence_tokens < eng.context_tokens:
        eng.close()
        raise SystemExit("the engine's context has a KV stream per sequence: this probe needs the "
                         "unified cache it was written for (see its docstring)")
    bs = 16
    eng._open_context(32768)
    mem = eng._mem
    text = " ".join(f"Question {i}: which planet is number {i} from the sun? Answer: C." for i in range(40))
    prefix = eng.tokenize(text)[:512]
    assert len(prefix) == 512, len(prefix)
    out: dict[str, object] = {"gguf": str(eng.gguf), "threads": threads, "kv_bytes_per_token": eng.kv_bytes_per_token,
                              "extra_buffers": eng.extra_buffers}
    t0 = time.perf_counter()
    for c in range(0, 512, 256):
        eng._decode([(t, c + j, 0, False) for j, t in enumerate(prefix[c:c + 256])])
    out["prefill_512_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    blocks = [eng.export_block(0, b * bs, bs) for b in range(512 // bs)]
    out["export_32_blocks_ms"] = round(1000 * (time.perf_counter() - t0), 1)
    out["block_bytes"] = len(blocks[0])
    t0 = time.perf_counter()
    for p in blocks:
        eng.restore_block(1, p)
    out["restore_32_blocks_ms"] = round(1000 * (time.perf_counter() - t0), 1)
    t0 = time.perf_counter()
    L.llama_memory_seq_cp(mem, 0, 2, -1, -1)
    out["seq_cp_512_ms"] = round(1000 * (time.perf_counter() - t0), 3)
    L.llama_memory_seq_rm(mem, 1, -1, -1)
    L.llama_memory_seq_rm(mem, 2, -1, -1)

    def decode_step_s(extra_cells: int) -> float:
        # extra cells: copies of the 512-token prefix under owner sequences 20.., restored
        # before the running sequences so they sit low in the context (as a cache would).
        L.llama_memory_clear(mem, True)
        for k in range(extra_cells // 512):
            for p in blocks:
                eng.restore_block(20 + k, p)
        for s in range(1, 9):  # 8 running sequences of 96 tokens each
            eng._decode([(t, j, s, False) for j, t in enumerate(prefix[:96])])
        pos = 96
        times = []
        for step in range(12):
            t = time.perf_counter()
            eng._decode([(prefix[step], pos, s, True) for s in range(1, 9)])
            times.append(time.perf_counter() - t)
            pos += 1
        times.sort()
        return times[len(times) // 2]

    steps = {str(n): round(1000 * decode_step_s(n), 2) for n in (0, 4096, 16384)}
    out["decode_step_8_seqs_ms_by_extra_cells"] = steps
    out["decode_slowdown_4096"] = round(steps["4096"] / steps["0"], 2)
    out["decode_slowdown_16384"] = round(steps["16384"] / steps["0"], 2)
    print(json.dumps(out))
    eng.close()


if __name__ == "__main__":
    main()
