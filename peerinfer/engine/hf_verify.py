"""The Transformers engine's check of pulled KV (``TransformersEngine.token_errors``, issue 24).

The sampled tokens are recomputed in one forward pass (up to ``_GROUP`` of them a pass) over the
pulled KV: each layer's cache (``_CheckLayer``) holds the group's new K/V rows first, then the
cells before the group's last token (the cached blocks, then the pulled ones decoded, read as
per-block views and joined in the one copy the pass's cache update makes). The group's tokens
run as one batch of queries at their own positions, under a 4-D attention mask in which the
query for position ``p`` sees the cached and pulled cells ``0 .. p-1`` and its own new row, and
nothing else (not the pulled cell of ``p``, not the other checked tokens). Each query's new K/V
row in every layer is then the honest KV of token ``p`` given the pulled KV before it, and is
compared with the pulled KV of ``p``. The attention runs in chunks of ``_CHUNK`` queries, each
over the cells before its last token only (sdpa; other attentions take the whole mask), so
checking a token costs about one token's prefill at its position, wherever the tokens lie
(docs/performance.md, "Checking pulled KV").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

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

#: Within a pass the attention runs in chunks of this many queries (by position), each over
#: the cells up to its last token only, so a query's attention costs about what it costs in a
#: prefill (the cells before it) instead of running over every cell of the pass, masked out.
#: The matrix products still run once for the whole pass. 0: one attention over every cell,
#: masked, as the check ran it until Dec 6 (``bench/kv_bench.py verifycost --granularities
#: token,dense`` compares them).
_CHUNK = 32

_CHECK_ATTENTION = "peerinfer_kv_check"


class _Chunks:
    """What the chunked attention of a check pass needs: each chunk's query rows ``(a, b)``,
    the key columns it reads (the new rows, then the pulled cells before its last token), and
    its mask over those columns."""

    __slots__ = ("slices", "widths", "masks")

    def __init__(self, mask: torch.Tensor, queries: int, positions: Sequence[int]) -> None:
        self.slices = [(a, min(a + _CHUNK, queries)) for a in range(0, queries, _CHUNK)]
        self.widths = [queries + positions[b - 1] for _, b in self.slices]
        self.masks = [mask[:, :, a:b, :w] for (a, b), w in zip(self.slices, self.widths, strict=True)]


class _CheckKV:
    """One layer's keys (or values) of a check pass, ``[1, kv_heads, new + cells, head_dim]``,
    with the chunks the attention runs in."""

    __slots__ = ("chunks", "tensor")

    def __init__(self, chunks: _Chunks, tensor: torch.Tensor) -> None:
        self.chunks = chunks
        self.tensor = tensor


class _CheckLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers leaves it untyped
    """One layer of a check pass: the pulled cells as per-block views (``[2, kv_heads, n,
    head_dim]`` pieces). ``update`` keeps the checked tokens' fresh K/V and returns them FIRST,
    then the pulled cells, in the one copy a ``DynamicLayer`` update makes anyway (no copy of
    the pulled KV into a cache before the pass). New rows first: a chunk of queries then reads
    a prefix of the keys, a view, however far it reaches into the pulled cells."""

    def __init__(self, pieces: list[torch.Tensor], cells: int, chunks: _Chunks | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._pieces, self._cells, self._chunks = pieces, cells, chunks
        self.fresh: torch.Tensor | None = None  # [2, kv_heads, new, head_dim]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]:
        new = torch.stack((key_states[0], value_states[0]))
        self.fresh = new
        kv = torch.cat([new, *self._pieces], dim=2)
        keys, values = kv[0].unsqueeze(0), kv[1].unsqueeze(0)
        if self._chunks is None:
            return keys, values
        return _CheckKV(self._chunks, keys), _CheckKV(self._chunks, values)

    def get_seq_length(self) -> int:
        return self._cells


def _check_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa of a check pass, chunk by chunk (``_Chunks``), each chunk's rows over its prefix of
    the keys under its boolean mask, no causal flag. Grouped heads read the shared K/V heads
    (``enable_gqa``) instead of the copies ``sdpa_attention_forward`` makes for a masked call
    (``repeat_kv``): on the default model the copies cost more than the masked-out cells saved.
    Returns ``[1, tokens, heads, head_dim]`` like every attention function."""
    assert isinstance(key, _CheckKV) and isinstance(value, _CheckKV)
    chunks = key.chunks
    k, v = key.tensor, value.tensor
    gqa = int(getattr(module, "num_key_value_groups", 1)) > 1
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], k[:, :, :w], v[:, :, :w], attn_mask=mask, dropout_p=0.0,
            scale=scaling, is_causal=False, enable_gqa=gqa,
        )
        for (a, b), w, mask in zip(chunks.slices, chunks.widths, chunks.masks, strict=True)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(_CHECK_ATTENTION, _check_attention)


def _recompute(
    engine: TransformersEngine,
    segments: Sequence[torch.Tensor],
    tokens: Sequence[int],
    positions: Sequence[int],
    device: Any,
) -> torch.Tensor:
    """One forward pass of the tokens at ``positions`` (ascending) over the cells of
    ``segments`` (each ``[layers, 2, kv_heads, cells, head_dim]``, in order) before the last of
    them; their fresh K/V, ``[layers, 2, kv_heads, len(positions), head_dim]``."""
    cells = positions[-1]  # the cells any of them may see
    q = len(positions)
    # Keys: the q new rows, then cells 0 .. cells-1. The query for position p sees its own new
    # row and the cells before p. As the engine's own prefill masks: boolean (True: attend) for
    # sdpa, additive (0: attend) for the eager attention.
    rows = torch.arange(q, device=device)
    key = torch.arange(q + cells, device=device)
    pos = torch.tensor(list(positions), device=device)
    seen = (key[None, :] == rows[:, None]) | (
        (key[None, :] >= q) & (key[None, :] < q + pos[:, None])
    )
    seen = seen.view(1, 1, q, q + cells)
    mask: torch.Tensor
    if engine._bool_mask:
        mask = seen
    else:
        mask = torch.zeros(seen.shape, dtype=engine.dtype, device=device).masked_fill(
            ~seen, torch.finfo(engine.dtype).min
        )
    # The chunked attention needs the model's attention modules to hand the cache's keys on
    # unchanged (the packed prefill's condition) and sdpa's boolean mask.
    chunked = _CHUNK > 0 and engine._bool_mask and engine._packed_prefill
    chunks = _Chunks(mask, q, positions) if chunked else None
    pieces: list[list[torch.Tensor]] = [[] for _ in range(engine._layers)]
    start = 0
    for seg in segments:
        n = min(int(seg.shape[3]), cells - start)
        if n <= 0:
            break
        for i, layer in enumerate(seg[:, :, :, :n].unbind(0)):
            pieces[i].append(layer)
        start += n
    cache = DynamicCache(config=engine.model.config)
    layers: list[Any] = cache.layers
    check_layers = [_CheckLayer(pieces[i], cells, chunks) for i in range(len(layers))]
    layers[:] = check_layers
    kwargs: dict[str, Any] = {engine._cache_kw: cache, "use_cache": True}
    if engine._logits_kw is not None:
        kwargs[engine._logits_kw] = 1
    config = engine.model.config
    before = config._attn_implementation
    if chunks is not None:
        config._attn_implementation = _CHECK_ATTENTION
    try:
        engine.model(
            input_ids=torch.tensor([[int(tokens[p]) for p in positions]], device=device),
            position_ids=pos.view(1, q),
            attention_mask=mask,
            **kwargs,
        )
    finally:
        config._attn_implementation = before
    fresh = [layer.fresh for layer in check_layers]
    assert all(f is not None for f in fresh)
    return torch.stack(fresh)  # type: ignore[arg-type]


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
    # Each pulled block's largest magnitude (the errors' scale) comes with its decoding's
    # finiteness check, in the same pass (``_decode_scaled``). Checked tokens lie in pulled
    # blocks only.
    scales: dict[int, float] = {}
    for k in range(last + 1):
        segment, scales[first_block + k] = engine._decode_scaled(blocks[k])
        segments.append(segment.payload)
    start = first_block * bs
    positions = [start + c for c in wanted]
    device = engine.device
    out: list[tuple[int, float]] = []
    with torch.inference_mode():
        for g in range(0, len(positions), _GROUP):
            group = positions[g:g + _GROUP]
            fresh = _recompute(engine, segments, tokens, group, device)
            for j, p in enumerate(group):
                block = segments[p // bs]
                pulled = block[:, :, :, p % bs].to(fresh.dtype)
                scale = scales[p // bs]
                diff = float((fresh[:, :, :, j] - pulled).abs().max())
                # NaN (diff != diff) or a zero block that should not be: no match at all.
                ok = scale > 0.0 and diff == diff
                out.append((p - start, 0.0 if diff == 0.0 else diff / scale if ok else math.inf))
    return out


__all__ = ["token_errors"]
