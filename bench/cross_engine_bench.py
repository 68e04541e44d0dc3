"""One model, two engines, one swarm: do a Transformers peer and a llama.cpp peer running the same
GGUF agree on what they route and audit?

Run ``python bench/cross_engine_bench.py`` (the default model, SmolLM2-135M-Instruct: its shipped
Q4_1 GGUF on the llama.cpp engine, the same file dequantized on the Transformers engine in
float32, or ``--hf-dtype bfloat16``; one thread each). It prints:

* ``fingerprint``: both engines' model fingerprints (the GGUF file's digest), which seed the
  block hashes and the swarm key: equal means the two peers are one swarm.
* ``tokens``: on the chat prompts below and on a set of awkward texts (code, numbers, accents,
  emoji, runs of spaces), how many token sequences (and so block-hash chains, since the hasher is
  seeded by the shared fingerprint) are identical on both engines.
* ``audit``: ``--requests`` (200) answers generated on each engine, re-scored by the other one
  with ``engine/audit.py``'s ``audit_answer`` under the node's default tolerances: half greedy,
  3 in 10 sampled (T 0.8, top-p 0.9, seeded: a nucleus the audit can check), 1 in 5 under a JSON
  schema of ``bench/agents_bench.py``'s suite. An honest answer that fails is a false failure
  (target: 0). To show the bar still catches something, ``--swapped`` (20) greedy answers are
  also audited as the answer to the *next* prompt (another question's answer: a lie), and those
  caught are counted. ``--direction`` runs one direction only (two processes share a busy
  machine's cores better than one).

Prompts are MMLU validation questions (``--data``, default ``../shared/data/mmlu``), asked
zero-shot as chat; answers are at most ``--max-tokens`` (32) tokens, run through the batch
scheduler 8 at a time as a node would, 20 requests per round of generation and audits (the
running totals are printed after each round).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from agents_bench import SCHEMAS, run_batch, schema_prompt  # noqa: E402

from peerinfer.core.messages import ChatMessage, Constraint, SamplingParams  # noqa: E402
from peerinfer.core.prefix import PrefixHasher  # noqa: E402

AWKWARD_TEXTS = [
    "def f(x):\n    return x**2  # square\n",
    "Price: $1,234.56 (approx. 1.2e3) on 2024-03-01 at 13:45:07",
    "naïve café, Straße, Ærø, São Paulo, Łódź",
    "emoji 🙂👍🏽 and CJK 東京 and Arabic مرحبا",
    "    four spaces\t\ttabs\n\n\nnewlines   trailing   ",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<|im_start|>user\nliteral special-token text<|im_end|>",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "https://example.org/path?q=a%20b&x=1#frag",
    "12345678901234567890 3.14159265358979 -0.0001",
]


def mmlu_questions(data: Path, count: int) -> list[str]:
    """``count`` MMLU validation questions, one subject after another in turn."""
    files = sorted((data / "val").glob("*_val.csv"))
    if not files:
        raise SystemExit(f"no MMLU data under {data} (give --data PATH)")
    rows = []
    for path in files:
        with path.open(newline="", encoding="utf-8") as f:
            rows.append(list(csv.reader(f)))
    out: list[str] = []
    i = 0
    while len(out) < count:
        for subject_rows in rows:
            if i < len(subject_rows) and len(out) < count:
                r = subject_rows[i]
                out.append(r[0] + "".join(f"\n{letter}. {c}" for letter, c in zip("ABCD", r[1:5], strict=True))
                           + "\nGive the letter of the answer, then one sentence why.")
        i += 1
    return out


def load_engines(hf_dtype: str) -> tuple[Any, Any]:
    from peerinfer.engine.hf import TransformersEngine
    from peerinfer.engine.llamacpp import LlamaCppEngine

    llama = LlamaCppEngine(threads=1, capacity_bytes=256 << 20)
    llama.configure_cache(PrefixHasher(llama.fingerprint, block_size=16))
    hf = TransformersEngine(device="cpu", dtype=hf_dtype, threads=1)
    return hf, llama


def bench_tokens(hf: Any, llama: Any, questions: Sequence[str], figures: dict[str, Any]) -> None:
    hasher = PrefixHasher(hf.fingerprint, block_size=16)
    chat_same = chain_same = 0
    chat_diffs = []
    for q in questions:
        a = hf.chat_prompt_tokens([ChatMessage("user", q)])
        b = llama.chat_prompt_tokens([ChatMessage("user", q)])
        chat_same += a == b
        chain_same += hasher.chain(a) == hasher.chain(b)
        if a != b:
            chat_diffs.append(q[:60])
    text_same = 0
    text_diffs = []
    for t in AWKWARD_TEXTS + list(questions[:40]):
        a, b = hf.tokenize(t), llama.tokenize(t)
        text_same += a == b
        if a != b:
            text_diffs.append({"text": t[:60], "hf": a[:12], "llamacpp": b[:12]})
    n_text = len(AWKWARD_TEXTS) + len(questions[:40])
    figures["tokens"] = {"chat_prompts": len(questions), "chat_identical": chat_same,
                         "block_chains_identical": chain_same, "texts": n_text,
                         "texts_identical": text_same, "chat_differences": chat_diffs,
                         "text_differences": text_diffs}
    print(f"tokens  chat prompts identical on both engines: {chat_same}/{len(questions)} "
          f"(block-hash chains {chain_same}/{len(questions)}); plain texts {text_same}/{n_text}")
    for d in text_diffs:
        print("   differs:", d)


def jobs_for(engine: Any, questions: Sequence[str], max_tokens: int) -> list[tuple[int, list[int], SamplingParams]]:
    """Half greedy, 3 in 10 sampled (T 0.8, top-p 0.9, seeded), 1 in 5 under a JSON schema."""
    jobs = []
    for i, q in enumerate(questions):
        kind = i % 10
        if kind < 5:
            jobs.append((i, engine.chat_prompt_tokens([ChatMessage("user", q)]),
                         SamplingParams(max_tokens=max_tokens)))
        elif kind < 8:
            jobs.append((i, engine.chat_prompt_tokens([ChatMessage("user", q)]),
                         SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i)))
        else:
            name, schema, what = SCHEMAS[i % len(SCHEMAS)]
            kind_name = "json_object" if name == "json_object" else "json_schema"
            constraint = Constraint(kind_name, "" if kind_name == "json_object" else json.dumps(schema))
            extra: dict[str, Any] = {} if kind == 8 else {"temperature": 0.7, "top_p": 0.9, "seed": i}
            jobs.append((i, schema_prompt(engine, schema, what),
                         SamplingParams(max_tokens=max(max_tokens, 120), constraint=constraint, **extra)))
    return jobs


def bench_direction(producer: Any, auditor: Any, label: str, questions: Sequence[str],
                    max_tokens: int, swapped: int, figures: dict[str, Any], chunk: int = 20) -> None:
    """Generate on ``producer`` and audit on ``auditor``, ``chunk`` requests at a time, printing
    the running totals after each chunk (a run cut short still gives its figure so far)."""
    from peerinfer.engine.audit import audit_answer

    jobs = jobs_for(producer, questions, max_tokens)
    false_failures: list[dict[str, Any]] = []
    kinds = {"greedy": 0, "sampled": 0, "constrained": 0}
    generate_s = audit_s = 0.0
    caught = swaps = tokens = 0
    for first in range(0, len(jobs), chunk):
        part = jobs[first : first + chunk]
        t0 = time.perf_counter()
        out = run_batch(producer, part)
        generate_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        for key, prompt, params in part:
            kind = "constrained" if params.constraint else "sampled" if params.temperature > 0 else "greedy"
            kinds[kind] += 1
            tokens += len(out[key]["ids"])
            verdict = audit_answer(auditor, prompt, params, out[key]["ids"])
            if verdict is None or not verdict.ok:
                false_failures.append({"i": key, "kind": kind, "finish": out[key]["finish"],
                                       "why": verdict.describe() if verdict else "cannot audit",
                                       "text": out[key]["text"][:80]})
        # Lies: a greedy answer given as the answer to the chunk's next greedy prompt.
        greedy = [(key, prompt, params) for key, prompt, params in part
                  if params.constraint is None and params.temperature == 0]
        for (key, _, _), (_, prompt, params) in zip(greedy, greedy[1:], strict=False):
            if swaps >= swapped:
                break
            verdict = audit_answer(auditor, prompt, params, out[key]["ids"])
            caught += verdict is not None and not verdict.ok
            swaps += 1
        audit_s += time.perf_counter() - t0
        done = sum(kinds.values())
        figures[label] = {"requests": done, **kinds, "false_failures": len(false_failures),
                          "false_failure_details": false_failures, "swapped_answers": swaps,
                          "swapped_caught": caught, "generate_s": generate_s, "audit_s": audit_s,
                          "completion_tokens": tokens}
        print(f"audit  {label}: {done}/{len(jobs)} honest answers ({kinds['greedy']} greedy, "
              f"{kinds['sampled']} sampled, {kinds['constrained']} constrained): "
              f"{len(false_failures)} false failures; {caught}/{swaps} swapped answers caught "
              f"(generate {generate_s:.0f} s, audit {audit_s:.0f} s wall)", flush=True)
    for f in false_failures:
        print("   false failure:", f)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="answers per direction")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/mmlu"))
    parser.add_argument("--swapped", type=int, default=20, help="greedy answers audited as another prompt's")
    parser.add_argument("--direction", choices=["both", "llamacpp-to-hf", "hf-to-llamacpp"], default="both",
                        help="which engine answers and which audits (default: both ways)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args(argv)
    questions = mmlu_questions(args.data, args.requests)
    hf, llama = load_engines(args.hf_dtype)
    figures: dict[str, Any] = {"hf_dtype": args.hf_dtype, "requests": args.requests,
                               "max_tokens": args.max_tokens}
    same = hf.fingerprint == llama.fingerprint
    figures["fingerprint"] = {"hf": hf.fingerprint.hex(), "llamacpp": llama.fingerprint.hex(),
                              "equal": same}
    print(f"fingerprint  transformers {hf.fingerprint.hex()[:16]}  llama.cpp "
          f"{llama.fingerprint.hex()[:16]}  {'equal' if same else 'DIFFERENT'}")
    bench_tokens(hf, llama, questions, figures)
    if args.direction != "hf-to-llamacpp":
        bench_direction(llama, hf, "llamacpp_audited_by_transformers", questions, args.max_tokens,
                        args.swapped, figures)
    if args.direction != "llamacpp-to-hf":
        bench_direction(hf, llama, "transformers_audited_by_llamacpp", questions, args.max_tokens,
                        args.swapped, figures)
    llama.close()
    if args.json:
        print(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
