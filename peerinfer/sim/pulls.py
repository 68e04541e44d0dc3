"""KV pulls in the simulator (issue 24): the core decides (``peerinfer.core.routing.pull``);
this executes its pulls and probes over links with a bandwidth.

A node's core puts a pull in a local decision (``RouteDecision.pull_from``). When the request's
turn comes (``RunLocal``), the blocks the holder's engine still holds beyond the node's own
match come over the link: a round trip plus bytes / ``link_mbps`` (plus bytes / the disk read
rate with ``kv_disk``: holders serve pulls from a disk tier). The run holds its slot meanwhile
and joins the node's batch when the last byte is in (``PULL`` events, ``Simulation._pulled``),
the pulled tokens counting as cached. A holder that evicted the blocks since its digest said
otherwise sends fewer or none (a round trip lost, then a recompute); a holder that is down
answers nothing (the same). The transfer is fed back to the core as ``TransferMeasured``,
which is how its link estimator learns; a ``ProbeLink`` is a transfer of filler, fed back the
same way.

What is simplified: every link has the one bandwidth; transfers do not share a link or a
holder's disk (no contention); the holder spends no compute on a pull; the puller does not
recompute the verifier's sample (peers are honest here; about 8% of the prefill a pull saves).
"""

from __future__ import annotations

from collections.abc import Sequence

from peerinfer.core.node import ProbeLink, TransferMeasured
from peerinfer.core.prefix import PrefixHasher
from peerinfer.sim.inputs import EngineLike
from peerinfer.sim.kernel import NODE, SimKernel
from peerinfer.types import BlockHash, PeerId

__all__ = ["KvPulls"]


class KvPulls:
    """A run's pulls and probes, and their figures: ``pulled`` (per request, the tokens a pull
    brought), ``pulls``, ``pull_bytes``, ``probes``."""

    def __init__(self, sim: SimKernel, engines: Sequence[EngineLike], hasher: PrefixHasher) -> None:
        cfg = sim.config
        self.sim = sim
        self._engines = engines
        self._hasher = hasher
        self._link_bytes_per_s = cfg.link_bytes_per_s
        self._disk_bytes_per_s = cfg.disk_read_mb_s * 1e6 if cfg.kv_disk else 0.0
        self._kv_bytes_per_token = cfg.kv_bytes_per_token
        self.pulled = [0] * sim.total
        self.pulls = 0
        self.pull_bytes = 0
        self.probes = 0

    def _held_blocks(self, k: int, chain: Sequence[BlockHash]) -> int:
        """How many of ``chain``'s leading blocks node ``k``'s engine holds now."""
        cached = self._engines[k].cached
        held = 0
        for h in chain:
            if not cached(h):
                break
            held += 1
        return held

    def _down(self, p: int) -> bool:
        churn = self.sim.churn
        return churn is not None and not churn.up(p)

    def pull(
        self, n: int, i: int, tokens: Sequence[int], peer: PeerId, cached: int, now: float
    ) -> tuple[int, float]:
        """Execute a decision's pull for request ``i`` (prompt ``tokens``) on node ``n``, whose
        own engine matched ``cached`` tokens of it: returns the run's cached tokens and the
        transfer's seconds (see the module)."""
        sim = self.sim
        p = sim.index_of[peer]
        rtt = 2 * sim.delay[n][p]
        if self._down(p):
            return cached, rtt  # no answer: a round trip lost, then a recompute
        bs = self._hasher.block_size
        held = self._held_blocks(p, self._hasher.prompt_chain(tokens))
        gain = max(0, min(held * bs, len(tokens) - 1) - cached)
        nbytes = gain * self._kv_bytes_per_token
        move = rtt + nbytes / self._link_bytes_per_s
        if self._disk_bytes_per_s:
            move += nbytes / self._disk_bytes_per_s
        if gain:
            self.pulls += 1
            self.pull_bytes += nbytes
            self.pulled[i] = gain
            sim.push(now + move, NODE, n, TransferMeasured(peer, nbytes, move, rtt))
        return cached + gain, move

    def probe(self, n: int, eff: ProbeLink, now: float) -> None:
        """Measure a link as node ``n``'s core asked: ``nbytes`` of filler over it."""
        sim = self.sim
        p = sim.index_of.get(eff.peer)
        if p is None or self._down(p):
            return
        self.probes += 1
        rtt = 2 * sim.delay[n][p]
        move = rtt + eff.nbytes / self._link_bytes_per_s
        sim.push(now + move, NODE, n, TransferMeasured(eff.peer, eff.nbytes, move, rtt))
