"""The Transformers engine's check of pulled KV (``TransformersEngine.token_errors``, issue 24).

The sampled tokens are recomputed in one forward pass (up to ``_GROUP`` of them a pass) over the
pulled KV: the cache holds the KV of every token up to the group's last (the cached
blocks, then the pulled ones decoded), and the group's tokens are run after it as one batch of
queries at their own positions, under a 4-D attention mask in which the query for position ``p`` sees the cached
and pulled cells ``0 .. p-1`` and itself, and nothing else (not the pulled cell of ``p``, not the
other checked tokens). Each query's new K/V row in every layer is then the honest KV of token
``p`` given the pulled KV before it, and is compared with the pulled KV of ``p``. So checking a
token costs about one token's prefill at its position, wherever the tokens lie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from peerinfer.engine.hf_layers import _cache_layers
from peerinfer.errors import EngineError

#: The Transformers engine (not imported: it imports this module).
TransformersEngine = Any


#: Checked tokens run in one forward pass, at most: the tokens are sorted by position and each
#: group's pass runs over the cells up to its last token only. One pass for all is the fastest
#: (on the default model at 2,000 tokens, 160 checked tokens in groups of 48 took 1.1-1.4x as
#: long as one pass, in groups of 24 1.5-2x: smaller matrix products and a pass's overhead cost
#: more than the attention over masked-out cells saves); the bound only keeps a huge pull's
#: mask and batch bounded.
_GROUP = 512


def _recompute(
    engine: TransformersEngine,
    full: torch.Tensor,
    tokens: Sequence[int],
    positions: Sequence[int],
    device: Any,
) -> torch.Tensor:
    """One forward pass of the tokens at ``positions`` (ascending) over the cells of ``full``
    (``[layers, 2, kv_heads, cells, head_dim]``) up to the last of them; their fresh K/V,
    ``[layers, 2, kv_heads, len(positions), head_dim]``."""
    width = positions[-1] + 1  # the cells any of them may see (the pulled cell of the last one
    # too, masked out like the others' own)
    q = len(positions)
    kv = engine.kv_cache_from_segments([full[:, :, :, :width]], contiguous=True)
    # As the engine's own prefill masks: boolean (True: attend) for sdpa, additive (0: attend)
    # for the eager attention.
    if engine._bool_mask:
        mask = torch.zeros((1, 1, q, width + q), dtype=torch.bool, device=device)
        seen: Any = True
    else:
        mask = torch.full((1, 1, q, width + q), torch.finfo(engine.dtype).min,
                          dtype=engine.dtype, device=device)
        seen = 0.0
    for j, p in enumerate(positions):
        mask[0, 0, j, :p] = seen
        mask[0, 0, j, width + j] = seen
    kwargs: dict[str, Any] = {engine._cache_kw: kv, "use_cache": True}
    if engine._logits_kw is not None:
        kwargs[engine._logits_kw] = 1
    engine.model(
        input_ids=torch.tensor([[int(tokens[p]) for p in positions]], device=device),
        position_ids=torch.tensor([list(positions)], device=device),
        attention_mask=mask,
        **kwargs,
    )
    return torch.stack([
        torch.stack((layer.keys[0, :, width:], layer.values[0, :, width:]))
        for layer in _cache_layers(kv)
    ])


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
    if (first_block + last + 1) * bs > len(tokens):
        raise ValueError(f"{last + 1} pulled blocks need more than {len(tokens)} tokens")
    head = cache.match(tuple(tokens[: first_block * bs]), touch=False).nodes
    if len(head) < first_block:
        raise EngineError(f"blocks before {first_block} are no longer cached here")
    segments: list[torch.Tensor] = [n.payload for n in head[:first_block]]
    for k in range(last + 1):
        segments.append(engine.decode_block(blocks[k], (first_block + k) * bs).payload)
    start = first_block * bs
    positions = [start + c for c in wanted]
    device = engine.device
    out: list[tuple[int, float]] = []
    scales: dict[int, float] = {}
    with torch.inference_mode():
        full = segments[0] if len(segments) == 1 else torch.cat(segments, dim=3)
        for g in range(0, len(positions), _GROUP):
            group = positions[g:g + _GROUP]
            fresh = _recompute(engine, full, tokens, group, device)
            for j, p in enumerate(group):
                block = segments[p // bs]
                pulled = block[:, :, :, p % bs].to(fresh.dtype)
                scale = scales.get(p // bs, -1.0)
                if scale < 0.0:
                    scale = scales[p // bs] = float(block.abs().max())
                diff = float((fresh[:, :, :, j] - pulled).abs().max())
                # NaN (diff != diff) or a zero block that should not be: no match at all.
                ok = scale > 0.0 and diff == diff
                out.append((p - start, 0.0 if diff == 0.0 else diff / scale if ok else math.inf))
    return out


__all__ = ["token_errors"]
