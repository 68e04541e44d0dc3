"""The llama.cpp engine's KV blocks as bytes: export, restore, the wire format and its checks.

:class:`LlamaCppKVBlocks` is the part of :class:`~peerinfer.engine.llamacpp.LlamaCppEngine`
(which derives from it) that turns a sequence's cells into block payloads and back; the engine
itself (context, sequence ids, ``llama_decode``, batching) is in :mod:`peerinfer.engine.llamacpp`,
whose docstring ("KV reuse: saved sequence state, not shared cells") says why blocks are saved
sequence state, and the state's byte layout (parse, cut, join, compare) is in
:mod:`peerinfer.engine.llamacpp_state`.

Where things are:

* ``export_blocks`` / ``export_block``: one saved state of a whole sequence
  (``_state_bytes``), cut into blocks; ``restore_blocks`` / ``restore_block``: blocks joined
  into one saved state and restored in one ``llama_state_seq_set_data`` (``_set_state``).
* ``kv_format``, ``encode_block``, ``decode_block``: a payload's name, its bytes, and the
  checks on a block received from a peer (size, header, positions, layer layout), against a
  block measured once at start-up (``_measure_block_state``).
* ``token_errors``: pulled tokens' KV recomputed (all in one batch in a check context,
  :mod:`peerinfer.engine.llamacpp_verify`; or in runs in a free sequence) and compared with
  the pulled cells (``verifies_kv_blocks``).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from peerinfer.engine import llamacpp_state as llstate
from peerinfer.engine import llamacpp_verify as llverify
from peerinfer.engine.base import Engine, KVSegment
from peerinfer.engine.llamacpp_load import L
from peerinfer.errors import EngineError, ProtocolError

#: Part of ``kv_format``: llama.cpp's saved-state layout is the library's own.
_LLAMA_VERSION = getattr(L, "__version__", "unknown")


class LlamaCppKVBlocks(Engine):
    """The KV-block half of :class:`~peerinfer.engine.llamacpp.LlamaCppEngine`: what it reads of
    the engine is declared below, and the engine sets it up."""

    _ctx: Any
    _mem: Any
    _vocab: Any
    _n_vocab: int
    _n_batch: int
    _max_sequences: int
    _sequence_tokens: int
    device: str
    _block_state: tuple[int, int]
    _state_magic: int
    _block_layout: tuple[object, ...]

    if TYPE_CHECKING:  # the engine's own: sequence ids and llama_decode

        def _take_seq(self, owner: Any = None) -> int: ...
        def _give_seq(self, seq: int) -> None: ...
        def _decode(self, items: Sequence[tuple[int, int, int, bool]]) -> None: ...

    def kv_format(self) -> str | None:
        """``llamacpp-kv1/<llama.cpp version>-k<type>v<type>-<cpu|gpu>[-fa<0|1>]/<fingerprint>/b<block
        size>`` (``-fa`` only when ``flash_attn`` was set, not left to llama.cpp): a payload is llama.cpp's own saved sequence state, whose layout is the
        library's (so its version is part of the name) and whose values depend on the K/V cell
        types and on where the layers ran."""
        cache = self._ensure_cache()
        if cache is None:
            return None
        cp = L.llama_context_default_params()
        numerics = f"{_LLAMA_VERSION}-k{int(cp.type_k)}v{int(cp.type_v)}-{self.device}"
        flash = getattr(self, "flash_attn", None)
        if flash is not None:
            # Without flash attention the saved state keeps V transposed and the values round
            # differently: a node that set it (either way) exchanges blocks only with its like.
            numerics += f"-fa{int(flash)}"
        return f"llamacpp-kv1/{numerics}/{self.fingerprint.hex()}/b{cache.block_size}"

    def encode_block(self, payload: Any) -> bytes:
        return bytes(payload)  # already llama.cpp's saved state of the block's cells

    def decode_block(self, data: bytes | memoryview, first_token: int) -> KVSegment:
        """Checks what llama.cpp's loader would trust: the exact size of a saved block of this
        model, the header (format tag, stream and cell counts), and each cell's position
        (``first_token + i``) and sequence count (1); llama.cpp then checks the layer count,
        cell types and row sizes itself when the block is restored (refusing a mismatch)."""
        view = memoryview(data)
        block_size, size = self._block_state
        cache = self._ensure_cache()
        if cache is None or cache.block_size != block_size:
            # The reference was measured for another block size: measure this one.
            bs = self.default_block_size if cache is None else cache.block_size
            size = self._measure_block_state(bs)
            block_size = bs
        if len(view) != size:
            raise ProtocolError(f"a llama.cpp KV block of {len(view)} bytes, expected {size}")
        # A payload's layout (engine/llamacpp_state.py): a tag word, the sequence id (0), the
        # stream count (1), the cell count; then per cell (pos, n_seq_id, seq_id).
        magic, _, n_stream, cells = struct.unpack_from("<IIII", view, 0)
        if (magic, n_stream, cells) != (self._state_magic, 1, block_size):
            raise ProtocolError("a llama.cpp KV block with a foreign header")
        for i, (pos, n_seq, _seq) in enumerate(struct.iter_unpack("<iIi", view[16 : 16 + 12 * cells])):
            if pos != first_token + i or n_seq != 1:
                raise ProtocolError(
                    f"a llama.cpp KV block for positions other than {first_token}.."
                    f"{first_token + block_size - 1}"
                )
        # The layers' types and row sizes too: a block llama.cpp refuses to restore would fail
        # the request that hits it, long after the peer that sent it was trusted.
        try:
            state = llstate.parse(view)
        except EngineError as exc:
            raise ProtocolError(f"a llama.cpp KV block that does not parse: {exc}") from exc
        if llstate.layout(state) != self._block_layout:
            raise ProtocolError("a llama.cpp KV block with another layer layout than this model's")
        return KVSegment(bytes(view), size)

    verifies_kv_blocks = True

    #: Checked tokens are recomputed all in one ``llama_decode`` in a check context of their
    #: own (:mod:`peerinfer.engine.llamacpp_verify`): single tokens spread over every block, each
    #: in a sequence of its own sharing the pulled cells below it. False: the engine's own
    #: context, in runs of consecutive tokens, one ``llama_decode`` a run (``_runs_errors``; with
    #: ``verify_run_tokens`` 4 it cost about 0.07 of the saving at the default rate, the batch
    #: less: docs/performance.md, "Checking pulled KV").
    verify_in_one_batch = True
    verify_run_tokens = 1

    def token_errors(
        self,
        tokens: Sequence[int],
        first_block: int,
        blocks: Sequence[bytes | memoryview],
        checks: Sequence[int],
    ) -> list[tuple[int, float]]:
        """The checked tokens recomputed over the blocks up to the one holding the last check
        (the cached ones, then the pulled ones, decoded), in one batch
        (``verify_in_one_batch``: :mod:`~peerinfer.engine.llamacpp_verify`) or in runs
        (``_runs_errors``). Each fresh cell's K/V values are compared with the pulled block's
        (``llamacpp_state.cell_error``), see ``Engine``."""
        self._check_open()
        if not checks:
            return []
        cache = self._ensure_cache()
        assert cache is not None
        bs = cache.block_size
        wanted = sorted(set(int(c) for c in checks))
        if wanted[0] < 0 or wanted[-1] >= len(blocks) * bs:
            raise ValueError(f"checks outside the {len(blocks) * bs} pulled tokens")
        last = wanted[-1] // bs
        if (first_block + last + 1) * bs > min(len(tokens), self._sequence_tokens):
            raise EngineError("the blocks to check are longer than the tokens or a sequence's stream")
        head = cache.match(tuple(tokens[: first_block * bs]), touch=False).nodes
        if len(head) < first_block:
            raise EngineError(f"blocks before {first_block} are no longer cached here")
        payloads: list[bytes] = [n.payload for n in head[:first_block]]
        for k in range(last + 1):
            payloads.append(self.decode_block(blocks[k], (first_block + k) * bs).payload)
        start = first_block * bs
        positions = [start + c for c in wanted]
        states = [llstate.parse(p) for p in payloads]  # once: restored and compared with
        if self.verify_in_one_batch:
            fresh = llverify.recompute(self, states, tokens, positions)
        else:
            fresh = self._runs_errors(payloads, tokens, positions)
        return [(c, llstate.cell_error(states[first_block + c // bs], fresh[start + c]))
                for c in wanted]

    def _runs_errors(
        self, payloads: Sequence[bytes], tokens: Sequence[int], positions: Sequence[int]
    ) -> dict[int, llstate.SavedState]:
        """``positions`` (ascending) recomputed in one free sequence of the engine's context,
        the ``payloads`` restored there once; then, from the last run of consecutive positions
        down, the sequence is cut at the run's first token (``llama_memory_seq_rm`` of it and
        every cell after), the run is decoded at its positions (its first token attends to the
        pulled cells below it, the others to those and the run's fresh ones), and its new cells
        exported. llama.cpp decodes a sequence's tokens only right after its last cell, so the
        runs go from the last down, one ``llama_decode`` each."""
        runs: list[list[int]] = []  # maximal runs of consecutive checked positions
        for p in positions:
            if runs and runs[-1][-1] == p - 1:
                runs[-1].append(p)
            else:
                runs.append([p])
        fresh: dict[int, llstate.SavedState] = {}
        seq = self._take_seq()
        try:
            self.restore_blocks(seq, payloads)
            for run in reversed(runs):
                L.llama_memory_seq_rm(self._mem, seq, run[0], -1)
                for i in range(0, len(run), self._n_batch):
                    self._decode([(int(tokens[p]), p, seq, False) for p in run[i:i + self._n_batch]])
                cells = self.export_blocks(seq, [(p, 1) for p in run])
                fresh.update((p, llstate.parse(c)) for p, c in zip(run, cells, strict=True))
        finally:
            self._give_seq(seq)
        return fresh

    def _measure_block_state(self, block_size: int) -> int:
        """A block's exact payload size (one block run in a free sequence and exported), kept
        with the payload's first word for ``decode_block``."""
        bos = L.llama_vocab_bos(self._vocab)
        token = bos if 0 <= bos < self._n_vocab else 0
        seq = self._take_seq()
        try:
            self._decode([(token, p, seq, False) for p in range(block_size)])
            payload = self.export_block(seq, 0, block_size)
        finally:
            self._give_seq(seq)
        if len(payload) < 16:
            raise EngineError("llama.cpp saved no state for a measured block")
        self._block_state = (block_size, len(payload))
        self._state_magic = struct.unpack_from("<I", payload)[0]
        self._block_layout = llstate.layout(llstate.parse(payload))
        return len(payload)

    # ------------------------------------------------------------ saved state of a sequence

    def _state_bytes(self, seq: int) -> bytes:
        """``seq``'s whole saved state (``llama_state_seq_get_data``)."""
        size = int(L.llama_state_seq_get_size(self._ctx, seq))
        buf = bytearray(size)
        arr = (ctypes.c_uint8 * size).from_buffer(buf)
        n = int(L.llama_state_seq_get_data(self._ctx, arr, size, seq))
        del arr
        if n <= 0:
            raise EngineError(f"llama.cpp saved no state for sequence {seq}")
        return bytes(memoryview(buf)[:n])

    def _set_state(self, seq: int, data: bytes) -> None:
        """Replace ``seq``'s cells with a saved state's (``llama_state_seq_set_data``)."""
        src = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
        n = int(L.llama_state_seq_set_data(self._ctx, src, len(data), seq))
        if n <= 0:
            L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            raise EngineError(
                "llama.cpp could not restore cached blocks (the sequence's stream is full?)"
            )

    def export_blocks(self, seq: int, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The payloads of ``seq``'s cells at each ``(start, length)`` of ``ranges``: one saved
        state of the whole sequence, cut into blocks (``llamacpp_state.cut``)."""
        if not ranges:
            return []
        state = llstate.parse(self._state_bytes(seq))
        return [llstate.cut(state, start, start + length) for start, length in ranges]

    def export_block(self, seq: int, start: int, length: int) -> bytes:
        """The payload of ``seq``'s cells at positions ``[start, start + length)``: a saved state
        of those cells alone, the same bytes whatever sequence they came from."""
        return self.export_blocks(seq, [(start, length)])[0]

    def restore_blocks(self, seq: int, payloads: Sequence[bytes]) -> None:
        """Add saved blocks' cells to ``seq`` (at the positions they were saved with), in one
        ``llama_state_seq_set_data``: the blocks, after any cells ``seq`` already holds, are
        joined into one saved state (restoring clears the sequence first)."""
        if not payloads:
            return
        states = [llstate.parse(p) for p in payloads]
        if int(L.llama_memory_seq_pos_max(self._mem, seq)) >= 0:
            states.insert(0, llstate.parse(self._state_bytes(seq)))
        self._set_state(seq, llstate.join(states, seq, self._max_sequences))

    def restore_block(self, seq: int, payload: bytes) -> None:
        """Add a saved block's cells to ``seq`` (at the positions they were saved with)."""
        self.restore_blocks(seq, [payload])


__all__ = ["LlamaCppKVBlocks"]
