"""The Transformers engine's check of pulled KV (``TransformersEngine.token_errors``, issue 24).

Every sampled token is recomputed in ONE forward pass over the pulled KV: the cache holds the
KV of every token up to the end of the last checked block (the cached blocks, then the pulled
ones decoded), and the checked tokens are run after it as one batch of queries at their own
positions, under a 4-D attention mask in which the query for position ``p`` sees the cached
and pulled cells ``0 .. p-1`` and itself, and nothing else (not the pulled cell of ``p``, not the
other checked tokens). Each query's new K/V row in every layer is then the honest KV of token
``p`` given the pulled KV before it, and is compared with the pulled KV of ``p``. So checking a
token costs about one token's prefill at its position, wherever the tokens lie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from peerinfer.engine.hf_layers import _cache_layers
from peerinfer.errors import EngineError

if TYPE_CHECKING:
    from peerinfer.engine.hf import TransformersEngine


def token_errors(
    engine: TransformersEngine,
    tokens: Sequence[int],
    first_block: int,
    blocks: Sequence[bytes | memoryview],
    checks: Sequence[int],
) -> list[tuple[int, float]]:
    """``Engine.token_errors`` for the Transformers engine (see the module docstring)."""
    if not checks:
        return []
    cache = engine.radix_cache
    assert cache is not None
    bs = cache.block_size
    wanted = sorted(set(int(c) for c in checks))
    if wanted[0] < 0 or wanted[-1] >= len(blocks) * bs:
        raise ValueError(f"checks outside the {len(blocks) * bs} pulled tokens")
    last = wanted[-1] // bs  # the last pulled block needed
    width = (first_block + last + 1) * bs  # cells in the cache the checks run over
    if width > len(tokens):
        raise ValueError(f"{last + 1} pulled blocks need {width} tokens, got {len(tokens)}")
    head = cache.match(tuple(tokens[: first_block * bs]), touch=False).nodes
    if len(head) < first_block:
        raise EngineError(f"blocks before {first_block} are no longer cached here")
    segments: list[torch.Tensor] = [n.payload for n in head[:first_block]]
    for k in range(last + 1):
        segments.append(engine.decode_block(blocks[k], (first_block + k) * bs).payload)
    start = first_block * bs
    positions = [start + c for c in wanted]
    q = len(positions)
    device = engine.device
    with torch.inference_mode():
        kv = engine.kv_cache_from_segments(segments, contiguous=True)
        # Additive mask (0: attend): works for the eager and the sdpa attention alike.
        mask = torch.full((1, 1, q, width + q), torch.finfo(engine.dtype).min,
                          dtype=engine.dtype, device=device)
        for j, p in enumerate(positions):
            mask[0, 0, j, :p] = 0.0
            mask[0, 0, j, width + j] = 0.0
        kwargs: dict[str, Any] = {engine._cache_kw: kv, "use_cache": True}
        if engine._logits_kw is not None:
            kwargs[engine._logits_kw] = 1
        engine.model(
            input_ids=torch.tensor([[int(tokens[p]) for p in positions]], device=device),
            position_ids=torch.tensor([positions], device=device),
            attention_mask=mask,
            **kwargs,
        )
        # [layers, 2, kv_heads, q, head_dim]: the checked tokens' fresh K/V.
        fresh = torch.stack([
            torch.stack((layer.keys[0, :, width:], layer.values[0, :, width:]))
            for layer in _cache_layers(kv)
        ])
        out: list[tuple[int, float]] = []
        for j, (c, p) in enumerate(zip(wanted, positions, strict=True)):
            block = segments[p // bs]
            pulled = block[:, :, :, p % bs].to(fresh.dtype)
            scale = float(block.abs().max())
            diff = float((fresh[:, :, :, j] - pulled).abs().max())
            # NaN (diff != diff) or a zero block that should not be: no match at all.
            ok = scale > 0.0 and diff == diff
            out.append((c, 0.0 if diff == 0.0 else diff / scale if ok else math.inf))
    return out


__all__ = ["token_errors"]
