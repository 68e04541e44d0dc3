"""``NodeOptions`` and the configs built from it (peerinfer/node/options.py).

Every option is read by exactly one builder (``core_config``, ``host_config``), or by both, or
by neither and then used where ``READ_ELSEWHERE`` says; and a node left on its defaults gets
the core's and the host's own defaults, except where a difference is listed here with its
reason. A new option, or a default that drifts, fails here."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, cast

from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel, default_costs
from peerinfer.core.node import NodeConfig
from peerinfer.net.config import HostConfig
from peerinfer.node import Node, NodeOptions
from peerinfer.node import options as node_options
from peerinfer.node.options import (
    DEFAULT_REPLICA_BUDGET_BLOCKS,
    MIN_REPLICA_BUDGET_BLOCKS,
    READ_BY_BOTH,
    READ_ELSEWHERE,
    core_config,
    engine_costs,
    host_config,
    replica_budget,
)
from peerinfer.serve import serve_node
from peerinfer.types import PeerId

PEER = PeerId("A")

#: Where a node on default options deliberately differs from the core's defaults (which are the
#: simulator's and the protocol's).
CORE_DIFFERENCES = {
    "replica_budget_blocks": "a share of this node's cache budget (none here: the node default)",
    "max_queued_per_peer": "None: the engine's slots (NodeOptions.max_queued_per_requester)",
    "preempt_after_tokens": "a home node preempts an over-share generation after 32 tokens",
    "max_prompt_tokens": "a home node's limit (docs/security.md), below the protocol's",
    "max_new_tokens": "a home node's limit (docs/security.md), below the protocol's",
}
#: Where a node on default options differs from the host's defaults.
HOST_DIFFERENCES = {
    "gossip_topics": "only the node's own model topic",
    "liveness_interval_s": "derived from the peer timeout",
    "liveness_timeout_s": "derived from the peer timeout",
}


class _Recorder:
    """Stands in for a ``NodeOptions`` and records which of its fields are read."""

    def __init__(self, options: NodeOptions) -> None:
        self._options = options
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._options, name)


def _reads() -> tuple[set[str], set[str]]:
    core, host = _Recorder(NodeOptions()), _Recorder(NodeOptions())
    core_config(cast(NodeOptions, core), PEER, max_batch_size=1, cache_capacity_bytes=None)
    host_config(cast(NodeOptions, host), "topic")
    return core.read, host.read


def test_every_option_is_read_by_exactly_one_builder_or_is_listed() -> None:
    options = {f.name for f in dataclasses.fields(NodeOptions)}
    core, host = _reads()
    assert core | host <= options
    assert core & host == set(READ_BY_BOTH)
    assert not (core | host) & set(READ_ELSEWHERE)
    assert options - core - host == set(READ_ELSEWHERE)


def test_the_options_read_elsewhere_are_read_where_listed() -> None:
    places = {
        "_load_engine": node_options._load_engine,
        "Node.serve": Node.serve,
        "Node._epoch_base": Node._epoch_base,
        "peerinfer.serve": serve_node,
        "NodeOptions.__post_init__": NodeOptions.__post_init__,
        "disk_cache_path": node_options.disk_cache_path,
    }
    for name, where in READ_ELSEWHERE.items():
        place = where.split(":")[0].split(" ")[0]
        assert place in places, f"{name}: unknown place {where!r}"
        assert f".{name}" in inspect.getsource(places[place]), f"{name} is not read in {place}"


def test_a_node_on_default_options_gets_the_core_defaults_but_where_listed() -> None:
    built = core_config(NodeOptions(), PEER, max_batch_size=1, cache_capacity_bytes=None)
    default = NodeConfig(peer_id=PEER)
    differ = {f.name for f in dataclasses.fields(NodeConfig)
              if getattr(built, f.name) != getattr(default, f.name)}
    assert differ == set(CORE_DIFFERENCES)


def test_a_node_on_default_options_gets_the_host_defaults_but_where_listed() -> None:
    built = host_config(NodeOptions(), "topic")
    default = HostConfig()
    differ = {f.name for f in dataclasses.fields(HostConfig)
              if getattr(built, f.name) != getattr(default, f.name)}
    assert differ == set(HOST_DIFFERENCES)
    # The one default that used to drift (5 s in the host against the core's 1 s).
    assert default.announce_interval_s == NodeConfig(peer_id=PEER).announce_interval_s == 1.0


def test_the_core_config_follows_the_engine() -> None:
    assert engine_costs(DEFAULT_COSTS, 1) == DEFAULT_COSTS
    assert engine_costs(DEFAULT_COSTS, 4) == default_costs(4)
    own = dataclasses.replace(DEFAULT_COSTS, prefill_s_per_token=DEFAULT_COSTS.prefill_s_per_token * 2)
    assert engine_costs(own, 4) == own.with_slots(4)
    assert engine_costs(own.with_slots(2), 4).slots == 2  # the cost model's own slots win
    config = core_config(NodeOptions(), PEER, max_batch_size=4, cache_capacity_bytes=None)
    assert config.costs.slots == 4


def test_the_replica_budget_is_asked_for_or_a_share_of_the_cache() -> None:
    assert replica_budget(123, 10**12) == 123
    assert replica_budget(None, None) == replica_budget(None, 0) == DEFAULT_REPLICA_BUDGET_BLOCKS
    assert replica_budget(None, 1000) == MIN_REPLICA_BUDGET_BLOCKS
    assert replica_budget(None, 8 * 150 * 10**6) == 10**6
    config = core_config(NodeOptions(), PEER, max_batch_size=1, cache_capacity_bytes=8 * 150 * 10**6)
    assert config.replica_budget_blocks == 10**6


def test_the_builders_copy_what_they_are_given() -> None:
    opts = NodeOptions(policy="local", announce_interval_s=0.3, peer_timeout_s=12.0, max_queue=3,
                       max_tokens=64, trusted_peers=("B",), swarm_key=b"k" * 32,
                       expected_peers=5, mdns=False)
    core = core_config(opts, PEER, max_batch_size=1, cache_capacity_bytes=None)
    assert (core.policy, core.announce_interval_s, core.peer_timeout_s, core.ping_after_s,
            core.max_queue, core.max_new_tokens, core.trusted_peers) == (
        "local", 0.3, 12.0, 4.0, 3, 64, frozenset({PeerId("B")}))
    host = host_config(opts, "topic")
    assert (host.announce_interval_s, host.liveness_interval_s, host.liveness_timeout_s,
            host.swarm_key, host.expected_peers, host.mdns, host.gossip_topics) == (
        0.3, 6.0, 6.0, b"k" * 32, 5, False, ("topic",))
    assert isinstance(core.costs, CostModel)
