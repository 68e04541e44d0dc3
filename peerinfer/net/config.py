"""Configuration of the network shell: one frozen value, checked once, no libp2p types.

Every limit the adapter enforces is a field here, with the reason for its default next to it.
``HostConfig.check()`` raises ``ConfigError`` for values that cannot work; ``open_host`` calls it.

Sizing the gossip rate limit
----------------------------
py-libp2p 0.8.1's gossipsub drops, silently, every message above
``max_messages_per_topic_per_second`` that arrives from one *forwarder* on one topic within a
sliding second (default 10). The key is the forwarder, not the origin: a neighbour relays the
announcements of the whole swarm, so with ``N`` peers announcing every ``T`` seconds one
neighbour may hand us ``N / T`` messages per second in steady state, and up to ``N`` within one
second when announcement phases line up. :func:`gossip_rate_limit` takes the larger of the two,
doubles it for headroom, and never goes below libp2p's 10. Our own ``publish`` is paced to a
quarter of that limit (:func:`own_publish_rate`), so a neighbour that counts our relays plus our
own messages still accepts all of them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from peerinfer.core.messages import MAX_FRAME_BYTES
from peerinfer.core.node import NodeConfig
from peerinfer.errors import ConfigError

#: Our default TCP port (unassigned in practice; IANA lists 4737 for a long-dead IPDR service).
DEFAULT_PORT = 4737

#: libp2p gossipsub's own default, which we never go below.
LIBP2P_DEFAULT_GOSSIP_RATE = 10.0

#: py-libp2p splits outbound RPCs at 1 MiB and silently drops a part that is still larger, so a
#: message (plus its envelope, under 64 KiB) must stay below this.
MAX_GOSSIP_MESSAGE_BYTES = 1024 * 1024 - 64 * 1024


def default_data_dir() -> Path:
    """Where peerinfer keeps per-user state: ``$PEERINFER_HOME``, else the XDG data dir."""
    home = os.environ.get("PEERINFER_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "peerinfer"


def default_identity_path() -> Path:
    """The default location of the node's persistent Ed25519 key."""
    return default_data_dir() / "identity.key"


def gossip_rate_limit(expected_peers: int, announce_interval_s: float, headroom: float = 2.0) -> float:
    """Messages per second one forwarder may send us on one topic before gossipsub drops them.

    ``expected_peers / announce_interval_s`` is the steady rate a single neighbour may relay;
    ``expected_peers`` is the worst one-second burst (every peer announcing in the same second,
    which bounds the rate whenever the interval is at least a second).
    """
    if expected_peers < 1 or announce_interval_s <= 0 or headroom < 1:
        raise ConfigError("expected_peers >= 1, announce_interval_s > 0 and headroom >= 1 required")
    steady = expected_peers / announce_interval_s
    burst = float(expected_peers)
    return max(LIBP2P_DEFAULT_GOSSIP_RATE, math.ceil(headroom * max(steady, burst)))


def own_publish_rate(limit: float) -> float:
    """How many messages per second per topic we originate: a quarter of what peers accept."""
    return max(1.0, limit / 4)


def _core_default(name: str) -> float:
    """A default of the core's ``NodeConfig`` that the host must agree with."""
    value = next(f.default for f in dataclasses.fields(NodeConfig) if f.name == name)
    assert isinstance(value, float)
    return value


#: The core's default announcement period (``NodeConfig.announce_interval_s``).
_CORE_ANNOUNCE_INTERVAL_S = _core_default("announce_interval_s")


@dataclass(frozen=True, slots=True)
class HostConfig:
    """Everything ``open_host`` needs. All durations are in seconds, all sizes in bytes."""

    #: Multiaddrs to listen on. TCP only by default: py-libp2p 0.8.1's QUIC works on loopback,
    #: but secures with its own TLS instead of Noise and is much less exercised; see net/__init__.
    listen: tuple[str, ...] = (f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}",)
    #: The persistent Ed25519 identity key (created 0600 on first start, loaded afterwards);
    #: ``None`` means :func:`default_identity_path`.
    identity_path: Path | None = None
    #: ``False``: a fresh random identity each start, nothing written (tests, throwaway nodes).
    persist_identity: bool = True
    #: Multiaddrs with ``/p2p/<id>`` that we keep connected to, redialing with backoff forever.
    bootstrap: tuple[str, ...] = ()
    #: Announce ourselves and connect to peers found by mDNS on the local network.
    mdns: bool = True

    # --- gossip ---------------------------------------------------------------------------
    #: If set, the only topics we may subscribe to and the only ones remote subscriptions are
    #: tracked for (a peer cannot make us keep state for arbitrary topics).
    gossip_topics: tuple[str, ...] | None = None
    #: The swarm size the gossip rate limit is sized for (see the module docstring).
    expected_peers: int = 64
    #: How often each peer announces (the node batches its announcements to one per period):
    #: by default the core's own default period, so the rate limit fits what peers send.
    announce_interval_s: float = _CORE_ANNOUNCE_INTERVAL_S
    #: Overrides the computed gossipsub per-forwarder rate limit when set.
    gossip_rate_limit: float | None = None
    #: Largest gossip message we publish or accept (at most MAX_GOSSIP_MESSAGE_BYTES).
    gossip_max_message_bytes: int = 512 * 1024
    #: gossipsub heartbeat; the spec's 1 s (py-libp2p defaults to 120 s).
    heartbeat_interval_s: int = 1
    #: Mesh degree D, D_low, D_high: the gossipsub spec's defaults, sane from 3 to a few
    #: hundred peers (small swarms simply mesh with everyone).
    gossip_degree: tuple[int, int, int] = (6, 4, 12)
    #: Messages buffered per local subscriber before we drop (and count) the newest.
    subscription_buffer: int = 1024
    #: How long an async topic validator may take before the message is rejected.
    validation_timeout_s: float = 5.0

    # --- streams --------------------------------------------------------------------------
    #: Largest frame on our stream protocols; bigger frames are a ProtocolError.
    max_frame_bytes: int = MAX_FRAME_BYTES
    #: Default deadline of one stream operation (open, one frame read, one frame write).
    stream_timeout_s: float = 10.0
    #: Inbound handler invocations running at once per peer; more are reset on arrival.
    max_streams_per_peer: int = 32

    # --- connections ----------------------------------------------------------------------
    #: Deadline of one dial (TCP connect + Noise + muxer).
    connect_timeout_s: float = 10.0
    #: Established connections, all peers together, and per peer.
    max_connections: int = 256
    max_connections_per_peer: int = 2
    #: Connections being set up (handshakes in flight) at once, per direction.
    max_pending_connections: int = 32
    #: Bootstrap redial backoff: doubles from min to max, never gives up.
    bootstrap_backoff_min_s: float = 1.0
    bootstrap_backoff_max_s: float = 30.0

    # --- admission (private swarms, see peerinfer.net.admission) --------------------------
    #: The swarm key: when set, a peer is served nothing (streams, gossip) and used for
    #: nothing until it proved it holds the key; peers that fail are disconnected.
    swarm_key: bytes | None = field(default=None, repr=False)
    #: How long a new connection may take to pass admission before it is closed.
    admission_timeout_s: float = 5.0

    # --- liveness -------------------------------------------------------------------------
    #: Ping every connected peer this often (0 disables); a hung (SIGSTOPped) peer keeps its TCP
    #: connection open and py-libp2p would keep it for minutes.
    liveness_interval_s: float = 10.0
    #: Deadline of one liveness ping.
    liveness_timeout_s: float = 5.0
    #: Consecutive failed pings after which the peer's connections are retired (closed; one
    #: still delivering a request in flight once that ends: Connections.retire) and the peer
    #: reported unresponsive. A late ping while the peer's frames arrive is not a failure
    #: (peerinfer.net.liveness, "Slow but alive").
    liveness_max_failures: int = 2
    #: A fresh connection to a peer whose pings failed replaces the ones they failed on at once
    #: (Connections.replace_stalled: a cut relay link then heals within 1.3-4 announce intervals, 5
    #: without; docs/reach.md, "Healing"); a fresh connection to a peer that holds others has
    #: each older one pinged over itself, and those that stay silent are replaced too
    #: (Connections._replace_silent: a restarted peer's old connection, never closed). Our pubsub
    #: stream moves off a replaced connection at once. (Off for a while: a restarted peer
    #: stayed admitted but silent, as py-libp2p's pubsub forgot the subscriptions of a peer
    #: whose old stream failed, also those its new stream had just sent; net.gossip keeps them.)
    replace_stalled_connections: bool = True

    def effective_gossip_rate_limit(self) -> float:
        """The gossipsub per-forwarder, per-topic message limit we configure."""
        if self.gossip_rate_limit is not None:
            return self.gossip_rate_limit
        return gossip_rate_limit(self.expected_peers, self.announce_interval_s)

    def effective_identity_path(self) -> Path:
        return self.identity_path if self.identity_path is not None else default_identity_path()

    def check(self) -> None:
        """Raise ConfigError if any value cannot work."""
        if not self.listen:
            raise ConfigError("at least one listen address is required")
        positive = {
            "announce_interval_s": self.announce_interval_s,
            "stream_timeout_s": self.stream_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "validation_timeout_s": self.validation_timeout_s,
            "liveness_timeout_s": self.liveness_timeout_s,
            "bootstrap_backoff_min_s": self.bootstrap_backoff_min_s,
            "admission_timeout_s": self.admission_timeout_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        at_least_one = {
            "expected_peers": self.expected_peers,
            "gossip_max_message_bytes": self.gossip_max_message_bytes,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "subscription_buffer": self.subscription_buffer,
            "max_frame_bytes": self.max_frame_bytes,
            "max_streams_per_peer": self.max_streams_per_peer,
            "max_connections": self.max_connections,
            "max_connections_per_peer": self.max_connections_per_peer,
            "max_pending_connections": self.max_pending_connections,
            "liveness_max_failures": self.liveness_max_failures,
        }
        for name, value in at_least_one.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value!r}")
        if self.gossip_max_message_bytes > MAX_GOSSIP_MESSAGE_BYTES:
            raise ConfigError(f"gossip_max_message_bytes must be <= {MAX_GOSSIP_MESSAGE_BYTES}")
        if self.bootstrap_backoff_max_s < self.bootstrap_backoff_min_s:
            raise ConfigError("bootstrap_backoff_max_s must be >= bootstrap_backoff_min_s")
        if self.liveness_interval_s < 0:
            raise ConfigError("liveness_interval_s must be >= 0 (0 disables)")
        d, d_low, d_high = self.gossip_degree
        if not 1 <= d_low <= d <= d_high:
            raise ConfigError(f"gossip_degree must satisfy 1 <= D_low <= D <= D_high, got {self.gossip_degree}")
        if self.gossip_rate_limit is not None and self.gossip_rate_limit < 1:
            raise ConfigError("gossip_rate_limit must be >= 1")
        if self.swarm_key is not None and not self.swarm_key:
            raise ConfigError("the swarm key is empty (leave it unset for an open swarm)")
        if self.gossip_topics is not None and not all(self.gossip_topics):
            raise ConfigError("gossip topics must be non-empty strings")


__all__ = [
    "DEFAULT_PORT",
    "MAX_GOSSIP_MESSAGE_BYTES",
    "HostConfig",
    "default_data_dir",
    "default_identity_path",
    "gossip_rate_limit",
    "own_publish_rate",
]
