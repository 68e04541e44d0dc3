"""Finding peers on the local network (mDNS), and the addresses we tell others to dial.

py-libp2p 0.8.1's mDNS (zeroconf underneath) only fills the peerstore and fires a
*process-global* ``peerDiscovery`` event, from one of zeroconf's own threads; nothing connects.
``MdnsBridge`` registers a handler on that event that hops back into the trio thread
(``TrioToken.run_sync_soon``) and hands each ``(peer id, addrs)`` to the host, which dials it
itself. Because the event is process-global, a process with several hosts (tests) delivers
every discovery to every bridge; the host ignores its own id.

Zeroconf calls block (service registration probes the network for about a second), so the
bridge starts and stops it in a worker thread, and never calls ``MDNSDiscovery.start()``: that
spawns a trio system task, which is not allowed from a thread, only to expire stale peerstore
entries that the peerstore's own TTL already expires.

Addresses: libp2p advertises what the socket is bound to, and a node listening on
``/ip4/0.0.0.0`` would tell its LAN neighbours to dial ``0.0.0.0`` (which on Linux means "this
machine"). :func:`expand_unspecified` replaces unspecified addresses by loopback and this
machine's primary address; the host uses it for identify, mDNS and ``dialable_addrs()``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence

import multiaddr
import trio
from libp2p.abc import INetworkService
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.discovery.mdns.mdns import MDNSDiscovery, create_mdns_discovery
from libp2p.peer.peerinfo import PeerInfo

logger = logging.getLogger(__name__)

#: Where a discovery goes: (peer id, dialable multiaddrs without /p2p). Called in trio's thread.
DiscoveryCallback = Callable[[str, tuple[str, ...]], None]


def primary_ipv4() -> str | None:
    """This machine's address on its default route, or None (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routing lookup only
            address: str = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def expand_unspecified(
    addrs: Sequence[multiaddr.Multiaddr], ipv4s: Sequence[str]
) -> list[multiaddr.Multiaddr]:
    """Replace ``/ip4/0.0.0.0`` by each of ``ipv4s`` and ``/ip6/::`` by ``::1``; keep order."""
    result: list[multiaddr.Multiaddr] = []
    seen: set[str] = set()
    for addr in addrs:
        text = str(addr)
        if text.startswith("/ip4/0.0.0.0/"):
            rest = text[len("/ip4/0.0.0.0") :]
            candidates = [f"/ip4/{ip}{rest}" for ip in ipv4s]
        elif text.startswith("/ip6/::/"):
            candidates = ["/ip6/::1" + text[len("/ip6/::") :]]
        else:
            candidates = [text]
        for candidate in candidates:
            if candidate not in seen:
                seen.add(candidate)
                result.append(multiaddr.Multiaddr(candidate))
    return result


def local_ipv4s() -> list[str]:
    """Loopback first (other nodes on this machine), then the primary LAN address."""
    primary = primary_ipv4()
    return ["127.0.0.1"] if primary is None else ["127.0.0.1", primary]


class MdnsBridge:
    """Runs py-libp2p's mDNS responder/browser and forwards discoveries to a trio callback."""

    def __init__(self, network: INetworkService, own_peer_id: str, on_discovered: DiscoveryCallback) -> None:
        self._network = network
        self._own_peer_id = own_peer_id
        self._on_discovered = on_discovered
        self._token = trio.lowlevel.current_trio_token()
        self._mdns: MDNSDiscovery | None = None
        self._stopped = False

    # Runs in zeroconf's thread (or any thread): never touch host state here.
    def handle_peer_info(self, peer_info: PeerInfo) -> None:
        peer_id = peer_info.peer_id.to_base58()
        if peer_id == self._own_peer_id:
            return
        addrs = tuple(str(a) for a in peer_info.addrs)
        try:
            self._token.run_sync_soon(self._on_discovered, peer_id, addrs)
        except trio.RunFinishedError:
            pass

    async def start(self, advertised: Sequence[multiaddr.Multiaddr]) -> None:
        """Register the global handler, then announce ``advertised`` (without /p2p) and browse."""
        peerDiscovery.register_peer_discovered_handler(self.handle_peer_info)
        port = 0
        for addr in advertised:
            try:
                port = int(addr.value_for_protocol("tcp"))
                break
            except Exception:
                continue
        texts = [str(a) for a in advertised]

        def start_blocking() -> MDNSDiscovery:
            mdns = create_mdns_discovery(self._network, port=port, listen_addrs=texts)
            mdns.broadcaster.register()
            return mdns

        try:
            # Shielded: a cancelled start would leak a running zeroconf (its threads, its socket).
            with trio.CancelScope(shield=True):
                mdns = await trio.to_thread.run_sync(start_blocking)
        except Exception as exc:  # no multicast on this machine: run without mDNS
            logger.warning("mDNS unavailable, continuing without it: %r", exc)
            return
        if self._stopped:  # stop() ran while we were starting: undo
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_close_mdns, mdns)
        else:
            self._mdns = mdns

    async def stop(self) -> None:
        self._stopped = True
        peerDiscovery.unregister_peer_discovered_handler(self.handle_peer_info)
        mdns, self._mdns = self._mdns, None
        if mdns is None:
            return
        with trio.move_on_after(5) as scope:
            scope.shield = True
            await trio.to_thread.run_sync(_close_mdns, mdns, abandon_on_cancel=True)  # type: ignore[call-arg]


def _close_mdns(mdns: MDNSDiscovery) -> None:
    """Unannounce and close zeroconf (blocking: run in a thread)."""
    try:
        mdns.broadcaster.unregister()
        mdns.listener.stop()
        mdns.zeroconf.close()
    except Exception as exc:
        logger.debug("stopping mDNS: %r", exc)


__all__ = ["MdnsBridge", "expand_unspecified", "local_ipv4s", "primary_ipv4"]
