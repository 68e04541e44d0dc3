"""The disk tier: KV blocks the memory cache evicts, kept in files, bounded, in LRU order.

Theory of operation
-------------------
An engine with a disk tier (``Engine.configure_disk``) writes every block its radix cache evicts
to a file here (``Engine._on_evict``: the block's ``encode_block`` bytes), and before matching a
prompt it loads the blocks that continue the prompt's cached prefix from here back into the
cache (``Engine._load_from_disk``), so a hit on disk costs a file read and a decode instead of a
recompute. A block that is in memory and on disk keeps its file (a later eviction then writes
nothing); the tier is a cache of its own, bounded by ``capacity_bytes`` of files, evicting its
least recently used file first.

**Layout.** ``<directory>/<format id>/`` holds one tier (the id is a digest of the format keyed
by the swarm's hash key, ``format_id``): ``FORMAT`` (the engine's ``kv_format()`` string; a
directory whose FORMAT differs is never read) and one file per block, named by its
block hash (16 hex digits) with suffix ``.kv``. So blocks are keyed by the model fingerprint and
the engine's format (the directory) and by block hash (the file). A file is::

    MAGIC (8 bytes) | checksum (32) | block hash (u64) | tokens n (u32) | n x token (u32) | payload

where the checksum is BLAKE2b-256 of everything after it. A file is written to a temporary name
and renamed into place, so a crash leaves a whole file or none.

**Damage is a miss.** A file that is short, has another magic or hash, fails its checksum, or
holds other tokens than the prompt's block is deleted and reported as a miss, so the engine
recomputes: never a wrong answer from a damaged disk (the engine's ``decode_block`` checks the
payload's own sizes after that).

**Restart.** Opening a tier lists its files (one ``stat`` each, no reads) into the index, in the
order of their modification times; a hit touches its file (``utime``), so the LRU order
survives a restart. The engine reports the blocks it finds as cached, so a restarted node
announces them at once.

**Threads.** Like the engine, a tier is used from the engine's worker thread only; other threads
may read ``statistics()`` (a snapshot of ints).
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peerinfer.core.radix import RadixCache
from peerinfer.engine.decoder import KVSegment
from peerinfer.errors import ConfigError, ProtocolError
from peerinfer.types import BlockHash

MAGIC = b"PIKVDSK1"
_HEAD = struct.Struct("<8s32sQI")  # magic, checksum, block hash, token count
_SUFFIX = ".kv"
#: The load rate (read and decode) a node announces before its first disk hit has measured
#: its own: a conservative figure for an SSD (docs/performance.md has measured ones).
DEFAULT_READ_BYTES_PER_S = 200e6
#: The most tokens a block file may claim (a sanity bound on a damaged header).
_MAX_BLOCK_TOKENS = 1 << 16


def format_id(kv_format: str, hash_key: bytes = b"") -> str:
    """The directory name of a format's tier: a short digest of the format string, keyed by
    the key the block hashes were made with (``PrefixHasher.key``: the swarm's). Blocks hashed
    under another swarm key are other names for other contents, so a node restarted into
    another swarm must not find, and announce, them."""
    return hashlib.blake2b(kv_format.encode(), digest_size=12, key=hash_key).hexdigest()


@dataclass(frozen=True, slots=True)
class DiskTierStatistics:
    """A snapshot: blocks and bytes held, the capacity, lifetime counters, and the measured
    read rate (bytes read, seconds spent reading and decoding them: ``read_s`` is filled in
    by the engine, which times the decode too)."""

    blocks: int
    bytes: int
    capacity_bytes: int
    writes: int
    hits: int
    damaged: int
    evicted: int
    read_bytes: int
    read_s: float

    @property
    def read_bytes_per_s(self) -> float | None:
        """Bytes loaded per second of reading and decoding (None before the first hit)."""
        return self.read_bytes / self.read_s if self.read_s > 0 and self.read_bytes else None

    @property
    def load_bytes_per_s(self) -> float:
        """The load rate to plan with: measured, else ``DEFAULT_READ_BYTES_PER_S``."""
        return self.read_bytes_per_s or DEFAULT_READ_BYTES_PER_S


class DiskTier:
    """One format's blocks on disk (see the module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        kv_format: str,
        capacity_bytes: int,
        hash_key: bytes = b"",
    ) -> None:
        if type(capacity_bytes) is not int or capacity_bytes < 0:
            raise ConfigError(f"disk cache bytes must be an integer >= 0, got {capacity_bytes!r}")
        self.kv_format = kv_format
        self.hash_key = bytes(hash_key)
        self.capacity_bytes = capacity_bytes
        self.directory = Path(directory) / format_id(kv_format, hash_key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tag = self.directory / "FORMAT"
            if tag.exists():
                if tag.read_text(encoding="utf-8") != kv_format:
                    raise ConfigError(
                        f"{self.directory} holds KV blocks of another format (a digest collision?)"
                    )
            else:
                tag.write_text(kv_format, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot use {self.directory} as the disk cache: {exc}") from exc
        #: block hash -> file size, least recently used first
        self._index: OrderedDict[BlockHash, int] = OrderedDict()
        self._bytes = 0
        self._writes = self._hits = self._damaged = self._evicted = 0
        self._read_bytes = 0
        self._read_s = 0.0
        self._scan()

    # ------------------------------------------------------------ the index

    def _path(self, h: BlockHash) -> Path:
        return self.directory / f"{h:016x}{_SUFFIX}"

    def _scan(self) -> None:
        found: list[tuple[int, BlockHash, int]] = []
        with os.scandir(self.directory) as it:
            for entry in it:
                name = entry.name
                if name.endswith(".tmp"):
                    _unlink(Path(entry.path))  # an interrupted write
                    continue
                if not name.endswith(_SUFFIX) or len(name) != 16 + len(_SUFFIX):
                    continue
                try:
                    h = BlockHash(int(name[:16], 16))
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, h, st.st_size))
        found.sort()
        for _, h, size in found:
            self._index[h] = size
            self._bytes += size
        self._shrink(0)

    def __contains__(self, h: object) -> bool:
        return h in self._index

    def __len__(self) -> int:
        return len(self._index)

    def hashes(self) -> Iterator[BlockHash]:
        """Every block hash held (a snapshot, least recently used first)."""
        return iter(list(self._index))

    @property
    def nbytes(self) -> int:
        """Bytes of the files held."""
        return self._bytes

    def statistics(self) -> DiskTierStatistics:
        return DiskTierStatistics(
            blocks=len(self._index),
            bytes=self._bytes,
            capacity_bytes=self.capacity_bytes,
            writes=self._writes,
            hits=self._hits,
            damaged=self._damaged,
            evicted=self._evicted,
            read_bytes=self._read_bytes,
            read_s=self._read_s,
        )

    def note_read(self, nbytes: int, seconds: float) -> None:
        """Count a load of ``nbytes`` that took ``seconds`` (read and decode) for the rate."""
        self._read_bytes += nbytes
        self._read_s += seconds

    # ------------------------------------------------------------ blocks

    def put(self, h: BlockHash, tokens: Sequence[int], payload: bytes) -> list[BlockHash]:
        """Write block ``h`` (its ``tokens`` and encoded ``payload``), evicting LRU files to
        stay within the capacity. Returns the hashes evicted (``h`` itself when it alone does
        not fit, or the write failed: a full disk loses a block, never the node)."""
        if h in self._index:
            self.touch(h)
            return []
        body = struct.pack("<Q", h) + struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens) + payload
        checksum = hashlib.blake2b(body, digest_size=32).digest()
        data = MAGIC + checksum + body
        if len(data) > self.capacity_bytes:
            return [h]
        evicted = self._shrink(len(data))
        path = self._path(h)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            _unlink(tmp)
            return [*evicted, h]
        self._index[h] = len(data)
        self._bytes += len(data)
        self._writes += 1
        return evicted

    def get(self, h: BlockHash, tokens: Sequence[int] | None) -> bytes | None:
        """Block ``h``'s encoded payload, or None: not held, or damaged (then deleted; see
        ``damaged``). ``tokens``: the block's tokens as the prompt has them (checked against
        the file's); None skips that check (a peer asked by hash alone)."""
        if h not in self._index:
            return None
        size = self._index[h]
        try:
            with open(self._path(h), "rb") as f:
                data = f.read(size + 1)  # a file grown since it was indexed is damaged, unread
        except OSError:
            self._drop(h, damaged=True)
            return None
        payload = None if len(data) != size else _parse(data, h, tokens)
        if payload is None:
            self._drop(h, damaged=True)
            return None
        self._hits += 1
        self.touch(h)
        return payload

    def touch(self, h: BlockHash) -> None:
        """Mark ``h`` most recently used (also in its file's mtime, for a restart)."""
        if h not in self._index:
            return
        self._index.move_to_end(h)
        try:
            os.utime(self._path(h))
        except OSError:
            pass

    def discard(self, h: BlockHash, *, damaged: bool = False) -> bool:
        """Delete block ``h``'s file; True if it was held."""
        if h not in self._index:
            return False
        self._drop(h, damaged=damaged)
        return True

    def _drop(self, h: BlockHash, *, damaged: bool) -> None:
        self._bytes -= self._index.pop(h)
        if damaged:
            self._damaged += 1
        _unlink(self._path(h))

    def _shrink(self, room: int) -> list[BlockHash]:
        """Evict LRU files until ``room`` more bytes fit; the hashes evicted."""
        evicted: list[BlockHash] = []
        while self._index and self._bytes + room > self.capacity_bytes:
            h = next(iter(self._index))
            self._drop(h, damaged=False)
            self._evicted += 1
            evicted.append(h)
        return evicted


def _parse(data: bytes, h: BlockHash, tokens: Sequence[int] | None) -> bytes | None:
    """The payload of a block file, or None if anything about it is wrong."""
    if len(data) < _HEAD.size:
        return None
    magic, checksum, stored_h, n = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or stored_h != h or n > _MAX_BLOCK_TOKENS:
        return None
    start = _HEAD.size + 4 * n
    if len(data) < start:
        return None
    body = memoryview(data)[8 + 32 :]
    if hashlib.blake2b(body, digest_size=32).digest() != checksum:
        return None
    if tokens is not None:
        stored = struct.unpack_from(f"<{n}I", data, _HEAD.size)
        if len(tokens) != n or tuple(tokens) != stored:
            return None
    return data[start:]


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


__all__ = ["DEFAULT_READ_BYTES_PER_S", "MAGIC", "DiskTier", "DiskTierStatistics", "format_id"]


# ------------------------------------------------------------ an engine's use of its tier


def save_blocks(
    disk: DiskTier,
    cache: RadixCache,
    encode: Callable[[Any], bytes],
    removed: Callable[[BlockHash], None],
    budget_s: float | None,
) -> int:
    """``Engine.save_to_disk``: write every block of ``cache`` that ``disk`` lacks, least
    recently used first, for at most ``budget_s`` seconds (None: no limit); ``removed`` is told
    of each block the tier evicts for room. Returns how many blocks were written."""
    give_up = None if budget_s is None else time.monotonic() + budget_s
    nodes = [n for h in cache.block_hashes() if (n := cache.node_by_hash(h)) is not None]
    nodes.sort(key=lambda n: n.last_access)
    written = 0
    for node in nodes:
        if give_up is not None and time.monotonic() > give_up:
            break
        if node.hash in disk:
            disk.touch(node.hash)
            continue
        try:
            data = encode(node.payload)
        except Exception:  # as in a spill: a block that cannot be exported stays unsaved
            continue
        evicted = disk.put(node.hash, node.key, data)
        written += node.hash in disk
        for h in evicted:
            removed(h)
    return written


def load_prefix(
    disk: DiskTier,
    cache: RadixCache,
    tokens: Sequence[int],
    decode: Callable[[bytes, int], KVSegment],
    free: Callable[[Any], None],
    removed: Callable[[BlockHash], None],
) -> int:
    """``Engine._load_from_disk``: bring the blocks that continue ``tokens``' cached prefix from
    ``disk`` into ``cache``; how many came. A damaged file or one that does not decode is a
    miss from there on (deleted, and ``removed`` is told)."""
    bs = cache.block_size
    match = cache.match(tokens, touch=False)
    have = len(match.nodes)
    n_full = len(tokens) // bs
    if have >= n_full:
        return 0
    block_hash = cache.hasher.block_hash
    h = match.last_hash
    start = time.perf_counter()
    segments: list[KVSegment] = []
    read = 0
    for i in range(have, n_full):
        key = tuple(tokens[i * bs : (i + 1) * bs])
        h = block_hash(h, key)
        if h not in disk:
            break
        data = disk.get(h, key)
        if data is None:  # damaged: deleted, so a miss from here on
            removed(h)
            break
        try:
            segments.append(decode(data, i * bs))
        except ProtocolError:
            disk.discard(h, damaged=True)
            removed(h)
            break
        read += len(data)
    if not segments:
        return 0
    good = have + len(segments)
    payloads: list[Any] = [None] * have + [s.payload for s in segments]
    sizes = [0] * have + [s.nbytes for s in segments]
    result = cache.insert(tuple(tokens[: good * bs]), payloads, sizes)
    for payload in result.unused_payloads:
        if payload is not None:
            free(payload)
    disk.note_read(read, time.perf_counter() - start)
    return len(segments)
