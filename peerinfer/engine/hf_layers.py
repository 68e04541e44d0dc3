"""Cache layers of the Transformers engine: ``DynamicLayer`` stand-ins through which a forward
pass reuses cached KV segments without a copy (``_ReusedPrefixLayer``), runs a padded batched
prefill (``_PrefillLayer``) or a packed one (``_PackedLayer`` with the registered
``_packed_attention``). See "KV reuse" and "Batched prefill" in :mod:`peerinfer.engine.hf`.
The names keep their underscore: they are the hf modules' own plumbing, not an API."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _cache_layers(cache: DynamicCache) -> list[Any]:
    """``cache.layers``, untyped: transformers types them as a union of layer kinds, but the
    engine reads keys and values only of caches whose layers are all ``DynamicLayer`` (checked
    at load: ``supports_prefix_cache``) or its own stand-ins below."""
    return cache.layers


_PACKED_ATTENTION = "peerinfer_packed_prefill"


class _PackedRows:
    """What the packed attention needs of a batched prefill: each request's slice of the
    packed query tokens and its causal mask over its own keys."""

    __slots__ = ("slices", "masks")

    def __init__(self, slices: list[tuple[int, int]], masks: list[torch.Tensor]) -> None:
        self.slices = slices
        self.masks = masks


class _PackedKV:
    """One layer's keys (or values) of a packed prefill: one tensor per request, each its
    whole cache (past and new) ``[1, kv_heads, tokens, head_dim]``, as the attention module
    hands them on to :func:`_packed_attention`."""

    __slots__ = ("rows", "tensors")

    def __init__(self, rows: _PackedRows, tensors: list[torch.Tensor]) -> None:
        self.rows = rows
        self.tensors = tensors


def _causal_after(past: int, n: int, device: torch.device) -> torch.Tensor:
    """The mask ``[1, 1, n, past + n]`` of ``n`` new tokens after ``past`` cached ones."""
    key = torch.arange(past + n, device=device)
    query = torch.arange(past, past + n, device=device)
    return (key[None, :] <= query[:, None]).view(1, 1, n, past + n)


def _continue_cache(cache: DynamicCache | None, config: Any) -> DynamicCache:
    """A new cache holding what ``cache`` holds (the same tensors, not copied); updating it
    leaves ``cache`` as it was (a ``DynamicLayer`` update concatenates into new tensors)."""
    assert cache is not None
    fresh = DynamicCache(config=config)
    layers: list[Any] = fresh.layers
    for i, layer in enumerate(_cache_layers(cache)):
        if isinstance(layer, _ReusedPrefixLayer) and layer._pieces is not None:
            layers[i] = _ReusedPrefixLayer(list(layer._pieces), layer._prefix_length)
        elif layer.is_initialized and layer.keys is not None and layer.keys.numel():
            layers[i].lazy_initialization(layer.keys, layer.values)
            layers[i].keys, layers[i].values = layer.keys, layer.values
    return fresh


class _PackedLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers leaves it untyped
    """One layer of a packed prefill as the model sees it: ``update`` appends each request's
    slice of the packed new states to that request's own layer (as its lone prefill would) and
    hands every request's whole keys and values on to the packed attention."""

    def __init__(self, own: list[Any], rows: _PackedRows) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._own = own
        self._rows = rows
        self.is_initialized = True

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[_PackedKV, _PackedKV]:
        keys, values = [], []
        for layer, (a, b) in zip(self._own, self._rows.slices, strict=True):
            k, v = layer.update(key_states[:, :, a:b], value_states[:, :, a:b])
            keys.append(k)
            values.append(v)
        return _PackedKV(self._rows, keys), _PackedKV(self._rows, values)

    def get_seq_length(self) -> int:
        return 0


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed prefill: each request's queries over its own keys only (sdpa,
    as its lone prefill runs it), so padding costs nothing and requests never see each
    other. ``query``: ``[1, heads, packed tokens, head_dim]``; returns ``[1, tokens, heads,
    head_dim]`` like every attention function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert isinstance(key, _PackedKV) and isinstance(value, _PackedKV)
    rows = key.rows
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, a:b], k, v, mask, dropout=0.0, scaling=scaling, is_causal=False
        )[0]
        for (a, b), k, v, mask in zip(rows.slices, key.tensors, value.tensors, rows.masks, strict=True)
    ]
    return torch.cat(outputs, dim=1), None


transformers.AttentionInterface.register(_PACKED_ATTENTION, _packed_attention)


def _layer_pieces(layer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A decoder cache layer's KV in order, as (keys, values) pieces ``[kv_heads, n, dim]``."""
    if isinstance(layer, _ReusedPrefixLayer) and layer._pieces is not None:
        return [(piece[0], piece[1]) for piece in layer._pieces]
    if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
        return []
    return [(layer.keys[0], layer.values[0])]


class _PrefillLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers leaves it untyped
    """One layer of a batched prefill's KV state: ``update`` writes the real query slots' new
    states into the buffers' last columns (padding slots leave the row's older states there
    untouched) and returns the whole buffers."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, write: torch.Tensor, past: int
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._keys, self._values, self._write, self._past = keys, values, write, past
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self._past
        k, v = self._keys, self._values
        k[:, :, p:] = torch.where(self._write, key_states, k[:, :, p:])
        v[:, :, p:] = torch.where(self._write, value_states, v[:, :, p:])
        return k, v

    def get_seq_length(self) -> int:
        return self._past


class _ReusedPrefixLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers leaves it untyped
    """A ``DynamicLayer`` whose cached prefix is still a list of per-block segment views.

    The first ``update`` concatenates those pieces and the new states into one tensor (the copy
    ``DynamicLayer.update`` would make anyway), so reusing a prefix costs no extra copy; later
    updates are plain ``DynamicLayer`` ones. The segments are only read.
    """

    def __init__(self, pieces: list[torch.Tensor], length: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._pieces: list[torch.Tensor] | None = pieces  # each [2, kv_heads, bs, head_dim]
        self._prefix_length = length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = self._pieces
        if pieces is None:
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = torch.stack((key_states[0], value_states[0]))  # [2, kv_heads, n, head_dim]
        kv = torch.cat([*pieces, new], dim=2)  # [2, kv_heads, prefix + n, head_dim]
        self.keys, self.values = kv[0].unsqueeze(0), kv[1].unsqueeze(0)
        self._pieces = None
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if self._pieces is not None:
            return self._prefix_length
        return int(super().get_seq_length())
