"""llama.cpp's saved sequence state, cut into blocks and joined back.

With a KV stream per sequence (the context's ``kv_unified`` false, see
:mod:`peerinfer.engine.llamacpp`), llama.cpp 0.3.36 copies KV between sequences only as whole
streams (``llama_memory_seq_cp`` of a position range aborts), and ``llama_state_seq_set_data``
first clears the sequence it restores into. So a cached block can no longer be cut out through
a scratch sequence, nor a prefix restored one block at a time: the engine takes a sequence's
whole saved state once and cuts blocks out of it here (:func:`cut`), and joins a prefix's
blocks into one saved state here (:func:`join`) that it restores in one call.

The saved state of a sequence, as llama.cpp 0.3.36 writes it (all little-endian; read back from
the library, since its header is not public API):

* ``u32`` magic, ``u32`` the sequence id;
* then one section per KV cache (one; two for sliding-window models: the full layers', then the
  sliding-window layers'), each: ``u32 n_stream``, then per stream ``u32 cell_count`` and, when
  not 0, that stream's cells: per cell ``i32 pos``, ``u32 n_seq_id``, ``n_seq_id`` x ``i32``;
  ``u32 v_trans``, ``u32 n_layer``; per layer ``i32 k_type``, ``u64 k_row_bytes``, the K rows
  (one per cell); then V: per layer ``i32 v_type``, ``u64 v_row_bytes``, the V rows, or, when
  ``v_trans``, ``i32 v_type``, ``u32 v_element_bytes``, ``u32 n_embd_v``, then per embedding
  element the cells' values.

A block's payload (what the radix cache stores and a disk tier would write) is itself such a
state, of that block's cells only, written with one stream and sequence id 0, so that it does
not depend on the sequence it came from: the same KV always gives the same bytes. It restores
into any sequence at the positions it holds (:func:`join`, then ``llama_state_seq_set_data``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from peerinfer.errors import EngineError

_U32 = struct.Struct("<I")
_HEADER = struct.Struct("<II")
_CELL = struct.Struct("<iI")


@dataclass(slots=True)
class _Layer:
    """One layer's K or V of a section: its header bytes, and the data as ``[cells, row]``
    (or, for transposed V, ``[n_embd, cells, element]``)."""

    header: bytes
    data: np.ndarray


@dataclass(slots=True)
class _Section:
    """One KV cache's cells of a sequence: their positions, ``v_trans``, K and V per layer."""

    positions: np.ndarray
    v_trans: int
    k: list[_Layer]
    v: list[_Layer]

    def take(self, rows: np.ndarray | slice) -> _Section:
        """The cells at ``rows`` (a slice gives views: no copy until written)."""
        return _Section(
            self.positions[rows],
            self.v_trans,
            [_Layer(layer.header, layer.data[rows]) for layer in self.k],
            [_Layer(layer.header, layer.data[:, rows] if self.v_trans else layer.data[rows])
             for layer in self.v],
        )


@dataclass(slots=True)
class SavedState:
    """A parsed saved sequence state: its magic word and one section per KV cache (``None``
    where that cache holds no cell of the sequence)."""

    magic: int
    sections: list[_Section | None]


def parse(data: bytes | bytearray | memoryview) -> SavedState:
    """Read a saved sequence state (the format in the module docstring)."""
    buf = memoryview(data)
    if len(buf) < _HEADER.size:
        raise EngineError("a llama.cpp saved state is shorter than its header")
    magic, _seq = _HEADER.unpack_from(buf, 0)
    off = _HEADER.size
    sections: list[_Section | None] = []
    try:
        while off < len(buf):
            (n_stream,) = _U32.unpack_from(buf, off)
            off += 4
            found: _Section | None = None
            for _ in range(n_stream):
                (count,) = _U32.unpack_from(buf, off)
                off += 4
                if count == 0:
                    continue
                if found is not None:
                    raise EngineError("a saved sequence state holds cells in two streams")
                found, off = _read_stream(buf, off, count)
            sections.append(found)
    except struct.error as exc:
        raise EngineError(f"a llama.cpp saved state is truncated: {exc}") from exc
    if off != len(buf):
        raise EngineError("a llama.cpp saved state has trailing bytes")
    return SavedState(magic, sections)


def _read_stream(buf: memoryview, off: int, count: int) -> tuple[_Section, int]:
    # ``count`` comes from the bytes (a peer's or a file's): bound it by what the bytes can hold
    # before allocating for it.
    if count * _CELL.size > len(buf) - off:
        raise EngineError(f"a llama.cpp saved state claims {count} cells it does not hold")
    positions = np.empty(count, dtype=np.int64)
    for i in range(count):
        pos, n_seq = _CELL.unpack_from(buf, off)
        positions[i] = pos
        off += _CELL.size + 4 * n_seq
    v_trans, n_layer = _HEADER.unpack_from(buf, off)
    off += 8
    k: list[_Layer] = []
    for _ in range(n_layer):
        header = bytes(buf[off:off + 12])
        (row,) = struct.unpack_from("<Q", buf, off + 4)
        off += 12
        k.append(_Layer(header, _rows(buf, off, count, row)))
        off += count * row
    v: list[_Layer] = []
    for _ in range(n_layer):
        if v_trans:
            header = bytes(buf[off:off + 12])
            element, n_embd = struct.unpack_from("<II", buf, off + 4)
            off += 12
            size = n_embd * count * element
            if off + size > len(buf):
                raise EngineError("a llama.cpp saved state is truncated")
            data = np.frombuffer(buf, dtype=np.uint8, count=size, offset=off)
            v.append(_Layer(header, data.reshape(n_embd, count, element)))
            off += size
        else:
            header = bytes(buf[off:off + 12])
            (row,) = struct.unpack_from("<Q", buf, off + 4)
            off += 12
            v.append(_Layer(header, _rows(buf, off, count, row)))
            off += count * row
    return _Section(positions, v_trans, k, v), off


def _rows(buf: memoryview, off: int, count: int, row: int) -> np.ndarray:
    if off + count * row > len(buf):
        raise EngineError("a llama.cpp saved state is truncated")
    return np.frombuffer(buf, dtype=np.uint8, count=count * row, offset=off).reshape(count, row)


def write(state: SavedState, seq: int, n_stream: int) -> bytes:
    """The saved state of ``state``'s cells as sequence ``seq`` of a context with ``n_stream``
    streams (its cells in stream ``seq``; ``n_stream`` 1 writes them in the only stream)."""
    slot = 0 if n_stream == 1 else seq
    if not 0 <= slot < n_stream:
        raise ValueError(f"sequence {seq} has no stream among {n_stream}")
    out: list[bytes | memoryview] = [_HEADER.pack(state.magic, seq)]
    for section in state.sections:
        out.append(_U32.pack(n_stream))
        for s in range(n_stream):
            if section is None or s != slot or len(section.positions) == 0:
                out.append(_U32.pack(0))
                continue
            count = len(section.positions)
            out.append(_U32.pack(count))
            cells = np.empty((count, 3), dtype="<i4")
            cells[:, 0] = section.positions
            cells[:, 1] = 1
            cells[:, 2] = seq
            out.append(cells.tobytes())
            out.append(_HEADER.pack(section.v_trans, len(section.k)))
            # Contiguous arrays go into the join as buffers: one copy, into the result.
            for layer in section.k:
                out += [layer.header, np.ascontiguousarray(layer.data).data]
            for layer in section.v:
                out += [layer.header, np.ascontiguousarray(layer.data).data]
    return b"".join(out)


def cut(state: SavedState, start: int, stop: int) -> bytes:
    """A block's payload: ``state``'s cells at positions ``[start, stop)``, as a one-stream
    state of sequence 0 (see the module docstring). Every section must hold them all."""
    sections: list[_Section | None] = []
    for section in state.sections:
        if section is None:
            raise EngineError(f"llama.cpp saved no cells for positions {start}..{stop}")
        rows = np.flatnonzero((section.positions >= start) & (section.positions < stop))
        if len(rows) != stop - start:
            raise EngineError(
                f"llama.cpp saved {len(rows)} cells for positions {start}..{stop}, not {stop - start}"
            )
        if rows[-1] - rows[0] + 1 == len(rows):  # the usual case: consecutive cells, no copy
            sections.append(section.take(slice(int(rows[0]), int(rows[-1]) + 1)))
        else:
            sections.append(section.take(rows))
    return write(SavedState(state.magic, sections), 0, 1)


def join(states: Sequence[SavedState], seq: int, n_stream: int) -> bytes:
    """One saved state of sequence ``seq`` holding all of ``states``' cells, in their order
    (restored in one ``llama_state_seq_set_data``, they keep that order in the stream)."""
    if not states:
        raise ValueError("join needs at least one state")
    n_sections = len(states[0].sections)
    if any(len(s.sections) != n_sections for s in states):
        raise EngineError("saved states of different KV cache layouts cannot be joined")
    sections: list[_Section | None] = []
    for i in range(n_sections):
        parts = [s.sections[i] for s in states if s.sections[i] is not None]
        if not parts:
            sections.append(None)
            continue
        first = parts[0]
        assert first is not None
        for p in parts:
            assert p is not None
            if p.v_trans != first.v_trans or [x.header for x in p.k] != [x.header for x in first.k] \
                    or [x.header for x in p.v] != [x.header for x in first.v]:
                raise EngineError("saved states of different KV layouts cannot be joined")
        axis = 1 if first.v_trans else 0
        sections.append(_Section(
            np.concatenate([p.positions for p in parts if p is not None]),
            first.v_trans,
            [_Layer(layer.header, np.concatenate([p.k[j].data for p in parts if p is not None]))
             for j, layer in enumerate(first.k)],
            [_Layer(layer.header, np.concatenate([p.v[j].data for p in parts if p is not None], axis=axis))
             for j, layer in enumerate(first.v)],
        ))
    return write(SavedState(states[0].magic, sections), seq, n_stream)


#: ggml's type ids of the K/V cell types whose values can be read here (``ggml.h``).
_VALUE_TYPES: dict[int, np.dtype[Any] | None] = {0: np.dtype("<f4"), 1: np.dtype("<f2"), 30: None}  # 30: bf16


def layout(state: SavedState) -> tuple[object, ...]:
    """What two saved states of one model and context type share whatever cells they hold: per
    section whether it is present, ``v_trans`` and every layer's K/V header (type and row or
    element sizes). A block whose layout differs from the engine's own is not one of its blocks."""
    return tuple(
        None if s is None else (s.v_trans, tuple(x.header for x in s.k), tuple(x.header for x in s.v))
        for s in state.sections
    )


def _values(layers: Sequence[_Layer]) -> list[np.ndarray]:
    """The K or V values of ``layers`` as float32, flat: one array per cell type, each the
    layers of that type concatenated in order (float16, float32 and bfloat16 cells). One
    conversion per type, not per layer: a check compares ~60 layers a token."""
    raw: dict[int, list[np.ndarray]] = {}
    for layer in layers:
        (type_id,) = struct.unpack_from("<i", layer.header, 0)
        if type_id not in _VALUE_TYPES:
            raise EngineError(f"K/V cells of ggml type {type_id} cannot be compared as values")
        raw.setdefault(type_id, []).append(layer.data.reshape(-1))
    out: list[np.ndarray] = []
    for type_id, parts in raw.items():
        data = np.concatenate(parts) if len(parts) > 1 else np.ascontiguousarray(parts[0])
        dtype = _VALUE_TYPES[type_id]
        if dtype is None:  # bfloat16: the high half of a float32
            out.append((data.view("<u2").astype(np.uint32) << 16).view("<f4"))
        else:
            out.append(data.view(dtype).astype(np.float32))
    return out


def cell_error(block: SavedState, fresh: SavedState) -> float:
    """How far ``fresh``'s cells (a recompute of some or all of ``block``'s positions) are from
    ``block``'s cells at the same positions: the largest difference between their K/V values
    over ``block``'s largest magnitude, all its cells and every layer of every section
    (``peerinfer.core.kvpull.relative_error``). 0 for identical values; inf when ``block``
    lacks one of the positions, holds a non-finite value, or the layouts differ. Two whole
    states compare as ``cell_error(pulled, recomputed)``."""
    if layout(block) != layout(fresh):
        return float("inf")
    diff = 0.0
    scale = 0.0
    for a, b in zip(block.sections, fresh.sections, strict=True):
        if a is None or b is None:  # the same layout: both absent
            continue
        if np.array_equal(a.positions, b.positions):
            sub = a  # every cell, in order: the values are read once
        else:
            rows = np.flatnonzero(np.isin(a.positions, b.positions))
            if len(rows) != len(b.positions) or not np.array_equal(a.positions[rows], b.positions):
                return float("inf")
            sub = a.take(rows)
        whole = _values([*a.k, *a.v])
        if not all(np.isfinite(v).all() for v in whole):
            return float("inf")
        scale = max([scale, *(float(np.abs(v).max()) for v in whole if v.size)])
        # The same layers in the same order on both sides: the arrays line up.
        mine = whole if sub is a else _values([*sub.k, *sub.v])
        theirs = _values([*b.k, *b.v])
        diff = max([diff, *(float(np.abs(x - y).max()) for x, y in zip(mine, theirs, strict=True) if x.size)])
    if diff != diff:
        return float("inf")
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0.0 else float("inf")
