"""One request's decoding on the Transformers engine, and the batch KV state decoders share.

``_TransformersDecoder`` runs its prompt alone into a cache of its own (in chunks), then decodes
alone (``step``) or as one row of the engine's ``_BatchKV`` (``decode_batch``). The decoder and
the batch state live together because each edits the other (rows join, leave and park).

They reach the engine through :class:`ModelHost`, the part of
:class:`~peerinfer.engine.hf.TransformersEngine` they use (the model, its shapes, the forward
pass and KV export), so that this module does not import ``hf``, which opens decoders.

Batched decoding
----------------
A decoder first runs its prompt alone, into its own cache (``prefill``, in chunks, keeping the
last position's logits). ``decode_batch`` then decodes one token for every decoder in one forward
pass over a **left-padded batch KV state** (``_BatchKV``, here): per layer one K and one V buffer
``[rows, kv_heads, columns, head_dim]``, allocated with free columns to the right; row ``r`` holds
its request's ``kv_tokens`` states in the columns just before a shared write column ``end``. A
step writes every row's new K/V into column ``end`` in place (no per-step copy of the cache, which
``DynamicLayer``'s concatenation would make), attends over ``[end - longest, end]`` with a
``[rows, 1, 1, width]`` mask hiding each row's left padding, and gives each row its own position
(its ``kv_tokens``), so each row computes what a lone run would, up to the rounding of batched
matrix products. Membership changes edit the state instead of rebuilding it: a request joins by
one copy of its own cache into a free row (its own cache is then dropped); it leaves by moving the
last row into its place; a decoder asked to step alone is *parked* (its row copied back into a
cache of its own). The buffers are reallocated only when rows or columns run out (columns: then
compacted to the longest row plus headroom, so the copy is amortised over many steps) and freed
when the batch empties. Memory: the scheduler reserves ``(prompt + max_tokens)`` tokens of KV per
running request; the buffers take ``row capacity x columns`` tokens, which adds the shorter rows'
left padding, the free columns (at least 64, or half the longest row) and unused rows to that:
this overhead is not accounted against ``--cache-bytes``. Greedy rows take one batched argmax; sampled rows draw from their own
seeded generator, so a seeded request's tokens do not depend on its neighbours.

**Shared prefixes are read once per step.** Rows whose requests reused the same cached blocks
(the same segment objects from the radix cache: an MMLU subject's 5-shot prefix, a system
prompt) hold identical copies of those tokens' KV. Reading every copy made the step's attention
memory-bound: 16 rows of 340-700 tokens spent about 100 ms of a 250 ms step in sdpa (one
thread, float32). With such groups (at least ``_MIN_SHARED_TOKENS`` tokens shared by two or
more rows) the step runs ``_shared_prefix_attention`` instead of sdpa: each group's queries
(rows x heads) attend over one member's copy of the prefix in one product, every row attends
over its own tokens after its group's prefix (padded only to the longest such suffix), and the
two partial softmaxes merge through their maxima and sums (the split that cascade or
flash-decoding attention uses). The KV layout does not change (each row still holds its whole
KV, so parking, leaving and export are as before); only the reads do. The result is the same
attention up to float rounding, as a batched product is; measured in docs/performance.md
("node_x_16 on the Transformers engine"). Used on float32 CPU engines of the architectures
whose batched prefill is packed (their attention modules hand the cache's keys and values to
the attention function unchanged); elsewhere the step runs sdpa over the padded rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from peerinfer.core.messages import SamplingParams
from peerinfer.engine.constraints import TokenGuide
from peerinfer.engine.decoder import Decoder, DecodeRequest, KVSegment
from peerinfer.engine.hf_layers import _cache_layers

#: Least number of free columns a batch KV state is (re)allocated with: decode steps between
#: two compactions.
_MIN_HEADROOM = 64
#: The attention function of a batched decode step whose rows share cached prefixes
#: (``_shared_prefix_attention``, registered below).
_BATCH_ATTENTION = "peerinfer_batch_decode"
#: Least number of cached prefix tokens rows must share for their step to attend over the
#: prefix once (below it the extra small products cost more than the reads they save).
_MIN_SHARED_TOKENS = 64


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where the time to first token of the last request went (benchmarks, calibration).

    ``build_s``: assembling the model's cache from stored segments; ``prefill_s``: running the
    uncached prompt tokens and picking the first token.
    """

    cached_tokens: int
    prefill_tokens: int
    build_s: float
    prefill_s: float


class ModelHost(Protocol):
    """What a decoder and the batch KV state use of their engine (``TransformersEngine``)."""

    model: Any
    device: torch.device
    dtype: torch.dtype
    supports_prefix_cache: bool
    prefill_chunk_tokens: int
    max_batch_size: int
    last_timings: RequestTimings | None
    _batch: _BatchKV | None
    _kv_heads: int
    _head_dim: int
    _layers: int
    _bool_mask: bool
    _shared_prefix_attention: bool
    _cache_kw: str
    _logits_kw: str | None

    def kv_cache_from_segments(
        self, segments: Sequence[torch.Tensor], *, contiguous: bool = False
    ) -> DynamicCache: ...

    def forward(self, tokens: Sequence[int], cache: DynamicCache) -> torch.Tensor: ...

    def export_blocks(
        self, cache: DynamicCache, first_block: int, n_blocks: int, block_size: int
    ) -> list[KVSegment]: ...

    def _export_kv(
        self,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        first_block: int,
        n_blocks: int,
        block_size: int,
    ) -> list[KVSegment]: ...


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy (temperature 0, first maximum as in transformers) or temperature/top-p sampling."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest head whose mass reaches top_p (always at least one token).
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def guided_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    guide: TokenGuide | None,
) -> int:
    """``sample_token`` under the request's guide: the constraint's mask applied first, and the
    raw logits' log-softmax reported when logprobs are wanted."""
    if guide is None:
        return sample_token(logits, params, generator)
    raw = logits
    allowed = guide.allowed()
    if allowed is not None:
        keep = torch.from_numpy(allowed).to(logits.device)
        logits = logits.masked_fill(~keep, float("-inf"))
    token = sample_token(logits, params, generator)
    if guide.logprobs:
        lps = torch.log_softmax(raw.float(), dim=-1)
        top: list[tuple[int, float]] = []
        if guide.top_logprobs:
            values, ids = torch.topk(lps, guide.top_logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        guide.note(token, float(lps[token]), top)
    return token


class _TransformersDecoder(Decoder):
    """One request: its prompt runs alone into ``_cache``; then it decodes alone (``step``) or
    as row ``_row`` of the engine's batch KV state (``decode_batch``), never both at once."""

    def __init__(self, engine: ModelHost, request: DecodeRequest) -> None:
        self._engine = engine
        self._request = request
        self._params = request.params
        t0 = time.perf_counter()
        segments = request.prefix.segments if engine.supports_prefix_cache else ()
        self._cache: DynamicCache | None = engine.kv_cache_from_segments(segments)
        self._build_s = time.perf_counter() - t0
        self._kv = self._reused = request.prefix.tokens if segments else 0
        #: Tokens to run next: the prompt's rest during prefill, then the last sampled token.
        self._pending: list[int] = list(request.tokens[self._kv :])
        self._prompt_left = len(self._pending)
        #: The last prompt position's logits, once prefill is done and until sampled.
        self._logits: torch.Tensor | None = None
        self._prefill_s = 0.0
        self._row: int | None = None
        self._generator: torch.Generator | None = None
        if self._params.temperature > 0:
            self._generator = torch.Generator(device=engine.device)
            self._generator.manual_seed(request.seed)
        self._first = True

    @property
    def _ready_to_sample(self) -> bool:
        """Prefill unfinished, or finished with its logits not sampled: ``step()`` alone."""
        return self._prompt_left > 0 or self._logits is not None

    @property
    def prefill_remaining(self) -> int:
        return self._prompt_left

    def prefill(self, max_tokens: int) -> bool:
        if self._prompt_left == 0:
            return True
        cache = self._cache
        assert cache is not None, "prefill() after close()"
        t0 = time.perf_counter()
        engine = self._engine
        n = max(0, min(max_tokens, self._prompt_left))
        chunk = engine.prefill_chunk_tokens
        logits = None
        for i in range(0, n, chunk):
            if i and self._request.cancel.is_set():
                n = i
                break
            logits = engine.forward(self._pending[i : min(n, i + chunk)], cache)
        del self._pending[:n]
        self._kv += n
        self._prompt_left -= n
        if self._prompt_left == 0:
            self._logits = logits
        self._prefill_s += time.perf_counter() - t0
        return self._prompt_left == 0

    def step(self) -> int | None:
        if self._row is not None:
            self._park()
        if self._prompt_left and not self.prefill(self._prompt_left):
            return None  # cancelled between prefill chunks
        engine, cache = self._engine, self._cache
        assert cache is not None, "step() after close()"
        t0 = time.perf_counter()
        if self._logits is not None:
            logits, self._logits = self._logits, None
        else:
            logits = engine.forward(self._pending, cache)
            self._kv += len(self._pending)
        with torch.inference_mode():
            token = guided_token(logits, self._params, self._generator, self._request.guide)
        if self._first:
            self._first = False
            engine.last_timings = RequestTimings(
                cached_tokens=self._reused,
                prefill_tokens=len(self._request.tokens) - self._reused,
                build_s=self._build_s,
                prefill_s=self._prefill_s + time.perf_counter() - t0,
            )
        self._pending = [token]
        return token

    def _park(self) -> None:
        """Leave the batch, taking this request's KV back into a cache of its own."""
        batch = self._engine._batch
        assert batch is not None and self._row is not None
        self._cache = batch.leave(self, keep=True)

    @property
    def kv_tokens(self) -> int:
        return self._kv

    def export_segments(self, first_block: int) -> list[KVSegment]:
        bs = self._request.block_size
        n_blocks = self._kv // bs - first_block
        if self._row is not None:
            batch = self._engine._batch
            assert batch is not None
            return self._engine._export_kv(batch.row_kv(self._row), first_block, n_blocks, bs)
        if self._cache is None:
            return []
        return self._engine.export_blocks(self._cache, first_block, n_blocks, bs)

    def close(self) -> None:
        if self._row is not None:
            batch = self._engine._batch
            if batch is not None:
                batch.leave(self, keep=False)
            self._row = None
        self._cache = None
        self._logits = None


class _BatchKV:
    """The KV state of the requests decoding together (see "Batched decoding" above).

    ``rows[r]`` is the decoder of row ``r`` (rows ``0 .. len(rows)`` are live, so a forward pass
    uses a view of the leading rows); its ``kv_tokens`` states sit in columns
    ``end - kv_tokens .. end`` of every layer's buffers, and the next step writes column ``end``.
    """

    def __init__(self, engine: ModelHost) -> None:
        self._engine = engine
        self.rows: list[_TransformersDecoder] = []
        self.end = 0
        self._keys: list[torch.Tensor] = []  # per layer [row capacity, kv_heads, columns, dim]
        self._values: list[torch.Tensor] = []
        # The cache object the model sees: its layers write into and read from the buffers.
        self._cache = DynamicCache(config=engine.model.config)
        layers: list[Any] = self._cache.layers
        for i in range(len(layers)):
            layers[i] = _BatchLayer(self, i)
        self._n = 0  # rows and first column of the forward pass in progress
        self._start = 0
        self._plan: _StepPlan | None = None  # the step in progress's shared prefixes

    @property
    def _capacity(self) -> tuple[int, int]:
        if not self._keys:
            return 0, 0
        return int(self._keys[0].shape[0]), int(self._keys[0].shape[2])

    def _longest(self) -> int:
        return max((d._kv for d in self.rows), default=0)

    def _reallocate(self, rows: int, left: int) -> None:
        """New buffers of ``rows`` rows with the live rows ending at column ``left``, followed
        by free columns; the live KV is copied over once."""
        engine = self._engine
        columns = left + max(_MIN_HEADROOM, left // 2)
        shape = (rows, engine._kv_heads, columns, engine._head_dim)
        new_keys, new_values = [], []
        old: list[tuple[torch.Tensor, torch.Tensor] | None] = (
            list(zip(self._keys, self._values, strict=True)) if self._keys else [None] * engine._layers
        )
        with torch.inference_mode():
            for layer in old:
                # Zeros, not empty: masked-out columns are multiplied by zero weights, and
                # uninitialised memory may hold NaNs, which would survive that.
                k = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
                v = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
                if layer is not None:
                    old_k, old_v = layer
                    for r, d in enumerate(self.rows):
                        n = d._kv
                        k[r, :, left - n : left] = old_k[r, :, self.end - n : self.end]
                        v[r, :, left - n : left] = old_v[r, :, self.end - n : self.end]
                new_keys.append(k)
                new_values.append(v)
        self._keys, self._values = new_keys, new_values
        self.end = left

    def join(self, decoder: _TransformersDecoder) -> None:
        """Copy ``decoder``'s own cache into a free row (its own cache is then dropped)."""
        cache = decoder._cache
        assert cache is not None and decoder._row is None
        n = decoder._kv
        rows, columns = self._capacity
        need = len(self.rows) + 1
        if need > rows or n > self.end or self.end >= columns:
            # Rows grow by doubling (from up to 8) to the engine's batch size, or to what is
            # asked for beyond it.
            cap = self._engine.max_batch_size
            grown = max(need, min(2 * rows or 8, cap)) if need > rows else rows
            self._reallocate(grown, max(n, self._longest()))
        r = len(self.rows)
        with torch.inference_mode():
            for layer, k, v in zip(_cache_layers(cache), self._keys, self._values, strict=True):
                k[r, :, self.end - n : self.end] = layer.keys[0]
                v[r, :, self.end - n : self.end] = layer.values[0]
        self.rows.append(decoder)
        decoder._row = r
        decoder._cache = None

    def leave(self, decoder: _TransformersDecoder, *, keep: bool) -> DynamicCache | None:
        """Drop ``decoder``'s row (the last row moves into it); with ``keep``, its KV as a cache
        of its own."""
        r = decoder._row
        assert r is not None and self.rows[r] is decoder
        own: DynamicCache | None = None
        end, n = self.end, decoder._kv
        with torch.inference_mode():
            if keep:
                own = DynamicCache(config=self._engine.model.config)
                for layer, k, v in zip(_cache_layers(own), self._keys, self._values, strict=True):
                    keys = k[r, :, end - n : end].unsqueeze(0).clone()
                    values = v[r, :, end - n : end].unsqueeze(0).clone()
                    layer.lazy_initialization(keys, values)
                    layer.keys, layer.values = keys, values
            last = len(self.rows) - 1
            if r != last:
                moved = self.rows[last]
                m = moved._kv
                for k, v in zip(self._keys, self._values, strict=True):
                    k[r, :, end - m : end] = k[last, :, end - m : end]
                    v[r, :, end - m : end] = v[last, :, end - m : end]
                self.rows[r] = moved
                moved._row = r
        self.rows.pop()
        decoder._row = None
        if not self.rows:  # free the buffers; the next batch allocates its own
            self._keys, self._values = [], []
            self.end = 0
        return own

    def row_kv(self, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``r``'s live KV per layer, as views ``[kv_heads, kv_tokens, head_dim]``."""
        n, end = self.rows[r]._kv, self.end
        return [(k[r, :, end - n : end], v[r, :, end - n : end]) for k, v in zip(self._keys, self._values, strict=True)]

    def _shared_plan(self) -> _StepPlan | None:
        """The next step's groups of rows sharing a cached prefix (see "Shared prefixes are
        read once per step" above), or None when no two rows share ``_MIN_SHARED_TOKENS``."""
        # A cached block's segment is one object in the radix cache, so rows that reused the
        # same object reused the same tokens up to it. Each row joins the deepest of its
        # segments that another row of the batch reused too (rows of one MMLU subject: its
        # 5-shot prefix; a chat template's system prompt alone is shared more widely but is
        # shorter, and a row sits in one group only).
        paths = [d._request.prefix.segments if d._reused else () for d in self.rows]
        uses: dict[int, int] = {}
        for path in paths:
            for seg in path:
                uses[id(seg)] = uses.get(id(seg), 0) + 1
        by_node: dict[int, tuple[list[int], int]] = {}
        for r, path in enumerate(paths):
            depth = len(path)
            while depth and uses[id(path[depth - 1])] < 2:
                depth -= 1
            if depth:
                members, _ = by_node.setdefault(id(path[depth - 1]), ([], depth))
                members.append(r)
        shared = [0] * len(self.rows)  # per row: the tokens its group reads once
        groups: list[tuple[list[int], int]] = []  # (rows, shared tokens)
        for members, depth in by_node.values():
            tokens = sum(int(seg.shape[3]) for seg in paths[members[0]][:depth])
            if len(members) >= 2 and tokens >= _MIN_SHARED_TOKENS:
                groups.append((members, tokens))
                for r in members:
                    shared[r] = tokens
        if not groups:
            return None
        device, end = self._engine.device, self.end
        own = [d._kv - p for d, p in zip(self.rows, shared, strict=True)]  # tokens after the prefix
        width = max(own) + 1  # the new token's column too
        first_column = end + 1 - width
        columns = torch.arange(first_column, end + 1, device=device)
        starts = torch.tensor([end - k for k in own], device=device)
        hidden = (columns[None, :] < starts[:, None]).view(len(own), 1, 1, width)
        plan_groups = []
        for members, tokens in groups:
            source = members[0]
            start = end - self.rows[source]._kv  # the source row's first column
            index = torch.tensor(members, dtype=torch.long, device=device)
            plan_groups.append((index, source, start, tokens))
        return _StepPlan(first_column, end, hidden, plan_groups)

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Run ``tokens[r]`` after row ``r``'s KV for every row at once; logits ``[rows, vocab]``."""
        engine = self._engine
        rows, columns = self._capacity
        if self.end >= columns:  # out of free columns: compact to the longest row
            self._reallocate(rows, self._longest())
        n = len(self.rows)
        assert len(tokens) == n > 0
        device = engine.device
        lengths = torch.tensor([d._kv for d in self.rows], device=device)  # [n]
        self._plan = self._shared_plan() if engine._shared_prefix_attention else None
        if self._plan is not None:
            # The plan holds the masks; a 4D mask is passed through untouched and ignored.
            self._n, self._start = n, self._plan.first
            mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        else:
            width = int(lengths.max()) + 1
            self._n, self._start = n, self.end + 1 - width
            columns_seen = torch.arange(self._start, self.end + 1, device=device)  # [width]
            visible = columns_seen[None, :] >= (self.end - lengths)[:, None]  # [n, width]
            mask = visible.view(n, 1, 1, width)
            if not engine._bool_mask:
                mask = torch.zeros(mask.shape, dtype=engine.dtype, device=device).masked_fill(
                    ~mask, torch.finfo(engine.dtype).min
                )
        ids = torch.tensor(list(tokens), dtype=torch.long, device=device).view(n, 1)
        kwargs: dict[str, Any] = {engine._cache_kw: self._cache, "use_cache": True}
        if engine._logits_kw is not None:
            kwargs[engine._logits_kw] = 1
        config = engine.model.config
        before = config._attn_implementation
        if self._plan is not None:
            config._attn_implementation = _BATCH_ATTENTION
        try:
            with torch.inference_mode():
                out = engine.model(
                    input_ids=ids, position_ids=lengths.view(n, 1), attention_mask=mask, **kwargs
                )
        finally:
            config._attn_implementation = before
            self._plan = None
        self.end += 1
        for d in self.rows:
            d._kv += 1
        logits: torch.Tensor = out.logits[:, -1]
        return logits


class _BatchLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers leaves it untyped
    """One layer of the batch KV state as the model sees it: ``update`` writes the step's new
    states into the buffers' column ``end`` in place and returns views of the columns the step
    attends over."""

    def __init__(self, batch: _BatchKV, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._batch = batch
        self._index = index
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._batch
        n, start, end = b._n, b._start, b.end
        keys, values = b._keys[self._index], b._values[self._index]
        keys[:n, :, end] = key_states[:, :, 0]  # key_states: [n, kv_heads, 1, head_dim]
        values[:n, :, end] = value_states[:, :, 0]
        if b._plan is not None:  # the whole buffers, for _shared_prefix_attention
            return _StepKV(b._plan, keys), _StepKV(b._plan, values)  # type: ignore[return-value]
        return keys[:n, :, start : end + 1], values[:n, :, start : end + 1]

    def get_seq_length(self) -> int:
        return self._batch.end - self._batch._start


class _StepPlan:
    """What ``_shared_prefix_attention`` needs of a batched decode step: the columns
    ``first .. end`` every row's own tokens (after its group's prefix) lie in, ``hidden``
    ``[rows, 1, 1, width]`` (True: a column before the row's own tokens), and per group of rows
    sharing a prefix (row indices, the row whose copy is read, its first column, tokens)."""

    __slots__ = ("first", "end", "hidden", "groups")

    def __init__(
        self, first: int, end: int, hidden: torch.Tensor,
        groups: list[tuple[torch.Tensor, int, int, int]],
    ) -> None:
        self.first = first
        self.end = end
        self.hidden = hidden
        self.groups = groups


class _StepKV:
    """One layer's whole key (or value) buffer ``[row capacity, kv_heads, columns, head_dim]``
    with the step's plan, as the attention module hands it on to ``_shared_prefix_attention``."""

    __slots__ = ("plan", "buffer")

    def __init__(self, plan: _StepPlan, buffer: torch.Tensor) -> None:
        self.plan = plan
        self.buffer = buffer


def _shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of one batched decode step, each shared prefix read once (see "Shared
    prefixes are read once per step" above). ``query``: ``[rows, heads, 1, head_dim]``;
    returns ``[rows, 1, heads, head_dim]`` like every attention function."""
    assert isinstance(key, _StepKV) and isinstance(value, _StepKV)
    plan, keys, values = key.plan, key.buffer, value.buffer
    n, heads, _, dim = query.shape
    kv_heads = int(keys.shape[1])
    group = heads // kv_heads  # query head h reads kv head h // group (as repeat_kv expands)
    scale = dim**-0.5 if scaling is None else scaling
    q = query.view(n, kv_heads, group, dim)
    own = slice(plan.first, plan.end + 1)
    # Every row over its own tokens: an unnormalised softmax (its max, sum, weighted values).
    scores = torch.matmul(q, keys[:n, :, own].transpose(-1, -2)).mul_(scale)  # [n, kvh, g, w]
    scores.masked_fill_(plan.hidden, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores.sub_(top))
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights, values[:n, :, own])  # [n, kvh, g, dim]
    for index, source, start, tokens in plan.groups:
        m = int(index.shape[0])
        prefix = slice(start, start + tokens)
        # The group's queries, all rows and heads of a kv head together: [kvh, m * g, dim].
        qq = q.index_select(0, index).transpose(0, 1).reshape(kv_heads, m * group, dim)
        s1 = torch.matmul(qq, keys[source, :, prefix].transpose(-1, -2)).mul_(scale)
        top1 = s1.amax(-1, keepdim=True)
        w1 = torch.exp(s1.sub_(top1))
        total1 = w1.sum(-1, keepdim=True)
        out1 = torch.matmul(w1, values[source, :, prefix])  # [kvh, m * g, dim]

        def rows(t: torch.Tensor, m: int = m) -> torch.Tensor:  # [kvh, m*g, x] -> [m, kvh, g, x]
            return t.view(kv_heads, m, group, -1).transpose(0, 1)

        top1, total1, out1 = rows(top1), rows(total1), rows(out1)
        top2, total2, out2 = top[index], total[index], out[index]
        both = torch.maximum(top1, top2)
        f1, f2 = torch.exp(top1 - both), torch.exp(top2 - both)
        out.index_copy_(0, index, out1 * f1 + out2 * f2)
        total.index_copy_(0, index, total1 * f1 + total2 * f2)
    return (out / total).view(n, 1, heads, dim), None


transformers.AttentionInterface.register(_BATCH_ATTENTION, _shared_prefix_attention)


__all__ = ["ModelHost", "RequestTimings", "guided_token", "sample_token"]
