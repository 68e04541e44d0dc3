"""Probe: does a sequence's logit depend on where its KV cells sit in llama.cpp's unified cache?

The engine keeps every running request in one unified KV cache. This probe runs the same
256-token prompt (sequence 0) three ways in the engine's own context and compares the last
position's logits with a lone in-order run:

* ``interleaved_in_order``: another sequence's cells sit between the prompt's two halves, but
  each sequence's cells still rise with its positions;
* ``out_of_order``: the other sequence is removed after the first half, so the second half lands
  in the freed cells *below* the first half (what a finished request's hole does to the requests
  still running, or to a newcomer's suffix after its restored prefix).

CPU flash attention skips masked cells exactly, but accumulates V in float16 in cell order, so a
sequence whose cells are not in position order gets different logits. Prints max |difference|.
In a unified KV cache (the engine's context before it gave each sequence a stream of its own)
``out_of_order`` differed by 0.442; in the engine's context now (``kv_unified`` false) the freed
cells belong to the other sequence's stream, so all three are 0.0 (docs/performance.md).
Usage: python bench/llamacpp_cell_order_probe.py [--threads 1]
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import llama_cpp as L  # noqa: E402
import numpy as np  # noqa: E402

from peerinfer.engine.llamacpp import LlamaCppEngine  # noqa: E402


def main() -> None:
    threads = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1
    eng = LlamaCppEngine(threads=threads, capacity_bytes=64 << 20)
    text = " ".join(f"Question {i}: which planet is number {i} from the sun? Answer: C." for i in range(30))
    a = eng.tokenize(text)[:256]
    b = eng.tokenize("The quick brown fox jumps over the lazy dog. " * 10)[:64]
    mem = eng._mem

    def run(seq: int, toks: list[int], start: int, last: bool) -> np.ndarray | None:
        eng._decode([(t, start + j, seq, last and j == len(toks) - 1) for j, t in enumerate(toks)])
        return eng._logits(len(toks) - 1).copy() if last else None

    out: dict[str, np.ndarray | None] = {}
    L.llama_memory_clear(mem, True)
    out["in_order"] = run(0, a, 0, True)
    L.llama_memory_clear(mem, True)
    run(1, b, 0, False)
    run(0, a[:128], 0, False)
    run(1, b, 64, False)
    out["interleaved_in_order"] = run(0, a[128:], 128, True)
    L.llama_memory_clear(mem, True)
    run(1, b, 0, False)
    run(0, a[:128], 0, False)
    L.llama_memory_seq_rm(mem, 1, -1, -1)  # a hole below: the second half lands in it
    out["out_of_order"] = run(0, a[128:], 128, True)
    ref = out["in_order"]
    assert ref is not None
    print(json.dumps({
        k: {"max_abs_diff": float(np.abs(v - ref).max()), "argmax": int(v.argmax())}
        for k, v in out.items() if v is not None
    }))
    eng.close()


if __name__ == "__main__":
    main()
