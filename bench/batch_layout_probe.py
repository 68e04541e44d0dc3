"""Probe: one decode step of 8 MMLU 5-shot requests (2 subjects) in the two batch layouts.

``padded``: one row per request, left-padded to the longest, a [B, 1, 1, L] mask and per-row
positions (every row holds its own copy of its subject's prefix). ``packed``: one row holding each
subject's prefix once and every request's own tokens, a [1, 1, B, total] mask saying which keys
each request's query sees. Prints one JSON object of median step times (1 torch thread).
Run: PYTHONPATH=. python bench/batch_layout_probe.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from peerinfer.engine.hf import TransformersEngine  # noqa: E402
from peerinfer.workload import MMLU, default_data_dir, five_shot_prefix, question_suffix  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    engine = TransformersEngine(device="cpu", threads=1)
    model = engine.model
    mmlu = MMLU.load(default_data_dir())
    groups = []
    for subject in mmlu.subjects[:2]:
        prefix = engine.tokenize(five_shot_prefix(subject, mmlu.dev(subject)))
        suffixes = [engine.tokenize(question_suffix(q))[1:] for q in mmlu.test(subject)[:4]]
        groups.append((prefix, suffixes))

    def kv_of(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
        return [(layer.keys, layer.values) for layer in cache.layers]

    n_layers = len(model.model.layers)
    rows = []  # (prefix kv, suffix kv, total length)
    prefix_kv = []
    for prefix, suffixes in groups:
        pkv = kv_of(prefix)
        prefix_kv.append(pkv)
        for s in suffixes:
            full = kv_of(prefix + s)
            rows.append((len(prefix), full))
    lengths = [int(full[0][0].shape[2]) for _, full in rows]
    b, lmax = len(rows), max(lengths)

    def timed(fn, reps: int = 7) -> float:
        fn()
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    ids = torch.full((b, 1), 42)

    def padded() -> None:
        cache = DynamicCache(config=model.config)
        for li, layer in enumerate(cache.layers):
            k = torch.zeros(b, *rows[0][1][li][0].shape[1:2], lmax, rows[0][1][li][0].shape[3])
            v = torch.zeros_like(k)
            for r, (_, full) in enumerate(rows):
                k[r, :, lmax - lengths[r] :] = full[li][0][0]
                v[r, :, lmax - lengths[r] :] = full[li][1][0]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        mask = torch.zeros(b, 1, 1, lmax + 1, dtype=torch.bool)
        for r in range(b):
            mask[r, 0, 0, lmax - lengths[r] :] = True
        pos = torch.tensor([[n] for n in lengths])
        with torch.inference_mode():
            t = time.perf_counter()
            model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache,
                  use_cache=True, logits_to_keep=1)
            padded_times.append(time.perf_counter() - t)

    def packed() -> None:
        cache = DynamicCache(config=model.config)
        owner = []  # per key: ("p", group) or ("r", row)
        pieces_per_layer: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n_layers)]
        r = 0
        for g, (prefix, suffixes) in enumerate(groups):
            plen = len(prefix)
            for li in range(n_layers):
                pieces_per_layer[li].append(prefix_kv[g][li])
            owner += [("p", g)] * plen
            for _ in suffixes:
                full = rows[r][1]
                for li in range(n_layers):
                    pieces_per_layer[li].append((full[li][0][:, :, plen:], full[li][1][:, :, plen:]))
                owner += [("r", r)] * (lengths[r] - plen)
                r += 1
        for li, layer in enumerate(cache.layers):
            k = torch.cat([p[0] for p in pieces_per_layer[li]], dim=2)
            v = torch.cat([p[1] for p in pieces_per_layer[li]], dim=2)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        total = len(owner)
        row_group = [g for g, (_, s) in enumerate(groups) for _ in s]
        mask = torch.zeros(1, 1, b, total + b, dtype=torch.bool)
        for q in range(b):
            for j, (kind, who) in enumerate(owner):
                if (kind == "p" and who == row_group[q]) or (kind == "r" and who == q):
                    mask[0, 0, q, j] = True
            mask[0, 0, q, total + q] = True
        pos = torch.tensor([lengths])
        with torch.inference_mode():
            t = time.perf_counter()
            model(input_ids=ids.view(1, b), position_ids=pos, attention_mask=mask, cache=cache,
                  use_cache=True, logits_to_keep=b)
            packed_times.append(time.perf_counter() - t)

    padded_times: list[float] = []
    packed_times: list[float] = []
    for _ in range(8):
        padded()
        packed()
    one = kv_of(groups[0][0] + groups[0][1][0])
    print(json.dumps({
        "requests": b,
        "lengths": lengths,
        "padded_step_s": round(statistics.median(padded_times[1:]), 4),
        "packed_step_s": round(statistics.median(packed_times[1:]), 4),
        "padded_keys": b * lmax,
        "packed_keys": sum(len(p) for p, _ in groups) + sum(n - len(groups[i // 4][0]) for i, n in enumerate(lengths)),
    }))
    del one


if __name__ == "__main__":
    main()
