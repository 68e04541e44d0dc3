"""The simulated engine: a deterministic stand-in for a model, timed by the cost model.

No torch, no weights. It exists so that nodes, clusters and the discrete-event simulator can run
anywhere, fast, with the same prefix-cache behaviour as the real engine:

* **Tokenizer.** Text is cut into words, numbers and punctuation runs (each with its leading
  space, long words in pieces of at most 8 characters, roughly like a BPE tokenizer's counts);
  each piece's id is a keyed BLAKE2b hash of its UTF-8 bytes into the vocabulary (ids 0-3 are
  reserved: pad, bos, eos, unk). Stable across processes and machines (never Python's
  ``hash()``), but lossy: ``detokenize`` spells every id as a made-up word (``" kobu"``), so
  ``detokenize(tokenize(text)) != text``.
* **Output.** The completion is a pure function of the prompt, the seed (when sampling) and the
  position: id ``i`` is a hash of (prompt digest, seed, i). It never emits end-of-sequence, so a
  request ends by ``max_tokens``, a stop sequence, the context limit or cancellation.
* **Cache.** The same :class:`~peerinfer.core.radix.RadixCache` as the real engine, with payload
  None and ``kv_bytes_per_token * block_size`` bytes per block, matched and filled by the same
  rules (match ``prompt[:-1]``; insert ``prompt + completion[:-1]``), so hits, capacity and
  eviction behave alike.
* **Time.** :meth:`SimulatedEngine.plan` is the pure part: it validates a request, updates the
  cache and returns the timings the cost model gives (TTFT, service time) without sleeping; the
  discrete-event simulator schedules virtual events from it (its batch model adds what
  running next to other requests costs: ``peerinfer.sim.batch``). With a disk tier
  (:meth:`SimulatedEngine.configure_sim_disk`) a plan first loads the blocks continuing the
  cached prefix from it (the base engine's ``_load_from_disk``, as the real engines' jobs do)
  and adds their read time, ``disk_s``, to the TTFT. :meth:`Engine.generate`
  serves the same request in real time: it sleeps the TTFT, then ``decode_step_s(1)`` per
  further token (times ``time_scale``; 0 never sleeps), checking the cancel token while it
  sleeps. A plan ignores stop sequences (the simulator has no text); ``generate`` honours them.
* **Memo.** A simulation's engines serve the same prompts (the same tuples) many times over:
  :class:`PlanMemo`, shared by them (``SimulatedEngine.share_plan_memo``), keeps, per prompt
  object, that it was validated and its completion, so a plan validates and hashes each
  distinct prompt once. Both are pure functions of the prompt, the engine's vocabulary and
  context and the sampling, so a plan is the same with or without it; a node's engine has none.
* **Disk tier.** :class:`SimDiskTier` is :class:`~peerinfer.engine.disktier.DiskTier`'s
  index (LRU order, a byte budget) without files: the base engine spills every evicted block
  to it, reports a block that moves between memory and disk as no change (so blocks on disk
  stay announced), and loads from it before a request matches, exactly as with a real tier.
  A load takes its bytes over the configured read rate (the tier's measured rate is that
  rate, so the node's ``Load.disk`` figure is what a real node with that disk announces).
  :meth:`SimulatedEngine.restart` is a machine's restart (the simulator's churn): the memory
  is lost, the tier kept, as a real tier's files are.
* **Batches.** Under the batch scheduler (``peerinfer.engine.batch``) the engine serves up to
  ``max_batch_size`` requests (default: the cost model's ``slots``) with the cost model's
  batched times: ``Decoder.prefill(k)`` sleeps ``k`` uncached tokens at the idle or the busy
  prefill rate (busy while another of its decoders is decoding; the first chunk also the
  overhead and the cached tokens), and one ``decode_batch`` of ``n`` decoders sleeps
  ``decode_step_s(n)`` once, for all of them (a decoder whose prefill has just ended only
  samples its first token, which costs nothing, as on a real model).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain as _chain

from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel
from peerinfer.core.messages import SamplingParams
from peerinfer.core.quickinit import quick_init
from peerinfer.engine.base import (
    NEVER_CANCELLED,
    CancelToken,
    Decoder,
    DecodeRequest,
    Engine,
    FinishReason,
    KVSegment,
    wait_cancelled,
)
from peerinfer.engine.disktier import DiskTier
from peerinfer.engine.validation import validate_prompt
from peerinfer.errors import ConfigError, ProtocolError
from peerinfer.types import BlockHash

#: Ids below this are reserved (pad, bos, eos, unk) and never produced by the tokenizer.
RESERVED_IDS = 4
EOS_ID = 2
#: SmolLM2-135M's KV state per token in float32 (30 layers x K,V x 3 heads x 64 x 4 bytes).
DEFAULT_KV_BYTES_PER_TOKEN = 46_080
_MAX_PIECE_CHARS = 8
#: The first bytes of a synthetic encoded KV block (``encode_block``).
_SIM_KV_MAGIC = b"peerinfer-sim-kv1"

_PIECES = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\w\s]+|\s+")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@quick_init
@dataclass(frozen=True, slots=True)
class Plan:
    """What serving a request costs on the simulated engine, computed without waiting.

    ``ttft_s``: time to first token once the request runs (overhead + prefill);
    ``service_s``: the whole generation. ``cache_added``/``cache_removed``: the cache changes
    since the previous report, this request's included (as ``Finished`` would carry them).
    ``disk_tokens``: of ``cached_tokens``, those loaded from the disk tier; ``disk_s``: of
    ``ttft_s``, the time their load took (0 without a tier).
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    completion_ids: tuple[int, ...]
    finish_reason: FinishReason
    ttft_s: float
    service_s: float
    cache_added: tuple[BlockHash, ...]
    cache_removed: tuple[BlockHash, ...]
    disk_tokens: int = 0
    disk_s: float = 0.0


class SimDiskTier(DiskTier):
    """A disk tier without a disk: :class:`DiskTier`'s index, LRU order and byte budget, the
    blocks kept as references (a simulated engine's blocks are all one synthetic bytes object,
    so this costs no memory), and reads timed at ``read_bytes_per_s`` instead of measured.

    Nothing is ever damaged. It survives a simulated restart (``SimulatedEngine.restart``),
    as a tier of files does, so a node the simulator brings back comes up warm.
    """

    def __init__(self, kv_format: str, capacity_bytes: int, read_bytes_per_s: float) -> None:
        # DiskTier.__init__ would make a directory; the same fields, without one.
        if type(capacity_bytes) is not int or capacity_bytes < 0:
            raise ConfigError(f"disk cache bytes must be an integer >= 0, got {capacity_bytes!r}")
        if not (read_bytes_per_s > 0 and math.isfinite(read_bytes_per_s)):
            raise ConfigError(f"the disk read rate must be a positive number, got {read_bytes_per_s!r}")
        self.kv_format = kv_format
        self.capacity_bytes = capacity_bytes
        self.read_bytes_per_s = read_bytes_per_s
        self._index: OrderedDict[BlockHash, int] = OrderedDict()
        self._blocks: dict[BlockHash, bytes] = {}
        self._bytes = 0
        self._writes = self._hits = self._damaged = self._evicted = 0
        self._read_bytes = 0
        self._read_s = 0.0

    def put(self, h: BlockHash, tokens: Sequence[int], payload: bytes) -> list[BlockHash]:
        if h in self._index:
            self.touch(h)
            return []
        size = len(payload)
        if size > self.capacity_bytes:
            return [h]
        evicted = self._shrink(size)
        self._index[h] = size
        self._blocks[h] = payload
        self._bytes += size
        self._writes += 1
        return evicted

    def get(self, h: BlockHash, tokens: Sequence[int] | None) -> bytes | None:
        data = self._blocks.get(h)
        if data is None:
            return None
        self._hits += 1
        self._index.move_to_end(h)
        return data

    def touch(self, h: BlockHash) -> None:
        if h in self._index:
            self._index.move_to_end(h)

    def _drop(self, h: BlockHash, *, damaged: bool) -> None:
        self._bytes -= self._index.pop(h)
        del self._blocks[h]
        if damaged:
            self._damaged += 1

    def note_read(self, nbytes: int, seconds: float) -> None:
        # The wall time of a simulated load says nothing: a load takes the configured rate.
        self._read_bytes += nbytes
        self._read_s += nbytes / self.read_bytes_per_s


class PlanMemo:
    """What ``SimulatedEngine.plan`` computes per prompt, shared by a swarm's engines: that
    a prompt object was validated, and its completion for one (seed, length).

    Keyed by the prompt tuple's identity (hashing a tuple of hundreds of ids costs as much
    as the work saved); each entry holds the tuple itself, so the key cannot be reused by
    another object while the entry lives, and a lookup checks ``is``. At most ``max_prompts``
    prompts, the oldest dropped first (computed again when asked). Sampling parameters are
    validated once per object as well. Only for engines of one vocabulary and context size
    (``share_plan_memo`` checks).
    """

    def __init__(self, vocab_size: int, max_context_tokens: int, max_prompts: int = 32_768) -> None:
        if max_prompts < 1:
            raise ConfigError(f"max_prompts must be >= 1, got {max_prompts}")
        self.vocab_size = vocab_size
        self.max_context_tokens = max_context_tokens
        self.max_prompts = max_prompts
        #: id(prompt) -> [prompt, seed, n, completion or None]
        self._prompts: dict[int, list[object]] = {}
        self._params: dict[int, SamplingParams] = {}
        #: prompts validated, and completions computed, through the memo (for tests)
        self.validations = 0
        self.completions = 0

    def prompt(self, engine: SimulatedEngine, tokens: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        """``engine.validate_request(tokens, params)``, from the memo when it holds both."""
        if self._params.get(id(params)) is not params:
            prompt = engine.validate_request(tokens, params)
            if len(self._params) >= 256:
                self._params.clear()
            self._params[id(params)] = params
        else:
            entry = self._prompts.get(id(tokens))
            if entry is not None and entry[0] is tokens:
                return tokens  # type: ignore[return-value]  # (a validated tuple)
            # The parameters are known good: what validate_request would check next.
            prompt = validate_prompt(tokens, self.vocab_size, self.max_context_tokens)
        self.validations += 1
        if prompt is tokens and id(prompt) not in self._prompts:
            prompts = self._prompts
            if len(prompts) >= self.max_prompts:
                del prompts[next(iter(prompts))]
            prompts[id(prompt)] = [prompt, -1, -1, None]
        return prompt

    def completion(
        self, engine: SimulatedEngine, prompt: tuple[int, ...], params: SamplingParams, n: int
    ) -> tuple[int, ...]:
        """``engine.completion_ids(prompt, params, n)`` as a tuple, from the memo if it has it."""
        seed = _output_seed(params)
        entry = self._prompts.get(id(prompt))
        if entry is not None and entry[0] is prompt:
            if entry[1] == seed and entry[2] == n:
                return entry[3]  # type: ignore[return-value]
            out = tuple(engine.completion_ids(prompt, params, n))
            entry[1:] = [seed, n, out]
        else:
            out = tuple(engine.completion_ids(prompt, params, n))
        self.completions += 1
        return out


def _output_seed(params: SamplingParams) -> int:
    """The seed a completion is drawn with (greedy: 0, whatever the seed)."""
    return params.seed if params.temperature > 0 and params.seed is not None else 0


class _PieceTokens(dict[str, tuple[int, ...]]):
    """A regex piece's token ids, memoized: one id for a piece of at most ``_MAX_PIECE_CHARS``
    characters, else one per cut of that many. A lookup of a piece not held computes its ids
    (and keeps them while the memo holds fewer than a million pieces)."""

    __slots__ = ("_piece_id",)

    def __init__(self, piece_id: Callable[[str], int]) -> None:
        super().__init__()
        self._piece_id = piece_id

    def __missing__(self, piece: str) -> tuple[int, ...]:
        piece_id = self._piece_id
        if len(piece) <= _MAX_PIECE_CHARS:
            ids: tuple[int, ...] = (piece_id(piece),)
        else:
            ids = tuple(
                piece_id(piece[i : i + _MAX_PIECE_CHARS])
                for i in range(0, len(piece), _MAX_PIECE_CHARS)
            )
        if len(self) < 1_000_000:
            self[piece] = ids
        return ids


def _syllable_word(token: int) -> str:
    n = token
    parts: list[str] = []
    while True:
        n, r = divmod(n, len(_CONSONANTS) * len(_VOWELS))
        parts.append(_CONSONANTS[r // len(_VOWELS)] + _VOWELS[r % len(_VOWELS)])
        if n == 0:
            break
    return " " + "".join(parts)


class SimulatedEngine(Engine):
    """A deterministic, torch-free engine whose timing follows a :class:`CostModel`."""

    supports_prefix_cache = True
    #: Tokenizing is a pure function of the text (the memo dict is only ever filled with the
    #: same value for a key), so routing need not wait for the worker thread.
    thread_safe_tokenizer = True

    def __init__(
        self,
        *,
        costs: CostModel | None = None,
        vocab_size: int = 32_000,
        max_context_tokens: int = 8192,
        kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
        model: str = "simulated",
        time_scale: float = 1.0,
        capacity_bytes: int | None = None,
        block_size: int = 16,
        max_batch_size: int | None = None,
    ) -> None:
        if vocab_size <= RESERVED_IDS:
            raise ConfigError(f"vocab_size must be > {RESERVED_IDS}, got {vocab_size}")
        if max_context_tokens < 2:
            raise ConfigError(f"max_context_tokens must be >= 2, got {max_context_tokens}")
        if kv_bytes_per_token < 0:
            raise ConfigError(f"kv_bytes_per_token must be >= 0, got {kv_bytes_per_token}")
        if not time_scale >= 0:
            raise ConfigError(f"time_scale must be >= 0, got {time_scale}")
        self.costs = costs if costs is not None else DEFAULT_COSTS
        if max_batch_size is None:
            max_batch_size = self.costs.slots
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        #: how many requests the engine decodes at once (the node's capacity)
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = self.costs.prefill_chunk_tokens
        #: open decoders past their prefill (for the busy prefill rate)
        self._decoding = 0
        self._vocab_size = vocab_size
        self._max_context = max_context_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self._model = model
        self.time_scale = time_scale
        self.default_capacity_bytes = capacity_bytes
        self.default_block_size = block_size
        self._fingerprint = hashlib.blake2b(
            f"peerinfer-simulated/1\0{model}\0{vocab_size}".encode(), digest_size=32
        ).digest()
        self._piece_ids: dict[str, int] = {}
        #: each regex piece's ids (a long piece's several, cut as ``_piece_id``'s callers
        #: cut it), so that ``tokenize`` maps the pieces it knows in C
        self._piece_tokens = _PieceTokens(self._piece_id)
        #: the one synthetic encoded block (``encode_block``), made once per size
        self._block_bytes = b""
        self._plan_memo: PlanMemo | None = None

    # ------------------------------------------------------------ identity and tokenizer

    @property
    def fingerprint(self) -> bytes:
        return self._fingerprint

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS_ID})

    @property
    def model_name(self) -> str:
        return self._model

    def _piece_id(self, piece: str) -> int:
        token = self._piece_ids.get(piece)
        if token is None:
            digest = hashlib.blake2b(
                piece.encode("utf-8", "surrogatepass"), digest_size=8, person=b"peerinfer-simtok"
            ).digest()
            token = RESERVED_IDS + int.from_bytes(digest, "little") % (
                self._vocab_size - RESERVED_IDS
            )
            if len(self._piece_ids) < 1_000_000:
                self._piece_ids[piece] = token
        return token

    def tokenize(self, text: str) -> list[int]:
        # Each piece's ids from the memo (a piece not seen before is cut and numbered by
        # ``_PieceTokens.__missing__``): one C loop over the pieces, no Python step per piece.
        pieces = _PIECES.findall(text)
        return list(_chain.from_iterable(map(self._piece_tokens.__getitem__, pieces)))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(_syllable_word(t) for t in tokens if t >= RESERVED_IDS)

    # ------------------------------------------------------------ output and timing

    def completion_ids(self, prompt: Sequence[int], params: SamplingParams, n: int) -> list[int]:
        """The first ``n`` tokens the engine generates for ``prompt`` (greedy: seed ignored)."""
        seed = _output_seed(params)
        state = hashlib.blake2b(digest_size=16, person=b"peerinfer-simout")
        state.update(struct.pack(f"<Q{len(prompt)}I", seed, *prompt))
        key = state.digest()
        span = self._vocab_size - RESERVED_IDS
        out = []
        for i in range(n):
            d = hashlib.blake2b(i.to_bytes(4, "little"), digest_size=8, key=key).digest()
            out.append(RESERVED_IDS + int.from_bytes(d, "little") % span)
        return out

    def plan(self, tokens: Sequence[int], params: SamplingParams | None = None) -> Plan:
        """Serve ``tokens`` instantly: update the cache and return the cost model's timings.

        Raises InvalidRequestError for a bad request, like ``generate``. Ignores stop
        sequences. Call it in the same thread as the engine's other methods.
        """
        self._check_open()
        if params is None:
            params = SamplingParams()
        memo = self._plan_memo
        prompt = (
            self.validate_request(tokens, params) if memo is None
            else memo.prompt(self, tokens, params)
        )
        if params.temperature > 0 and params.seed is None:
            # Unseeded sampling differs per call, as on a real model; still a pure function of
            # what the caller passed, so draw the seed from the prompt and a counter.
            params = _with_seed(params, self._next_unseeded())
        n = min(params.max_tokens, self._max_context - len(prompt))
        completion: Sequence[int] = (
            self.completion_ids(prompt, params, n) if memo is None
            else memo.completion(self, prompt, params, n)
        )
        cache = self._ensure_cache()
        cached = in_memory = disk_tokens = 0
        disk_s = 0.0
        if cache is not None:
            disk = self._disk
            if disk is not None:
                # As a real engine's job: the blocks continuing the cached prefix come back
                # from the disk tier first, and what they add to the match is read from disk.
                head = prompt[: len(prompt) - 1]
                in_memory = cache.match(head, touch=False).tokens
                self._load_from_disk(cache, head)
            # One walk for the match and the insert, of the prompt and the completion but its
            # last token (not joined: the cached blocks' tokens are not copied). A swarm's
            # engines share the cores' hasher, which has this prompt's chain already (the core
            # hashed the same tuple when it took the request in): the cached blocks are then
            # found by hash.
            chain = cache.hasher.prompt_chain(prompt) if memo is not None else ()
            cached = cache.match_insert(  # (the match is of the prompt but its last token)
                prompt,
                max(0, len(prompt) - 1),
                self.kv_bytes_per_token * cache.block_size,
                chain,
                completion[:-1],
                ints=True,  # (the prompt validated, the completion this engine's)
            )
            if disk is not None and cached > in_memory:
                rate = (
                    disk.read_bytes_per_s
                    if isinstance(disk, SimDiskTier)
                    else disk.statistics().load_bytes_per_s  # a tier of files (configure_disk)
                )
                disk_tokens = cached - in_memory
                disk_s = disk_tokens * self.kv_bytes_per_token / rate
        changes = self.take_cache_changes()
        return Plan(
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            completion_tokens=n,
            completion_ids=tuple(completion),
            finish_reason="length",
            ttft_s=self.costs.prefill_s(len(prompt), cached) + disk_s,
            service_s=self.costs.service_s(len(prompt), cached, n) + disk_s,
            cache_added=changes.added,
            cache_removed=changes.removed,
            disk_tokens=disk_tokens,
            disk_s=disk_s,
        )

    def share_plan_memo(self, memo: PlanMemo) -> None:
        """Let ``plan`` use ``memo`` (shared with the other engines of a simulation): each
        distinct prompt object is validated, and its completion hashed, once."""
        if (memo.vocab_size, memo.max_context_tokens) != (self._vocab_size, self._max_context):
            raise ConfigError(
                f"a plan memo for vocabulary {memo.vocab_size} and context "
                f"{memo.max_context_tokens}, not {self._vocab_size} and {self._max_context}"
            )
        self._plan_memo = memo

    def configure_sim_disk(self, capacity_bytes: int, read_bytes_per_s: float) -> None:
        """Give the cache a :class:`SimDiskTier` of ``capacity_bytes`` read at
        ``read_bytes_per_s`` (0 bytes: none), in place of ``configure_disk``'s files. Call it
        after ``configure_cache`` and before any request: the new tier starts empty."""
        self._check_open()
        cache = self._ensure_cache()
        fmt = self.kv_format()
        if cache is None or fmt is None:
            raise ConfigError("a simulated disk tier needs the prefix cache")
        if self._disk is not None and len(self._disk):
            raise ConfigError("the engine already keeps blocks on disk")
        tier = SimDiskTier(fmt, capacity_bytes, read_bytes_per_s) if capacity_bytes else None
        self._disk = tier
        if self._changes is not None:
            self._changes.elsewhere = tier if tier is not None else ()

    def restart(self, *, saved: bool) -> None:
        """The machine's process restarts (the simulator's churn brings a node back): what its
        cache held in memory is lost and its disk tier is kept, as a real node's files outlive
        its process (``configure_disk`` reads them back). ``saved``: it stopped gracefully and
        first wrote its memory to the tier (``save_to_disk``, as the node's runtime does on
        shutdown); a crash writes nothing more. The change log starts over: the restarted
        node takes its snapshot (``cached_block_hashes``). Nothing may be in flight."""
        self._check_open()
        if saved:
            self.save_to_disk()
        cache, tier = self._cache, self._disk
        self._disk = None  # the blocks in memory are lost, not spilled
        try:
            if cache is not None:
                cache.clear()
        finally:
            self._disk = tier
        if self._changes is not None:
            self._changes.take()

    @property
    def disk_tier(self) -> DiskTier | None:
        """The disk tier (None without one)."""
        return self._disk

    _unseeded = 0

    def _next_unseeded(self) -> int:
        self._unseeded += 1
        return self._unseeded

    def open_decoder(self, request: DecodeRequest) -> Decoder:
        params = request.params
        if params.temperature > 0 and params.seed is None:
            params = _with_seed(params, request.seed)
        n = min(params.max_tokens, self._max_context - len(request.tokens))
        done = request.continues
        # A preempted request recomputed after giving up its KV continues its own completion
        # (this engine's output is a function of the prompt, not of the whole sequence).
        completion = (
            self.completion_ids(request.tokens[: len(request.tokens) - done], params, done + n)[done:]
            if done else self.completion_ids(request.tokens, params, n)
        )
        return _SimulatedDecoder(
            self,
            request.tokens,
            completion,
            min(request.prefix.tokens, len(request.tokens)),
            request.cancel,
            self.kv_bytes_per_token * request.block_size,
            request.block_size,
        )

    # ------------------------------------------------------------ KV blocks as bytes

    def kv_format(self) -> str | None:
        """``sim-kv1/<kv bytes per token>/<fingerprint>/b<block size>``."""
        cache = self._ensure_cache()
        if cache is None:
            return None
        return f"sim-kv1/{self.kv_bytes_per_token}/{self.fingerprint.hex()}/b{cache.block_size}"

    def _encoded_size(self) -> int:
        cache = self._ensure_cache()
        bs = self.default_block_size if cache is None else cache.block_size
        return max(len(_SIM_KV_MAGIC), self.kv_bytes_per_token * bs)

    def encoded_block_bytes(self) -> int | None:
        return self._encoded_size()

    def encode_block(self, payload: object) -> bytes:
        """A synthetic block of the size a real one would have (the magic, then zeros): this
        engine's output is a function of the prompt alone, so a block carries no state, but
        the disk tier and a pull should move (and time) as many bytes as a real engine's."""
        size = self._encoded_size()
        if len(self._block_bytes) != size:  # one object for every block (bytes never change)
            self._block_bytes = _SIM_KV_MAGIC.ljust(size, b"\0")
        return self._block_bytes

    def decode_block(self, data: bytes | memoryview, first_token: int) -> KVSegment:
        view = memoryview(data)
        size = self._encoded_size()
        if len(view) != size or view[: len(_SIM_KV_MAGIC)] != _SIM_KV_MAGIC:
            raise ProtocolError(f"not a simulated KV block of {size} bytes")
        cache = self._ensure_cache()
        bs = self.default_block_size if cache is None else cache.block_size
        return KVSegment(None, self.kv_bytes_per_token * bs)

    verifies_kv_blocks = True

    def token_errors(
        self,
        tokens: Sequence[int],
        first_block: int,
        blocks: Sequence[bytes | memoryview],
        checks: Sequence[int],
    ) -> list[tuple[int, float]]:
        """A synthetic block's recompute is the synthetic block itself: a checked token whose
        pulled block's bytes differ from it in any way is a mismatch (error inf), as a real
        engine's altered values would be."""
        expected = self.encode_block(None)
        cache = self._ensure_cache()
        bs = self.default_block_size if cache is None else cache.block_size
        out: list[tuple[int, float]] = []
        for c in sorted(set(checks)):
            if not 0 <= c < len(blocks) * bs:
                raise ValueError(f"check {c} outside the {len(blocks) * bs} pulled tokens")
            block = blocks[c // bs]
            self.decode_block(block, 0)  # the size and magic, as an adoption checks them
            out.append((c, 0.0 if bytes(block) == expected else math.inf))
        return out

    def decode_batch(self, decoders: Sequence[Decoder]) -> list[int | None]:
        """One token for each decoder, sleeping one decode step of the batch: those that
        decode (past their first token) take ``decode_step_s(n)`` together."""
        ours = [d for d in decoders if isinstance(d, _SimulatedDecoder)]
        if len(ours) != len(decoders):
            raise ConfigError("decode_batch: every decoder must come from this engine")
        decoding = sum(1 for d in ours if d.decoding)
        if decoding:
            cancel = ours[0].cancel if len(ours) == 1 else NEVER_CANCELLED
            wait_cancelled(cancel, self.costs.decode_step_s(decoding) * self.time_scale)
        return [d.take_token() for d in ours]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(params.max_tokens, params.temperature, params.top_p, seed, params.stop)


class _SimulatedDecoder(Decoder):
    """Sleeps the cost model's time, then hands out the precomputed completion.

    Alone (``step()`` only), the first token costs the whole prefill and each further one
    ``decode_step_s(1)``. Under the batch scheduler, ``prefill`` sleeps per chunk and the
    engine's ``decode_batch`` sleeps per batch; ``step()`` then only samples what is ready.
    """

    def __init__(
        self,
        engine: SimulatedEngine,
        prompt: tuple[int, ...],
        completion: list[int],
        cached_tokens: int,
        cancel: CancelToken,
        block_nbytes: int,
        block_size: int,
    ) -> None:
        self._engine = engine
        self._prompt_len = len(prompt)
        self._completion = completion
        self._cached = cached_tokens
        #: uncached prompt tokens not yet prefilled
        self._remaining = len(prompt) - cached_tokens
        self._started = False  # the first prefill chunk (overhead, cached tokens) has run
        self.cancel = cancel
        self._block_nbytes = block_nbytes
        self._block_size = block_size
        self._produced = 0
        self._counted = False  # counted in the engine's decoding requests
        self._closed = False

    @property
    def prefill_remaining(self) -> int:
        return self._remaining

    @property
    def decoding(self) -> bool:
        """Past the first token: its next token needs a decode step."""
        return self._produced > 0

    def prefill(self, max_tokens: int) -> bool:
        if self._started and self._remaining == 0:
            return True
        costs = self._engine.costs
        run = min(max(1, max_tokens), self._remaining)
        rate = costs.prefill_busy_rate if self._engine._decoding > 0 else costs.prefill_s_per_token
        seconds = run * rate
        if not self._started:
            seconds += costs.overhead_s + self._cached * costs.cached_s_per_token
            self._started = True
        self._remaining -= run
        wait_cancelled(self.cancel, seconds * self._engine.time_scale)
        if self._remaining == 0 and not self._counted:
            self._counted = True
            self._engine._decoding += 1
        return self._remaining == 0

    def take_token(self) -> int | None:
        """The next token, its compute already paid (by ``prefill`` or ``decode_batch``)."""
        if self._produced >= len(self._completion):
            return None
        token = self._completion[self._produced]
        self._produced += 1
        return token

    def step(self) -> int | None:
        if self._produced >= len(self._completion):
            return None
        if self._produced == 0:
            if not (self._started and self._remaining == 0):
                self.prefill(self._remaining)
        else:
            costs = self._engine.costs
            wait_cancelled(self.cancel, costs.decode_step_s(1) * self._engine.time_scale)
        return self.take_token()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._counted:
                self._engine._decoding -= 1

    @property
    def kv_tokens(self) -> int:
        # As on a real model: the prompt, and every generated token but the last (fed back only
        # to produce the next one).
        return self._prompt_len + max(0, self._produced - 1) if self._produced else 0

    def export_segments(self, first_block: int) -> list[KVSegment]:
        n_full = self.kv_tokens // self._block_size
        return [KVSegment(None, self._block_nbytes) for _ in range(first_block, n_full)]


__all__ = ["DEFAULT_KV_BYTES_PER_TOKEN", "Plan", "PlanMemo", "SimulatedEngine"]
