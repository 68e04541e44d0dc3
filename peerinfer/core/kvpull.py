"""Pulling KV from peers, the sans-IO parts: the settings, a link-bandwidth estimator fed by
transfers, and the verifier that samples pulled blocks for a local recompute (issue 24).

The decision itself (serve here and recompute, forward to a holder, or pull from a holder and
serve here) is ``peerinfer.core.routing.pull.consider_pull``; the node core calls it after the
routing policy (``peerinfer.core.node.choice``).

How a node uses this module
---------------------------
* **Settings.** ``NodeConfig.kv_pull`` is a ``PullSettings`` (None: pulls off, the default;
  then nothing here runs and every decision is the policy's, unchanged).
* **Trust.** A node pulls only from peers trusted for it: members of a private swarm
  (``NodeConfig.private_swarm``, set by the shell when the node runs with a swarm key), or any
  peer in an open swarm only when ``PullSettings.open_swarm`` says so explicitly. On top of
  that, every routing exclusion holds (``trusted_peers``, reputation's bans and exclusions).
* **Bandwidth.** ``LinkEstimator.observe(peer, nbytes, seconds, now)`` after every transfer
  from a peer (a pull, a probe); ``bandwidth(peer, now)`` is the decayed estimate, None when
  there is none recent. With none, a pull from that peer is not considered, and
  ``probe(peer, now)`` asks (at most once per ``probe_gap_s``) for a bounded probe of
  ``probe_bytes``: the node core turns it into a ``ProbeLink`` effect.
* **Verification.** ``PullVerifier.sample(blocks, block_size)`` names the pulled tokens whose
  KV to recompute locally (deterministic given its seed and the calls before): by default a few
  tokens spread over every block (``verify_granularity="token"``), or every token of a few
  blocks (``"block"``). The engine recomputes each from the pulled KV before it and measures its
  ``relative_error`` against the pulled KV (``Engine.token_errors``);
  ``PullVerifier.judge(errors)`` says whether the pull stands. A mismatch discards the whole
  pull and counts as a failed audit (``Trust.on_pull_checked``): the peer is banned as a liar.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from peerinfer.errors import ConfigError
from peerinfer.types import PeerId

__all__ = [
    "DEFAULT_VERIFY_RATE",
    "DEFAULT_VERIFY_TOLERANCE",
    "GRANULARITIES",
    "LinkEstimator",
    "PullSettings",
    "PullVerdict",
    "PullVerifier",
    "relative_error",
]

#: The share of a pull's tokens whose KV is recomputed to check it, spread over its blocks (at
#: least one token, or one run, in each of ``verify_min_blocks`` blocks). Chosen with
#: bench/kv_bench.py verify and the engines' measured check cost (``verifycost``;
#: docs/performance.md, "Checking pulled KV"): at 5% the check stayed under 10% of the prefill a
#: pull saves on both engines (0.058-0.095 on a loaded machine), and with 16-token blocks 80% of
#: a pull's blocks get a checked token (both engines check single tokens), so a peer that alters
#: a whole block of each pull was caught within 20 pulls in 100% of modelled runs. A peer that
#: alters the KV of one token is caught only at this rate per pull: 95% within 20 pulls needs
#: 0.139, and no engine can check that share within 10% of the saving, since a checked token
#: costs at least a prefilled token (docs/security.md, "Pulled KV"). So one rate for every
#: engine: none has a design that would let it check more for the same cost.
DEFAULT_VERIFY_RATE = 0.05
#: A recomputed token's KV matches the pulled one when their largest difference is at most this
#: share of the pulled block's largest magnitude: float noise between two runs of one engine
#: (batching, thread counts) stays orders of magnitude below it.
DEFAULT_VERIFY_TOLERANCE = 0.02
#: How a pull's checks are spread: ``"token"``, single tokens spread over every block (the
#: default: an altered block is caught when any of its tokens is checked); ``"block"``, every
#: token of a few whole blocks (what the verifier did first; the bench compares the two).
GRANULARITIES = ("token", "block")


@dataclass(frozen=True, slots=True)
class PullSettings:
    """How this node pulls KV from peers (``NodeConfig.kv_pull``; None there: never).

    ``mode``: ``"auto"`` (the core's decision: pull when its estimate beats both serving here
    and forwarding, by the margin), ``"always"`` (pull from the trusted holder with the longest
    match whenever it holds more than this node: a baseline for the benchmarks; a forward the
    policy chose stays a forward). ``kv_bytes_per_token``: the KV bytes of one token in this
    engine's format (the default model: about 46 KB in float32, 23 KB in bfloat16).
    ``peer_disk_read_bytes_per_s``: the rate a holder reads pulled blocks from its disk tier;
    ``peer_blocks_on_disk``: holders serve pulls from their disk tier (until digests say per
    block which tier it is in, one assumption for every peer; False: from memory, no read
    term). ``open_swarm``: pull in an open swarm too (any peer; off by default: only members
    of a private swarm). ``min_gain_s`` / ``min_gain_fraction``: a pull must beat the best
    other choice by ``max(min_gain_s, min_gain_fraction * best)``: a transfer estimate can
    be wrong, and a near tie is not worth the bytes. ``min_pull_tokens``: fewer tokens gained
    are not worth a pull. The link estimator's figures: ``bandwidth_half_life_s``,
    ``bandwidth_max_age_s``, ``probe_bytes``, ``probe_gap_s`` (``LinkEstimator``). The
    verifier's: ``verify_rate``, ``verify_min_blocks``, ``verify_tolerance``,
    ``verify_granularity`` (``PullVerifier``). ``extra_work_weight``: the weight of the
    ``cost`` policy's extra-work charge while pulls are on (``CostPolicy(extra_work_weight=
    ...)``, set by the node's ``Choice``; 0: the greedy choice, as with pulls off).
    """

    mode: str = "auto"
    kv_bytes_per_token: int = 46_000
    peer_disk_read_bytes_per_s: float = 500e6
    peer_blocks_on_disk: bool = False
    open_swarm: bool = False
    min_gain_s: float = 0.01
    min_gain_fraction: float = 0.1
    min_pull_tokens: int = 192
    bandwidth_half_life_s: float = 60.0
    bandwidth_max_age_s: float = 600.0
    probe_bytes: int = 1 << 20
    probe_gap_s: float = 30.0
    verify_rate: float = DEFAULT_VERIFY_RATE
    verify_min_blocks: int = 1
    verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE
    verify_granularity: str = "token"
    #: past saturation the greedy choice trails always-forwarding (issue 24's RAG sweep): the
    #: charge makes the core's choice count what a recompute costs the requests after it
    extra_work_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.verify_granularity not in GRANULARITIES:
            raise ConfigError(f"verify_granularity must be one of {GRANULARITIES}, "
                              f"got {self.verify_granularity!r}")
        if self.mode not in ("auto", "always"):
            raise ConfigError(f"kv pull mode must be 'auto' or 'always', got {self.mode!r}")
        if self.kv_bytes_per_token < 1:
            raise ConfigError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        for name in ("peer_disk_read_bytes_per_s", "bandwidth_half_life_s", "bandwidth_max_age_s",
                     "probe_gap_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        for name in ("min_gain_s", "min_gain_fraction", "verify_tolerance", "extra_work_weight"):
            value = getattr(self, name)
            if not (0.0 <= value < math.inf):
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if not 0.0 <= self.verify_rate <= 1.0:
            raise ConfigError(f"verify_rate must be in [0, 1], got {self.verify_rate}")
        if self.verify_min_blocks < 0 or self.min_pull_tokens < 1 or self.probe_bytes < 1:
            raise ConfigError("verify_min_blocks must be >= 0; min_pull_tokens, probe_bytes >= 1")


# --------------------------------------------------------------------------- bandwidth


@dataclass(slots=True)
class _Link:
    bandwidth: float  # bytes per second, the decayed mean of the samples
    weight: float  # the samples' decayed weight
    updated: float  # when the last sample came
    probe_asked: float = -math.inf


class LinkEstimator:
    """Each peer link's bandwidth, measured passively from transfers, with decay and expiry.

    A transfer of ``nbytes`` in ``seconds`` (from the request to the last byte) is a sample of
    ``nbytes / (seconds - rtt)``: the round trip is latency, not bandwidth. Transfers under
    ``min_sample_bytes`` measure latency more than bandwidth and are ignored. The estimate is
    the samples' mean weighted by age: a sample's weight halves every ``half_life_s``, so a
    link that changed is believed within a few transfers. A figure whose last sample is older
    than ``max_age_s`` is forgotten (None: unknown), and ``probe`` asks for a bounded probe,
    at most once per ``probe_gap_s`` per peer. At most ``max_links`` links are kept (the
    stalest is forgotten first).
    """

    def __init__(
        self,
        *,
        half_life_s: float = 60.0,
        max_age_s: float = 600.0,
        probe_bytes: int = 1 << 20,
        probe_gap_s: float = 30.0,
        min_sample_bytes: int = 64 * 1024,
        max_links: int = 4096,
    ) -> None:
        if not (half_life_s > 0 and max_age_s > 0 and probe_gap_s > 0) or max_links < 1:
            raise ConfigError("link estimator: half-life, ages and max_links must be positive")
        self.half_life_s = half_life_s
        self.max_age_s = max_age_s
        self.probe_bytes = probe_bytes
        self.probe_gap_s = probe_gap_s
        self.min_sample_bytes = min_sample_bytes
        self.max_links = max_links
        self._links: dict[PeerId, _Link] = {}

    @classmethod
    def for_settings(cls, settings: PullSettings) -> LinkEstimator:
        return cls(
            half_life_s=settings.bandwidth_half_life_s,
            max_age_s=settings.bandwidth_max_age_s,
            probe_bytes=settings.probe_bytes,
            probe_gap_s=settings.probe_gap_s,
        )

    def __len__(self) -> int:
        return len(self._links)

    def observe(
        self, peer: PeerId, nbytes: int, seconds: float, now: float, rtt_s: float = 0.0
    ) -> bool:
        """Take in a transfer of ``nbytes`` from ``peer`` that took ``seconds``; False if it
        was not a usable sample (too small, or no time left once the round trip is taken)."""
        if nbytes < self.min_sample_bytes or not math.isfinite(seconds):
            return False
        net = seconds - max(0.0, rtt_s)
        if not net > 0.0:
            return False
        sample = nbytes / net
        link = self._links.get(peer)
        if link is None:
            if len(self._links) >= self.max_links:
                stalest = min(self._links, key=lambda p: self._links[p].updated)
                del self._links[stalest]
            self._links[peer] = _Link(sample, 1.0, now)
            return True
        kept = link.weight * 0.5 ** (max(0.0, now - link.updated) / self.half_life_s)
        link.bandwidth = (kept * link.bandwidth + sample) / (kept + 1.0)
        link.weight = kept + 1.0
        link.updated = max(link.updated, now)
        return True

    def bandwidth(self, peer: PeerId, now: float) -> float | None:
        """The estimated bytes per second from ``peer``, None with no sample in ``max_age_s``."""
        link = self._links.get(peer)
        if link is None or now - link.updated > self.max_age_s:
            return None
        return link.bandwidth

    def probe(self, peer: PeerId, now: float) -> int | None:
        """The bytes of a probe to ask ``peer`` for, when there is no recent figure for its link
        and none was asked for in ``probe_gap_s``; None otherwise. Asking counts as asked."""
        link = self._links.get(peer)
        if link is not None and now - link.updated <= self.max_age_s:
            return None
        if link is not None and now - link.probe_asked < self.probe_gap_s:
            return None
        if link is None:
            if len(self._links) >= self.max_links:
                return None  # a full table asks nothing new: bounded work and memory
            # A placeholder that holds no figure (expired at once) but remembers the ask.
            link = self._links[peer] = _Link(0.0, 0.0, -math.inf)
        link.probe_asked = now
        return self.probe_bytes

    def forget(self, peer: PeerId) -> None:
        self._links.pop(peer, None)


# --------------------------------------------------------------------------- verification


def relative_error(pulled: Sequence[float], recomputed: Sequence[float]) -> float:
    """The largest difference between two blocks' values, over the pulled block's largest
    magnitude (inf for blocks of different sizes; 0 for two all-zero blocks). Engines compute
    the same figure over their tensors."""
    if len(pulled) != len(recomputed):
        return math.inf
    diff = 0.0
    scale = 0.0
    for a, b in zip(pulled, recomputed, strict=True):
        d = abs(a - b)
        if d > diff or d != d:  # NaN counts as a mismatch
            diff = d if d == d else math.inf
        m = abs(a)
        if m > scale:
            scale = m
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0.0 else math.inf


@dataclass(frozen=True, slots=True)
class PullVerdict:
    """A pull's check: whether it stands, the worst block's error, and which block it was."""

    ok: bool
    worst_error: float
    worst_block: int | None
    checked: int

    @property
    def detail(self) -> str:
        if self.ok:
            return f"{self.checked} checked, worst error {self.worst_error:.2e}"
        return (
            f"pulled block {self.worst_block} differs from its recompute by "
            f"{self.worst_error:.2e} (relative)"
        )


class PullVerifier:
    """Picks a random sample of each pull's tokens whose KV to recompute locally, and judges them.

    A share ``rate`` of the pulled tokens is checked. With ``granularity="token"`` (the default)
    they are spread over the blocks as evenly as the count allows (each block gets
    ``k // blocks`` tokens, a random ``k % blocks`` of them one more, at distinct random offsets),
    and at least ``min_blocks`` blocks get one: a liar that alters every token of a block is
    caught when any one of them is checked, so spreading the same compute over every block
    catches whole-block lies far more often than checking whole blocks. With ``"block"``, a
    share ``rate`` of the blocks is checked in full (at least ``min_blocks``). The dice are this
    verifier's own (``seed``), so the choice is deterministic given the seed and the pulls
    before, and a peer cannot tell which tokens will be checked. Recomputing token ``t`` needs
    the KV of the tokens before it (pulled too, or local), and costs about one token's prefill
    at that position.
    """

    def __init__(
        self,
        seed: int | str,
        *,
        rate: float = DEFAULT_VERIFY_RATE,
        min_blocks: int = 1,
        tolerance: float = DEFAULT_VERIFY_TOLERANCE,
        granularity: str = "token",
    ) -> None:
        if not 0.0 <= rate <= 1.0 or min_blocks < 0 or not tolerance >= 0.0:
            raise ConfigError("pull verifier: rate in [0, 1], min_blocks >= 0, tolerance >= 0")
        if granularity not in GRANULARITIES:
            raise ConfigError(f"pull verifier: granularity must be one of {GRANULARITIES}")
        self.rate = rate
        self.min_blocks = min_blocks
        self.tolerance = tolerance
        self.granularity = granularity
        self._rng = random.Random(f"kv-verify/{seed}")

    @classmethod
    def for_settings(cls, settings: PullSettings, seed: int | str) -> PullVerifier:
        return cls(
            seed,
            rate=settings.verify_rate,
            min_blocks=settings.verify_min_blocks,
            tolerance=settings.verify_tolerance,
            granularity=settings.verify_granularity,
        )

    def _count(self, items: int, floor: int) -> int:
        """``rate * items``, rounded up or down at random so that the mean is exact, at least
        ``floor``, at most ``items``."""
        want = self.rate * items
        k = int(want)
        if self._rng.random() < want - k:
            k += 1
        return min(items, max(k, floor))

    def sample(self, blocks: int, block_size: int = 1, run: int = 1) -> tuple[int, ...]:
        """The tokens (indexes into the pull's ``blocks * block_size`` tokens, ascending) whose
        KV to recompute; token ``t`` lies in block ``t // block_size``. With ``block_size`` 1
        a token is a block: the positions of the blocks to check.

        ``run``: with the "token" granularity, the tokens come in runs of ``run`` consecutive
        tokens of one block (at one of the block's ``ceil(block_size / run)`` aligned slots,
        so every token is as likely to be checked): an engine that recomputes a run in one
        step for about the price of one token (llama.cpp: one ``llama_decode`` reads the
        weights once) asks for runs; the share of tokens checked stays ``rate``."""
        if blocks <= 0 or block_size <= 0:
            return ()
        rng = self._rng
        if self.granularity == "block" or block_size == 1:
            chosen = sorted(rng.sample(range(blocks), self._count(blocks, self.min_blocks)))
            return tuple(b * block_size + o for b in chosen for o in range(block_size))
        run = max(1, min(run, block_size))
        slots = -(-block_size // run)
        # Runs, not tokens, are counted: rate * tokens / run of them, at least min_blocks.
        want = self.rate * blocks * block_size / run
        k = int(want)
        if rng.random() < want - k:
            k += 1
        k = min(blocks * slots, max(k, min(blocks, self.min_blocks)))
        base, extra = divmod(k, blocks)
        more = set(rng.sample(range(blocks), extra))
        out: list[int] = []
        for b in range(blocks):
            n = base + (b in more)
            for slot in sorted(rng.sample(range(slots), n)) if n else ():
                first = b * block_size + slot * run
                out.extend(range(first, min(first + run, (b + 1) * block_size)))
        return tuple(out)

    def judge(self, errors: Iterable[tuple[int, float]], block_size: int = 1) -> PullVerdict:
        """The verdict on a pull from ``(token index, relative error)`` of each token recomputed
        (``relative_error``; with ``block_size`` 1, of each block): it stands when every error
        is within the tolerance. ``worst_block`` is the worst token's block."""
        worst = 0.0
        worst_at: int | None = None
        checked = 0
        for position, error in errors:
            checked += 1
            e = math.inf if error != error else error  # NaN is a mismatch
            if worst_at is None or e > worst:
                worst, worst_at = e, position
        block = None if worst_at is None else worst_at // max(1, block_size)
        return PullVerdict(worst <= self.tolerance, worst, block, checked)
