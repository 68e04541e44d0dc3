"""peerinfer's network shell: the only package that imports py-libp2p (0.8.1) and trio's I/O.

The API, in one screen::

    from peerinfer.net import HostConfig, open_host

    async with open_host(HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), persist_identity=False)) as host:
        host.peer_id                                   # "12D3KooW..."
        host.listen_addrs() / host.dialable_addrs()    # full multiaddrs with /p2p/<id>
        await host.connect("/ip4/.../tcp/4737/p2p/12D3KooW...")   # -> verified peer id
        host.add_known_peer(peer_id, addrs); await host.dial(peer_id)

        host.set_handler("/peerinfer/x/1", handler)    # async def handler(stream: FramedStream)
        stream = await host.open_stream(peer_id, "/peerinfer/x/1")
        await stream.send(b"..."); frame = await stream.receive(); await stream.aclose()
        reply = await host.request(peer_id, "/peerinfer/x/1", b"...")   # one frame each way
        reply = await host.streams.exchange(peer_id, "/peerinfer/x/1", body, timeout=5.0)
                                                       # async def body(use: StreamUse): on a kept
                                                       # stream or a new one; use.keep() keeps it

        messages = await host.subscribe(topic, validator)   # channel of GossipMessage
        await host.publish(topic, b"...")
        rtt = await host.ping(peer_id)                 # seconds
        events = host.peer_events()                    # channel of PeerEvent
        host.connected_peers(); await host.disconnect(peer_id); host.ban(peer_id); host.statistics()

Errors are those of ``peerinfer.errors``: ``PeerUnavailableError`` (unreachable, reset, protocol
refused), ``RequestTimeoutError`` (a deadline passed), ``ProtocolError`` (malformed or oversized
frame), ``ConfigError`` / ``InvalidRequestError`` / ``ClosedError`` (ours to fix). A clean end
of stream is ``trio.EndOfChannel``, as for trio channels.

Module map: ``api`` (``NodeHost``, ``Stream``: the narrow API the node and the client use, which
another transport may provide too), ``config`` (HostConfig and the sizing of rate limits), ``host`` (open_host, the
``Host`` façade, the theory of operation) and its parts: ``context`` (what they share),
``connections`` (registry, disconnect, healing, probes), ``gatekeeper`` (admission verdicts),
``dialing``, ``streams`` (handlers, open_stream), ``streampool`` (stream reuse), ``liveness``
(pings, the RTT table), ``topics`` (gossip glue), ``ping``, ``transport`` (the libp2p host as
built); ``framing`` (FramedStream), ``gossip`` (the guarded gossipsub), ``admission`` (the
private swarm's handshake and invites), ``discovery`` (mDNS bridge, dialable addresses),
``identity`` (the persistent key), ``logs`` (py-libp2p's log records), ``pacing``
(backoff and token bucket, pure), ``_errors`` (the one translation table).

QUIC is not offered. In a loopback trial py-libp2p 0.8.1's QUIC transport connected, carried
gossip and one 256 KiB echo (0.4 s), but 10 concurrent echoes took 5.3 s and 100 concurrent
ones all timed out after 30 s (TCP + Noise + Yamux: 100 in 3.1 s). It also secures connections
with its own TLS stack, not Noise, so the attack tests here would not cover it.
"""

from peerinfer.net.api import NodeHost, Stream, StreamUse, Transport
from peerinfer.net.config import DEFAULT_PORT, HostConfig, default_identity_path, gossip_rate_limit
from peerinfer.net.framing import FramedStream
from peerinfer.net.gossip import GossipMessage, Validator
from peerinfer.net.host import (
    PING_PROTOCOL,
    Host,
    HostStatistics,
    PeerEvent,
    PeerEventKind,
    StreamHandler,
    open_host,
)
from peerinfer.net.logs import route_libp2p_logs

# After py-libp2p's own set-up (run when it was imported, above): see peerinfer.net.logs.
route_libp2p_logs()

__all__ = [
    "DEFAULT_PORT",
    "PING_PROTOCOL",
    "FramedStream",
    "GossipMessage",
    "Host",
    "HostConfig",
    "HostStatistics",
    "NodeHost",
    "PeerEvent",
    "PeerEventKind",
    "Stream",
    "StreamHandler",
    "StreamUse",
    "Transport",
    "Validator",
    "default_identity_path",
    "gossip_rate_limit",
    "open_host",
]
