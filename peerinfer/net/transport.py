"""The libp2p host as ``open_host`` builds it: TCP, Noise (XX) as the only security protocol,
Yamux as the only muxer, the resource limits, no auto-connector and one attempt per dial (see
``peerinfer.net.host``, "Transport and security" and "Limits"), and the check that a listen
port is free."""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

import multiaddr
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.swarm import Swarm
from libp2p.rcmgr import ResourceLimits, ResourceManager
from libp2p.rcmgr.connection_limits import ConnectionLimits
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from peerinfer.errors import ConfigError
from peerinfer.net import muxer
from peerinfer.net.config import HostConfig
from peerinfer.net.discovery import expand_unspecified, local_ipv4s

#: Relayed connections a peer may hold beside its ``max_connections_per_peer`` direct ones: one
#: dialed by each end through the relay when both learn the other's relayed address at once.
#: Counted in libp2p's per-peer limit, they refused the hole-punched connection (measured on the
#: emulated internet: the cone pair stayed relayed, every later punch failing on the refused
#: connection's TIME_WAIT 4-tuple).
RELAYED_CONNECTIONS_PER_PEER = 2


def build_libp2p_host(config: HostConfig, key_pair: KeyPair, listen: list[multiaddr.Multiaddr]) -> IHost:
    muxer.install()  # yamux window credit without a frame per read (peerinfer.net.muxer)
    per_peer = config.max_connections_per_peer + RELAYED_CONNECTIONS_PER_PEER
    connection_config = ConnectionConfig(
        max_connections=config.max_connections,
        min_connections=0,
        low_watermark=0,  # no auto-connector: dialing policy is ours
        high_watermark=config.max_connections,
        max_connections_per_peer=per_peer,
        dial_timeout=config.connect_timeout_s,
        inbound_upgrade_timeout=config.connect_timeout_s,
        outbound_upgrade_timeout=config.connect_timeout_s,
        outbound_stream_protocol_negotiation_timeout=config.stream_timeout_s,
        inbound_stream_protocol_negotiation_timeout=config.stream_timeout_s,
    )
    resource_manager = ResourceManager(
        limits=ResourceLimits(
            max_connections=config.max_connections + config.max_pending_connections,
            max_streams=config.max_connections * (config.max_streams_per_peer + 8),
        ),
        connection_limits=ConnectionLimits(
            max_pending_inbound=config.max_pending_connections,
            max_pending_outbound=config.max_pending_connections,
            max_established_inbound=config.max_connections,
            max_established_outbound=config.max_connections,
            max_established_per_peer=per_peer,
            max_established_total=config.max_connections,
        ),
        enable_memory_limits=False,
        enable_circuit_breaker=False,
        enable_graceful_degradation=False,
    )
    ipv4s = local_ipv4s()
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=listen,
        enable_mDNS=False,
        bootstrap=None,
        negotiate_timeout=max(1, int(config.stream_timeout_s)),
        resource_manager=resource_manager,
        connection_config=connection_config,
        addrs_factory=lambda candidates: expand_unspecified(candidates, ipv4s),
    )
    network = host.get_network()
    if isinstance(network, Swarm):
        network.retry_config = RetryConfig(max_retries=0)  # one attempt per dial; we pace retries
        # The auto-connector dials peerstore entries until half of high_watermark is connected,
        # whatever low_watermark says; it would redial peers we just dropped for misbehaving.
        network.auto_connector.maybe_connect = _no_auto_connect  # type: ignore[method-assign]
    return host


async def _no_auto_connect() -> None:
    return None


def check_ports_free(listen: Sequence[multiaddr.Multiaddr]) -> None:
    """Refuse a TCP listen address another socket already listens on.

    py-libp2p's TCP listener sets SO_REUSEPORT (for hole punching), so on Linux a second
    process binds the same port without complaint and the kernel then spreads incoming
    connections over both: dials to the first node land on either at random. A probe bound
    without SO_REUSEPORT (SO_REUSEADDR only, which still fails while a socket listens there)
    finds the port taken first.
    """
    for addr in listen:
        protocols = {p.name for p in addr.protocols()}
        if "tcp" not in protocols:
            continue
        port = int(addr.value_for_protocol("tcp"))
        if port == 0:
            continue
        if "ip6" in protocols:
            family, ip = socket.AF_INET6, addr.value_for_protocol("ip6")
        elif "ip4" in protocols:
            family, ip = socket.AF_INET, addr.value_for_protocol("ip4")
        else:
            continue
        probe = socket.socket(family, socket.SOCK_STREAM)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((ip, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"cannot listen on {addr}: the address is in use (another node?); pick "
                    "another port with --listen"
                ) from None
            raise ConfigError(f"cannot listen on {addr}: {exc.strerror}") from None
        finally:
            probe.close()


__all__ = ["RELAYED_CONNECTIONS_PER_PEER", "build_libp2p_host", "check_ports_free"]
