"""The llama.cpp engine's check of pulled KV in one batch (``token_errors``, issue 24).

A checked token ``p`` must be recomputed from the pulled KV of positions ``0 .. p-1`` and
nothing else. The engine's own context gives every sequence a KV stream of its own (see
"One KV stream per sequence" in :mod:`peerinfer.engine.llamacpp`), where cells cannot be shared
between sequences: there a token is recomputed only right after its sequence's last cell, so
scattered tokens cost one ``llama_decode`` each, and a lone token's decode reads every weight
for that one token (about 3x a prefilled token's share).

So the check runs in a **context of its own with one unified KV stream** (:func:`recompute`),
made for the check and freed after it (0.03-0.04 s to make on the default model). The pulled
cells are restored once into sequence 0. Each checked token ``p`` gets a sequence id of its own
that shares the cells of positions ``< p`` (``llama_memory_seq_cp(0, s, 0, p)``: in one stream a
cell may belong to several sequences, no copy). Then all the checked tokens run in **one**
``llama_decode``, each row at its position in its own sequence, so llama.cpp masks it to the
shared cells below it and its own new cell. The weights are read once per physical batch for
all of them, as in a prefill: a checked token's decode costs what a prefilled token does
(docs/performance.md). A context holds at most ``MAX_SEQUENCES`` sequence ids (llama.cpp's
``LLAMA_MAX_SEQ``), so the tokens go in chunks of ``MAX_SEQUENCES - 1``.

Why an honest cell stays bit-identical to the holder's prefill: the physical batch is the
engine's (``ubatch_tokens``, under the 64 rows at which CPU flash attention switches to its
tiled kernel), the row kernel computes each row alone, a row's own cell lies after the shared
cells below it (the restored cells fill the stream from cell 0 in position order), as in a
prefill, and masked cells are skipped (measured: honest errors of 0.0, docs/performance.md).

**Memory.** While it lives the check context holds the checked prefix's KV a second time:
:func:`context_cells` cells (the restored ones and one chunk's fresh ones, padded to llama.cpp's
256), about 53 MB for a 2,000-token pull of the default model in float16. That comes out of the
engine's byte budget (``--cache-bytes``) as a running request's working KV does: before the
context is made, the cells' bytes (``kv_bytes_per_token`` each, as the engine counts its own
context) are reserved in the radix cache (``RadixCache.reserve``), which evicts LRU blocks to
make room (spilling them to the disk tier, if any), and released when the context is freed.
The cached blocks the check restores stay pinned meanwhile, so making room never evicts the
prefix the pull is adopted after. Where even evicting every unpinned block would not make room
(running requests hold the rest), the check is refused with an ``EngineError``, evicting
nothing: a node then drops the pull without blaming the holder and recomputes the prefix.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from peerinfer.engine import llamacpp_state as llstate
from peerinfer.engine.llamacpp_load import L, flash_attn_type
from peerinfer.errors import EngineError

#: llama.cpp 0.3.36's ``LLAMA_MAX_SEQ``: a context's ``n_seq_max`` may not exceed it.
MAX_SEQUENCES = 256
#: llama.cpp pads a context's cells to this.
_PAD = 256


def context_cells(states: Sequence[llstate.SavedState], checks: int) -> int:
    """The KV cells of the context that checks ``checks`` tokens over ``states``: the cells
    restored (the first section's; a sliding-window model's second holds the same) and one
    chunk's fresh ones, padded as llama.cpp pads them (what it allocates)."""
    cells = _restored(states) + min(checks, MAX_SEQUENCES - 1)
    return -(-cells // _PAD) * _PAD


def _restored(states: Sequence[llstate.SavedState]) -> int:
    return sum(len(sec.positions) for st in states if (sec := st.sections[0]) is not None)


def _context(engine: Any, cells: int, sequences: int) -> Any:
    """A context of ``cells`` KV cells (a multiple of the padding) in one stream shared by
    ``sequences`` sequence ids, set up as the engine's own (threads, physical batch, flash
    attention, full sliding windows)."""
    cp = L.llama_context_default_params()
    cp.n_ctx = cells
    cp.n_batch = max(sequences, 64)
    cp.n_ubatch = min(cp.n_batch, engine.ubatch_tokens)
    cp.n_seq_max = sequences
    cp.n_threads = cp.n_threads_batch = engine.threads
    cp.kv_unified = True
    cp.swa_full = True
    cp.no_perf = True
    cp.flash_attn_type = flash_attn_type(engine.flash_attn)
    ctx = L.llama_init_from_model(engine._model, cp)
    if not ctx:
        raise EngineError(f"llama.cpp cannot create a check context of {cp.n_ctx} KV cells")
    return ctx


def _state(ctx: Any, seq: int) -> bytes:
    size = int(L.llama_state_seq_get_size(ctx, seq))
    buf = (ctypes.c_uint8 * size)()
    n = int(L.llama_state_seq_get_data(ctx, buf, size, seq))
    if n <= 0:
        raise EngineError(f"llama.cpp saved no state for check sequence {seq}")
    return bytes(memoryview(buf)[:n])


def recompute(
    engine: Any,
    states: Sequence[llstate.SavedState],
    tokens: Sequence[int],
    positions: Sequence[int],
) -> dict[int, llstate.SavedState]:
    """Each of ``positions`` (ascending) recomputed over the cells of ``states`` (parsed block
    payloads of ``tokens`` from position 0, covering every position below the last one): its
    fresh cell, parsed. The check context's KV is reserved in the engine's cache while it
    lives (see "Memory" in the module docstring); EngineError when there is no room."""
    if not positions:
        return {}
    cells = context_cells(states, len(positions))
    nbytes = cells * max(1, engine.kv_bytes_per_token)
    cache = engine.radix_cache
    held = None
    if cache is not None:
        # Pin the cached part of the restored prefix (the blocks the pull goes after): the
        # reservation below may evict only other blocks.
        held = cache.match(tuple(tokens[:_restored(states)]), touch=False).last_node
        cache.lock(held)
        if not cache.reserve(nbytes):
            cache.unlock(held)
            raise EngineError(
                f"no room in the KV byte budget for the check's {cells} cells ({nbytes} bytes): "
                f"running requests hold {cache.reserved_bytes} bytes of "
                f"{cache.capacity_bytes}"
            )
    try:
        return _recompute(engine, states, tokens, positions, cells)
    finally:
        if cache is not None:
            cache.release(nbytes)
            cache.unlock(held)


def _recompute(
    engine: Any,
    states: Sequence[llstate.SavedState],
    tokens: Sequence[int],
    positions: Sequence[int],
    cells: int,
) -> dict[int, llstate.SavedState]:
    """:func:`recompute` in a check context of ``cells`` cells, its memory already counted."""
    chunk = min(len(positions), MAX_SEQUENCES - 1)
    ctx = _context(engine, cells, chunk + 1)
    batch = L.llama_batch_init(chunk, 0, 1)
    try:
        mem = L.llama_get_memory(ctx)
        data = llstate.join(states, 0, 1)
        src = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
        if int(L.llama_state_seq_set_data(ctx, src, len(data), 0)) <= 0:
            raise EngineError("llama.cpp could not restore the pulled blocks for the check")
        del data
        fresh: dict[int, llstate.SavedState] = {}
        for i in range(0, len(positions), chunk):
            part = positions[i:i + chunk]
            for s, p in enumerate(part, start=1):
                L.llama_memory_seq_cp(mem, 0, s, 0, p)  # the cells of positions < p: shared
                batch.token[s - 1] = int(tokens[p])
                batch.pos[s - 1] = p
                batch.n_seq_id[s - 1] = 1
                batch.seq_id[s - 1][0] = s
                batch.logits[s - 1] = False
            batch.n_tokens = len(part)
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise EngineError(f"llama_decode of {len(part)} checked tokens failed: status {rc}")
            for s, p in enumerate(part, start=1):
                L.llama_memory_seq_rm(mem, s, 0, p)  # leaves sequence s its own new cell alone
                fresh[p] = llstate.parse(_state(ctx, s))
                L.llama_memory_seq_rm(mem, s, -1, -1)
        return fresh
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


__all__ = ["MAX_SEQUENCES", "context_cells", "recompute"]
