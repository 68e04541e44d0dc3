"""Prefix hashing: a token sequence becomes a chain of keyed block hashes.

Algorithm
---------
The tokens are cut into fixed blocks of ``block_size`` tokens (default 16); a trailing partial
block is not hashed (it cannot be shared at block granularity). Block ``i``'s hash is::

    h[-1] = root       = BLAKE2b-64(key=K, person="peerinfer-root", data=fingerprint)
    h[i]               = BLAKE2b-64(key=K, person="peerinfer-blk", data=h[i-1] || tokens_le32[i])

so each hash names the whole prefix up to and including its block. ``fingerprint`` identifies the
model (and tokenizer): two different models never produce the same chain. ``K`` is the swarm key:
hashes are a keyed MAC, so a digest broadcast to the swarm does not let an outsider test whether a
node saw a given prompt. Token ids are encoded as little-endian unsigned 32-bit integers, so the
chain is identical on every machine and process (no reliance on Python's ``hash``).

Hashes are 64 bits. A collision only makes a routing estimate wrong (a cache miss); the engine's
cache is keyed on the tokens themselves, so it can never produce a wrong answer.

A whole prompt's chain is a pure function of its tokens, and the same prompt is often hashed
twice close together (the origin routes it, then the peer it was forwarded to admits it; in the
simulator every node shares one hasher): ``prompt_chain`` keeps the last ``PROMPT_MEMO_SIZE``
prompts' chains (a tuple of tokens is the key, the same tuple object found by its id
first; the memo starts over when full). A simulator
passes a larger ``memo_size`` (``SIM_PROMPT_MEMO_SIZE``): its workload repeats prompts (64 x
100,000 on the full MMLU set holds 14,015 distinct ones), and each is then hashed once.

A prompt hashed for the first time often shares a long prefix with one hashed before (MMLU's
prompts of one subject share a ~1,400-token 5-shot prefix and differ in ~100 tokens; a chat's
turns extend the conversation). ``prompt_chain`` keeps, for the prompts in its memo, their
token prefixes ending at every ``PREFIX_STRIDE_BLOCKS``-th block boundary, keyed by Python's
hash of the prefix and checked equal to it before use: a new prompt's chain takes the longest
such prefix's hashes as they are and hashes only its blocks after it (``chain`` with
``parent`` and ``start``; the same hashes, a chain being a pure function of the tokens).

Scaffold hashes
---------------
The ``scaffold_hash`` routing policy (``peerinfer.core.routing``) models Mesh LLM's cache
hints, which name a prompt by one hash of its *scaffold*: the system, developer and tool
messages of a chat, or else its first user message (``scaffold_messages``). The hash is
``BLAKE2b-64(key=K, person="peerinfer-scaf", data=...)`` over the scaffold's (role, content)
pairs, each length-prefixed, so it is salted with the same swarm key as the block hashes and
two scaffolds match only when every byte of them does (no partial match, unlike a chain).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

from peerinfer.errors import ConfigError
from peerinfer.types import BlockHash

DEFAULT_BLOCK_SIZE = 16
MAX_TOKEN_ID = 2**32 - 1
_KEY_BYTES = 32
#: How many prompts' chains ``PrefixHasher.prompt_chain`` keeps (about 2 KB each for a
#: 700-token prompt).
PROMPT_MEMO_SIZE = 512
#: The simulator's memo (``PrefixHasher(memo_size=...)``): a whole MMLU test set's prompts,
#: about 30 MB at 2 KB each.
SIM_PROMPT_MEMO_SIZE = 1 << 15
#: ``prompt_chain``'s shared prefixes end at every this many blocks (128 tokens at 16 a block)
PREFIX_STRIDE_BLOCKS = 8


def derive_swarm_key(fingerprint: bytes, secret: bytes | None = None) -> bytes:
    """The key that block hashes are MACed with.

    With no ``secret`` the key is derived from the model fingerprint alone: every swarm serving
    the same model shares it, which still hides prompts from anyone who does not know the model.
    A private swarm passes its own secret (``--swarm-key``).
    """
    h = hashlib.blake2b(digest_size=_KEY_BYTES, person=b"peerinfer-swarm")
    h.update(fingerprint)
    if secret is not None:
        h.update(b"\x00secret\x00")
        h.update(secret)
    return h.digest()


class PrefixHasher:
    """Computes block-hash chains for one (model fingerprint, swarm key, block size)."""

    __slots__ = ("block_size", "fingerprint", "key", "root", "_pack", "_prompt_memo", "_memo_size",
                 "_prefix_memo", "_by_id")

    def __init__(
        self,
        fingerprint: bytes,
        key: bytes | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        memo_size: int = PROMPT_MEMO_SIZE,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if not fingerprint:
            raise ConfigError("the model fingerprint must not be empty")
        self.block_size = block_size
        self.fingerprint = bytes(fingerprint)
        self.key = derive_swarm_key(self.fingerprint) if key is None else bytes(key)
        if len(self.key) > 64:
            raise ConfigError("the swarm key must be at most 64 bytes")
        digest = hashlib.blake2b(
            self.fingerprint, digest_size=8, key=self.key, person=b"peerinfer-root"
        ).digest()
        self.root = BlockHash(int.from_bytes(digest, "little"))
        self._pack = struct.Struct(f"<Q{block_size}I").pack
        self._prompt_memo: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[BlockHash, ...]]] = {}
        #: how many prompts' chains ``prompt_chain`` keeps before it starts over
        self._memo_size = memo_size
        #: the memo's prompts' prefixes (``prompt_chain``): hash of ``prompt[:end]`` -> (end,
        #: prompt, its chain), for ``end`` every ``PREFIX_STRIDE_BLOCKS`` blocks
        self._prefix_memo: dict[int, tuple[int, tuple[int, ...], tuple[BlockHash, ...]]] = {}
        #: the memo's entries by the id of their prompt tuple, which each entry holds (so the
        #: id is not reused while it is here): the same tuple asked again (a request's prompt
        #: at each hop, a simulator's prompts) is found without hashing its tokens
        self._by_id: dict[int, tuple[tuple[int, ...], tuple[BlockHash, ...]]] = {}

    def block_hash(self, parent: BlockHash, block: Sequence[int]) -> BlockHash:
        """The hash of ``block`` (exactly ``block_size`` token ids) following ``parent``."""
        if len(block) != self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, got {len(block)}")
        try:
            data = self._pack(parent, *block)
        except struct.error as exc:
            raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]") from exc
        digest = hashlib.blake2b(data, digest_size=8, key=self.key, person=b"peerinfer-blk")
        return BlockHash(int.from_bytes(digest.digest(), "little"))

    def chain(
        self, tokens: Sequence[int], parent: BlockHash | None = None, start: int = 0
    ) -> list[BlockHash]:
        """Hashes of every full block of ``tokens[start:]``, chained from ``parent``.

        ``parent`` defaults to the root; ``start`` must then be 0. Passing the hash of the block
        that ends at ``start`` extends an existing chain without rehashing it.
        """
        bs = self.block_size
        h = self.root if parent is None else parent
        out: list[BlockHash] = []
        key = self.key
        pack = self._pack
        blake = hashlib.blake2b
        end = start + ((len(tokens) - start) // bs) * bs
        try:
            for i in range(start, end, bs):
                d = blake(
                    pack(h, *tokens[i : i + bs]), digest_size=8, key=key, person=b"peerinfer-blk"
                ).digest()
                h = BlockHash(int.from_bytes(d, "little"))
                out.append(h)
        except struct.error as exc:
            raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]") from exc
        return out

    def prompt_chain(self, tokens: Sequence[int]) -> tuple[BlockHash, ...]:
        """``tuple(self.chain(tokens))``, from the memo when ``tokens`` is a tuple hashed lately
        (a list is hashed each time: it could change after being used as a key)."""
        if type(tokens) is not tuple:
            return tuple(self.chain(tokens))
        hit = self._by_id.get(id(tokens))
        if hit is not None and hit[0] is tokens:
            return hit[1]
        memo = self._prompt_memo
        hit = memo.get(tokens)
        # An equal tuple that is another object may hold floats equal to the ints (which
        # ``chain`` refuses): only a tuple of ints shares the memo's answer.
        if hit is not None and (hit[0] is tokens or set(map(type, tokens)) == {int}):
            return hit[1]
        chain = self._new_prompt_chain(tokens)
        if len(memo) >= self._memo_size or len(self._prefix_memo) >= 16 * self._memo_size:
            memo.clear()
            self._prefix_memo.clear()
            self._by_id.clear()
        memo[tokens] = self._by_id[id(tokens)] = (tokens, chain)
        return chain

    def _new_prompt_chain(self, tokens: tuple[int, ...]) -> tuple[BlockHash, ...]:
        """``tuple(self.chain(tokens))`` for a prompt not in the memo, from the longest prefix
        of it that a memo prompt shares at a ``PREFIX_STRIDE_BLOCKS`` boundary; the prefixes
        of ``tokens`` past that are noted for the prompts after it."""
        bs = self.block_size
        step = PREFIX_STRIDE_BLOCKS * bs
        prefixes = self._prefix_memo
        # Each prefix's key chains from the one before (the hash of it and the next
        # ``step`` tokens): all of them in time linear in the prompt, not quadratic.
        keys: list[int] = []
        k = 0
        for end in range(step, len(tokens) + 1, step):
            k = hash((k, tokens[end - step : end]))
            keys.append(k)
        found = 0
        head: tuple[BlockHash, ...] = ()
        for n in range(len(keys), 0, -1):
            hit = prefixes.get(keys[n - 1])
            if hit is None:
                continue
            end = n * step
            if hit[0] == end and hit[1][:end] == tokens[:end]:
                # Equal is not enough: a float equal to a token id is refused by ``chain``
                # (struct), so the prefix must be made of what ``chain`` takes (as the
                # prompt it came from was), or the prompt is hashed as a whole.
                try:
                    array("Q", tokens[:end])
                except (TypeError, OverflowError):
                    break
                found = n
                head = hit[2][: end // bs]
                break
        if found:
            chain = head + tuple(self.chain(tokens, head[-1], found * step))
        else:
            chain = tuple(self.chain(tokens))
        for n in range(found + 1, len(keys) + 1):
            prefixes[keys[n - 1]] = (n * step, tokens, chain)
        return chain

    def scaffold_hash(self, parts: Sequence[tuple[str, str]]) -> int | None:
        """The salted 64-bit hash of a prompt scaffold, ``(role, content)`` pairs as
        ``scaffold_messages`` returns them; None for an empty scaffold (no hint)."""
        if not parts:
            return None
        h = hashlib.blake2b(digest_size=8, key=self.key, person=b"peerinfer-scaf")
        for role, content in parts:
            for text in (role, content):
                data = text.encode("utf-8", "surrogatepass")
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
        return int.from_bytes(h.digest(), "little")

    def full_blocks(self, n_tokens: int) -> int:
        """How many full blocks ``n_tokens`` tokens make."""
        return n_tokens // self.block_size


#: The roles whose messages make a chat's scaffold (Mesh LLM's cache hints).
SCAFFOLD_ROLES = frozenset({"system", "developer", "tool"})


def scaffold_messages(messages: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """A chat's scaffold as Mesh LLM's cache hints define it: its system, developer and tool
    messages, in order, or else (none of them) its first user message; ``()`` if neither."""
    scaffold = tuple((role, content) for role, content in messages if role in SCAFFOLD_ROLES)
    if scaffold:
        return scaffold
    first_user = next(((r, c) for r, c in messages if r == "user"), None)
    return (first_user,) if first_user is not None else ()


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "PREFIX_STRIDE_BLOCKS",
    "PROMPT_MEMO_SIZE",
    "SIM_PROMPT_MEMO_SIZE",
    "SCAFFOLD_ROLES",
    "PrefixHasher",
    "derive_swarm_key",
    "scaffold_messages",
]
