"""UPnP port mapping: ask the home router to forward our listen port (``peerinfer node --upnp``).

Off by default: a mapping opens a port on the user's router, which they should choose to do.

Algorithm (:func:`open_port_mapping`, once, when reachability starts)
--------------------------------------------------------------------
1. Find the router's Internet Gateway Device by SSDP on the LAN and ask for its external IP
   (py-libp2p's ``UpnpManager``, on miniupnpc; each call runs in a worker thread and is
   bounded by miniupnpc's own timeouts; ``UPNP_TIMEOUT_S`` gives up between calls). No gateway, a gateway that answers with a private external IP
   (a second NAT behind it: a mapping would not make us reachable), or a refused mapping: one
   log line, and the node carries on without (a relay reservation, as before).
2. Map TCP ``<external IP>:<listen port>`` to ``<our LAN address>:<listen port>`` (the same port:
   the dial-back test asks peers to dial the port we listen on) and advertise
   ``/ip4/<external IP>/tcp/<port>/p2p/<us>`` in ``Host.dialable_addrs()``.
3. The mapping proves nothing by itself: the dial-back test that follows (net/reach.py) decides
   whether we are reachable, exactly as for a node with a forwarded port. On shutdown the
   mapping is removed (bounded; py-libp2p's manager maps without a lease, so a node that is
   killed leaves it until the router restarts or the same node maps it again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from peerinfer.net.host import Host

__all__ = ["UPNP_TIMEOUT_S", "PortMapping", "open_port_mapping"]

logger = logging.getLogger(__name__)

#: Discovery, the external IP and the mapping together (SSDP waits ~2 s for answers).
UPNP_TIMEOUT_S = 10.0
#: Removing the mapping at shutdown.
UPNP_CLOSE_TIMEOUT_S = 3.0


@dataclass
class PortMapping:
    """One TCP port mapped on the router, and the address of ours it made."""

    host: Host
    manager: object  # libp2p.discovery.upnp.UpnpManager (imported lazily: miniupnpc)
    port: int
    external_ip: str

    @property
    def addr(self) -> str:
        return f"/ip4/{self.external_ip}/tcp/{self.port}/p2p/{self.host.peer_id}"

    async def close(self) -> None:
        """Withdraw the address and remove the mapping (bounded; shielded from cancellation,
        since this runs while the node shuts down)."""
        self.host.remove_advertised_addr(self.addr)
        with trio.CancelScope(shield=True), trio.move_on_after(UPNP_CLOSE_TIMEOUT_S):
            if await self.manager.remove_port_mapping(self.port, "TCP"):  # type: ignore[attr-defined]
                logger.info("UPnP: mapping of port %d removed", self.port)


async def open_port_mapping(host: Host, port: int) -> PortMapping | None:
    """Map ``port`` on the LAN's UPnP gateway and advertise the external address; None (with
    one log line saying why) where there is no usable gateway or it refuses."""
    try:
        from libp2p.discovery.upnp.upnp import UpnpManager
    except ImportError as exc:  # miniupnpc is a dependency of libp2p, but a build may lack it
        logger.warning("UPnP: not available (%s); carrying on without a port mapping", exc)
        return None
    manager = UpnpManager()
    with trio.move_on_after(UPNP_TIMEOUT_S) as scope:
        if not await manager.discover():
            logger.warning("UPnP: no usable gateway on this network; carrying on without a port mapping")
            return None
        external_ip = manager.get_external_ip()
        if external_ip is None or not await manager.add_port_mapping(port, "TCP"):
            logger.warning("UPnP: the gateway refused to map port %d; carrying on without", port)
            return None
    if scope.cancelled_caught:
        logger.warning("UPnP: no answer within %.0f s; carrying on without a port mapping", UPNP_TIMEOUT_S)
        return None
    mapping = PortMapping(host, manager, port, external_ip)
    host.add_advertised_addr(mapping.addr)
    logger.info("UPnP: port %d mapped; reachable (if the dial-back test agrees) as %s", port, mapping.addr)
    return mapping
