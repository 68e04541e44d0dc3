"""An emulated internet of Linux network namespaces, for the reachability (NAT) tests.

Needs root (``ip netns``) and ``nft`` (nftables); :func:`netns_unavailable` says why not when
either is missing, so tests can skip with a clear reason.

Topology (every name carries the prefix ``pin<pid>-``, so runs never collide)::

    home1 10.1.0.2 --- router1 (cone NAT)      10.201.1.2 ---+
    home2 10.2.0.2 --- router2 (cone NAT)      10.201.2.2 ---+--- pub (10.200.0.1: bootstrap/relay)
    home3 10.3.0.2 --- router3 (symmetric NAT) 10.201.3.2 ---+
                  pub2 (10.200.0.2, a second public node) --- pub

* ``pub`` is "the internet": it routes between the routers' uplinks and holds the public node's
  address 10.200.0.1 on its loopback; ``pub2`` (10.200.0.2, a second public node: a relay on
  each side of a partition) has its own namespace behind it. Traffic leaves pub and pub2 with
  their node's address, so the partition's address rules see who sent it. No namespace has a route to any home network, so a home
  node can only be reached over a connection it opened itself (or one its router maps).
* A router masquerades what leaves its uplink (nftables ``masquerade``: Linux keeps the source
  port where it can, an endpoint-independent "cone" mapping) and drops new inbound flows from
  the uplink. The symmetric router masquerades ``fully-random``: every new flow gets a random
  source port, so the port a peer saw cannot be reused by anyone else (hole punching fails).
* All addresses exist only inside these namespaces; nothing is routed to the host's networks.
* :meth:`Internet.partition` splits the swarm in two: nftables rules in ``pub`` drop every
  packet between the two groups of sites (existing flows stall, new ones never open, as when
  a real link fails silently); :meth:`Internet.heal` removes them.

Processes inside a namespace are started with ``ip netns exec`` (node processes: see
:meth:`Internet.spawn_node`). The test process itself talks to a namespace through
:func:`run_in_netns`, which runs a trio function in a helper thread that entered the
namespace (``setns`` is per thread), so sockets it opens live there.

Clean-up: :func:`emulated_internet` (a context manager) stops every process it started
(SIGTERM, then SIGKILL by pid) and deletes every namespace it created (links go with them),
also when the body raises. On entry it sweeps leftovers of earlier runs whose creating process
is gone (names ``pin<pid>-*`` with a dead pid).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio

from peerinfer.testing.cluster import (
    NodeHandle,
    _die_with_parent,
    _new_identity,
    child_environment,
)

__all__ = [
    "Internet",
    "NetnsError",
    "StatusWatch",
    "emulated_internet",
    "netns_unavailable",
    "run_in_netns",
    "sweep_leftovers",
    "upnp_gateway_unavailable",
]

T = TypeVar("T")
PREFIX = "pin"
_NAME = re.compile(rf"^{PREFIX}(\d+)-\S+")
_CLONE_NEWNET = 0x40000000
PUBLIC_ADDR = "10.200.0.1"
SECOND_PUBLIC_ADDR = "10.200.0.2"
PARTITION_TABLE = "partition"
NODE_PORT = 4737
#: The UPnP gateway run in a router for ``emulated_internet(upnp=...)`` (Debian: miniupnpd-nftables).
UPNP_DAEMON = "/usr/sbin/miniupnpd"


class NetnsError(RuntimeError):
    """A namespace command failed (its stderr is in the message)."""


def netns_unavailable() -> str | None:
    """Why the emulated internet cannot be built here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (make system-packages installs nftables)"
    return None


def upnp_gateway_unavailable() -> str | None:
    """Why a router cannot run a UPnP gateway here, or None when it can."""
    if not Path(UPNP_DAEMON).exists():
        return f"'{UPNP_DAEMON}' is not installed (make system-packages installs miniupnpd-nftables)"
    return None


def _sh(*argv: str, check: bool = True, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, input=input_text)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def _namespaces() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_namespace(name: str) -> None:
    """Kill what still runs in ``name`` (by pid: only our own leftovers live there), delete it."""
    pids = _sh("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)
    _sh("ip", "netns", "del", name, check=False)


def sweep_leftovers() -> list[str]:
    """Delete namespaces of earlier runs whose creating process is gone; the names deleted."""
    swept = []
    for name in _namespaces():
        m = _NAME.match(name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            _delete_namespace(name)
            swept.append(name)
    return swept


def _enter_netns(namespace: str) -> None:
    """Move the calling thread into ``namespace`` (``setns`` is per thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise NetnsError(f"setns({namespace}): {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def _thread_netns(native_id: int) -> int | None:
    """The inode of thread ``native_id``'s network namespace (None: the thread is gone)."""
    try:
        return os.stat(f"/proc/self/task/{native_id}/ns/net").st_ino
    except OSError:
        return None


def _go_home(libc: ctypes.CDLL, home_fd: int, barrier: threading.Barrier) -> None:
    """A worker's job for :func:`return_workers_home`: move into ``home_fd``'s namespace, then
    hold the worker until every stray one has its job."""
    libc.setns(home_fd, _CLONE_NEWNET)
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()


def _release(finished: threading.Semaphore, _outcome: object) -> None:
    finished.release()


def return_workers_home(rounds: int = 3, timeout_s: float = 5.0) -> int:
    """Move trio's cached worker threads that sit in another network namespace back into the
    calling thread's; how many were moved. Call it from a thread in the namespace to return to,
    after the loop that ran inside a namespace has ended.

    Why: trio keeps one process-wide cache of worker threads (``to_thread.run_sync``, and
    ``open_process``, which starts the child from a worker), and a new thread inherits the
    namespace of the thread that started it. A loop run inside a namespace therefore leaves
    idle workers there, and the next ``to_thread`` call of a loop outside picks one up: a
    child process started that way listens on the namespace's loopback, where nobody can reach
    it (seen: a test that ran after an emulated-LAN test could not connect to its helper
    process). Each stray worker is handed one job that ``setns``-es it home; the jobs wait on
    one barrier so that no worker takes two of them. Bounded: ``rounds`` tries of at most
    ``timeout_s`` each. The other way round stays possible (a loop inside a namespace may be
    handed a worker from outside): code run there opens its sockets on the loop's own thread,
    never in a worker, and starts no processes.
    """
    home_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    home = os.fstat(home_fd).st_ino
    libc = ctypes.CDLL(None, use_errno=True)
    moved = 0
    try:
        for _ in range(rounds):
            stray = [
                t for t in threading.enumerate()
                if t.native_id is not None and _thread_netns(t.native_id) not in (home, None)
            ]
            if not stray:
                break
            barrier = threading.Barrier(len(stray), timeout=timeout_s)
            finished = threading.Semaphore(0)
            go_home = functools.partial(_go_home, libc, home_fd, barrier)
            done = functools.partial(_release, finished)
            for _ in stray:
                trio.lowlevel.start_thread_soon(go_home, done)
            for _ in stray:
                finished.acquire(timeout=timeout_s)
            moved += len(stray)
    finally:
        os.close(home_fd)
    return moved


def run_in_netns(namespace: str, fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``fn`` to completion in a fresh trio loop on a thread inside ``namespace``."""
    result: list[T] = []
    error: list[BaseException] = []

    def main() -> None:
        try:
            _enter_netns(namespace)

            async def body() -> None:
                result.append(await fn())

            trio.run(body)
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=main, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    return_workers_home()
    if error:
        raise error[0]
    return result[0]


def view_problem(status: dict[str, Any], others: Sequence[dict[str, Any]]) -> str | None:
    """What is wrong in one node's view (``status``) of the nodes whose own statuses are
    ``others``: one missing, or its cached tokens not as that node reports them (None: right)."""
    seen = {p["peer_id"]: p for p in status["peers"]}
    for other in others:
        if other["peer_id"] == status["peer_id"]:
            continue
        p = seen.get(other["peer_id"])
        tokens = other["cache"]["tokens"]
        if p is None:
            return f"{status['peer_id']} does not know {other['peer_id']}"
        if p["cached_tokens"] != tokens or p["digest_age_s"] >= 1e10:
            return f"{status['peer_id']} sees {p['cached_tokens']} tokens at {other['peer_id']}, which holds {tokens}"
    return None


class StatusWatch:
    """Every node's status, polled every ``period_s`` from a thread in its site's namespace
    (one client connection each, reopened when it fails), timestamped on this machine's
    monotonic clock: the timeline of what each node knew, for measuring reconvergence
    without the polling of one node waiting on another's. Use as a context manager
    (:meth:`Internet.watch_statuses`); the threads stop on exit."""

    def __init__(self, net: Internet, nodes: dict[str, NodeHandle], period_s: float = 0.1) -> None:
        self.nodes = dict(nodes)
        self.period_s = period_s
        #: site -> [(monotonic time the reply came, status), ...]
        self.samples: dict[str, list[tuple[float, dict[str, Any]]]] = {site: [] for site in nodes}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, args=(net.sites[site].namespace, site, handle),
                             name=f"status-{site}", daemon=True)
            for site, handle in nodes.items()
        ]

    def __enter__(self) -> StatusWatch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def _poll(self, namespace: str, site: str, handle: NodeHandle) -> None:
        from peerinfer.client import Client

        _enter_netns(namespace)

        async def main() -> None:
            while not self._stop.is_set():
                with contextlib.suppress(Exception):  # a node not answering: reconnect, retry
                    async with Client.connect(handle.addr, timeout_s=10) as client:
                        while not self._stop.is_set():
                            with trio.fail_after(10):
                                status = await client.status()
                            with self._lock:
                                self.samples[site].append((time.monotonic(), status))
                            await trio.sleep(self.period_s)
                await trio.sleep(self.period_s)

        trio.run(main)

    def latest(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {site: s[-1][1] for site, s in self.samples.items() if s}

    def converged_each(self, since: float) -> dict[str, float | None]:
        """Per site, when after ``since`` its view of every other node (their cached tokens, as
        they report them last) became right and stayed so: its first sample from which on all
        agree; None while its latest sample does not."""
        with self._lock:
            samples = {site: list(s) for site, s in self.samples.items()}
        latest = [s[-1][1] for s in samples.values() if s]
        out: dict[str, float | None] = {}
        for site, timeline in samples.items():
            first = None
            for t, status in timeline:
                if t < since:
                    continue
                if len(latest) == len(samples) and view_problem(status, latest) is None:
                    first = t if first is None else first
                else:
                    first = None
            out[site] = first
        return out

    def problems_timeline(self, since: float, step_s: float = 1.0) -> list[str]:
        """For diagnosis: every ``step_s`` after ``since``, what was wrong in each node's view
        (its sample then, against the others' latest statuses)."""
        with self._lock:
            samples = {site: list(s) for site, s in self.samples.items()}
        latest = [s[-1][1] for s in samples.values() if s]
        names = {s[-1][1]["peer_id"]: site for site, s in samples.items() if s}
        lines = []
        end = max((s[-1][0] for s in samples.values() if s), default=since)
        t = since
        while t <= end + step_s:
            for site, timeline in samples.items():
                before = [st for at, st in timeline if at <= t]
                problem = view_problem(before[-1], latest) if before else "no sample"
                if problem is not None:
                    for peer, name in names.items():
                        problem = problem.replace(peer, name)
                    lines.append(f"+{t - since:.0f}s {site}: {problem}")
            t += step_s
        return lines

    def converged_at(self, since: float) -> float | None:
        """When, after ``since``, every node's view was right (the latest of
        :meth:`converged_each`); None while some node's is not."""
        each = self.converged_each(since)
        if any(t is None for t in each.values()):
            return None
        return max([since, *[t for t in each.values() if t is not None]])

    def wait_converged(self, since: float, timeout_s: float) -> float:
        """Seconds from ``since`` until every view is right (see :meth:`converged_at`); raises
        NetnsError with what still disagrees after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            at = self.converged_at(since)
            if at is not None:
                return at - since
            time.sleep(self.period_s)
        latest = list(self.latest().values())
        problems = [p for p in (view_problem(s, latest) for s in latest) if p is not None]
        raise NetnsError(f"views did not reconverge within {timeout_s} s: {problems or 'no status yet'}")


@dataclass
class Site:
    """One place a node can run: its namespace and address (a home, or the public node)."""

    name: str
    namespace: str
    addr: str
    router: str | None = None  # the router namespace in front of it (None: public)
    uplink: str | None = None  # the router's uplink address (what peers see)


@dataclass
class Internet:
    """The namespaces of one emulated internet, and the node processes started in them."""

    prefix: str
    workdir: Path
    sites: dict[str, Site] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    nodes: list[NodeHandle] = field(default_factory=list)
    #: other processes started in the namespaces (the UPnP gateways)
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)
    python: str = sys.executable

    def ns(self, role: str) -> str:
        return f"{self.prefix}{role}"

    def exec(self, namespace: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _sh("ip", "netns", "exec", namespace, *argv, check=check)

    # ---------------------------------------------------------------- building

    def _add_namespace(self, role: str) -> str:
        name = self.ns(role)
        _sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        self.exec(name, "ip", "link", "set", "lo", "up")
        return name

    def _link(self, a: str, a_if: str, a_addr: str, b: str, b_if: str, b_addr: str) -> None:
        _sh("ip", "link", "add", a_if, "netns", a, "type", "veth", "peer", "name", b_if, "netns", b)
        for ns, ifname, addr in ((a, a_if, a_addr), (b, b_if, b_addr)):
            self.exec(ns, "ip", "addr", "add", addr, "dev", ifname)
            self.exec(ns, "ip", "link", "set", ifname, "up")

    def build(self, homes: Sequence[tuple[str, bool]], upnp: Sequence[str] = ()) -> None:
        """Create ``pub`` and, per ``(name, symmetric)``, a router and a home behind it; the
        routers of the homes named in ``upnp`` run a UPnP gateway (see :meth:`_serve_upnp`)."""
        pub = self._add_namespace("pub")
        self.exec(pub, "ip", "addr", "add", f"{PUBLIC_ADDR}/32", "dev", "lo")
        self.exec(pub, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.sites["pub"] = Site("pub", pub, PUBLIC_ADDR)
        # The second public node has a namespace of its own behind pub, and every namespace's
        # traffic leaves with its node's address (routes with ``src``): sharing pub's, a
        # connection between the two public nodes went over loopback from an address the
        # partition's rules cannot tell apart, and a request crossed a partition through it.
        pub2 = self._add_namespace("p2")
        self.exec(pub2, "ip", "addr", "add", f"{SECOND_PUBLIC_ADDR}/32", "dev", "lo")
        self._link(pub2, "wan", "10.202.0.2/30", pub, "p2", "10.202.0.1/30")
        self.exec(pub2, "ip", "route", "add", "default", "via", "10.202.0.1", "src", SECOND_PUBLIC_ADDR)
        self.exec(pub, "ip", "route", "add", f"{SECOND_PUBLIC_ADDR}/32", "via", "10.202.0.2", "src", PUBLIC_ADDR)
        self.sites["pub2"] = Site("pub2", pub2, SECOND_PUBLIC_ADDR)
        for i, (name, symmetric) in enumerate(homes, start=1):
            router = self._add_namespace(f"r{i}")
            home = self._add_namespace(f"h{i}")
            # A UPnP gateway refuses to map ports behind a private external address (a second
            # NAT would stand in front), so its router's uplink is in a public-looking block
            # (11/8: never routed on the internet, and nothing leaves these namespaces anyway).
            wan_net = f"11.201.{i}" if name in upnp else f"10.201.{i}"
            uplink = f"{wan_net}.2"
            self._link(router, "wan", f"{uplink}/24", pub, f"r{i}", f"{wan_net}.1/24")
            self.exec(pub, "ip", "route", "replace", f"{wan_net}.0/24", "dev", f"r{i}", "src", PUBLIC_ADDR)
            self._link(home, "eth0", f"10.{i}.0.2/24", router, "lan", f"10.{i}.0.1/24")
            self.exec(router, "ip", "route", "add", "default", "via", f"{wan_net}.1")
            self.exec(home, "ip", "route", "add", "default", "via", f"10.{i}.0.1")
            self.exec(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            mode = "masquerade fully-random" if symmetric else "masquerade"
            ruleset = (
                "table ip nat {\n"
                "  chain post { type nat hook postrouting priority srcnat; policy accept;\n"
                f'    oifname "wan" {mode}\n  }}\n'
                "}\n"
                "table ip filter {\n"
                "  chain forward { type filter hook forward priority filter; policy accept;\n"
                '    iifname "wan" ct state established,related accept\n'
                + ('    iifname "wan" ct status dnat accept\n' if name in upnp else "")
                + '    iifname "wan" drop\n  }\n'
                # Like a home router: an unsolicited inbound connection is dropped, not refused
                # (a refusal would also kill a hole punch whose first SYN arrives early).
                "  chain input { type filter hook input priority filter; policy accept;\n"
                '    iifname "wan" ct state established,related accept\n'
                '    iifname "wan" drop\n  }\n'
                "}\n"
            )
            _sh("ip", "netns", "exec", router, "nft", "-f", "-", input_text=ruleset)
            self.sites[name] = Site(name, home, f"10.{i}.0.2", router=router, uplink=uplink)
            if name in upnp:
                self._serve_upnp(name)

    def _serve_upnp(self, site: str) -> None:
        """Run miniupnpd (Debian's miniupnpd-nftables) in ``site``'s router: an Internet
        Gateway Device on the LAN side that maps ports of LAN hosts to themselves only (secure
        mode), by DNAT rules in its own nftables table; the router's filter lets DNAT'd flows in."""
        s = self.sites[site]
        assert s.router is not None
        chains = (
            "table inet miniupnpd {\n"
            "  chain miniupnpd {\n  }\n"
            "  chain prerouting_miniupnpd {\n  }\n"
            "  chain postrouting_miniupnpd {\n  }\n"
            "  chain forward {\n    type filter hook forward priority 0; policy accept;\n    jump miniupnpd\n  }\n"
            "  chain prerouting {\n    type nat hook prerouting priority -100; policy accept;\n"
            "    jump prerouting_miniupnpd\n  }\n"
            "  chain postrouting {\n    type nat hook postrouting priority 100; policy accept;\n"
            "    jump postrouting_miniupnpd\n  }\n"
            "}\n"
        )
        _sh("ip", "netns", "exec", s.router, "nft", "-f", "-", input_text=chains)
        conf = self.workdir / f"{site}-miniupnpd.conf"
        conf.write_text(
            "ext_ifname=wan\nlistening_ip=lan\nhttp_port=0\nenable_natpmp=no\nenable_upnp=yes\n"
            "secure_mode=yes\nsystem_uptime=yes\n"
            "upnp_table_name=miniupnpd\nupnp_nat_table_name=miniupnpd\nupnp_forward_chain=miniupnpd\n"
            "upnp_nat_chain=prerouting_miniupnpd\nupnp_nat_postrouting_chain=postrouting_miniupnpd\n"
            "uuid=3d3cec3a-8cf0-11e0-98ee-001a6bd2d07b\n"
            "allow 1024-65535 10.0.0.0/8 1024-65535\ndeny 0-65535 0.0.0.0/0 0-65535\n"
        )
        log = (self.workdir / f"{site}-miniupnpd.log").open("wb")
        self.daemons.append(subprocess.Popen(
            ["ip", "netns", "exec", s.router, UPNP_DAEMON, "-d", "-f", str(conf),
             "-P", str(self.workdir / f"{site}-miniupnpd.pid")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent,
        ))
        log.close()

    def upnp_mappings(self, site: str) -> str:
        """The port mappings ``site``'s UPnP gateway holds now (its DNAT chain, as nft prints it)."""
        router = self.sites[site].router
        assert router is not None
        return self.exec(router, "nft", "list", "chain", "inet", "miniupnpd", "prerouting_miniupnpd").stdout

    # ---------------------------------------------------------------- links

    def set_uplink(self, site: str, up: bool) -> None:
        """Cut (``up=False``) or restore the uplink of a home's router, or pub's side of it."""
        s = self.sites[site]
        if s.router is None:
            raise ValueError("pub has no single uplink; cut a home's instead")
        self.exec(s.router, "ip", "link", "set", "wan", "up" if up else "down")
        if up:  # a link going down takes its routes along; the router's default one comes back
            gateway = s.uplink.rsplit(".", 1)[0] + ".1" if s.uplink else ""
            self.exec(s.router, "ip", "route", "replace", "default", "via", gateway)

    def _wan_addr(self, site: str) -> str:
        """The address other sites see ``site``'s traffic come from (its router's uplink)."""
        s = self.sites[site]
        return s.uplink if s.uplink is not None else s.addr

    def partition(self, group_a: Sequence[str], group_b: Sequence[str]) -> None:
        """Split the swarm: drop every packet between a site of ``group_a`` and one of
        ``group_b`` (in ``pub``, which carries all traffic between sites), both ways. Flows
        inside a group are untouched. Undone by :meth:`heal` (and by deleting the namespaces)."""
        if set(group_a) & set(group_b):
            raise ValueError("a site cannot be on both sides of a partition")
        a = ", ".join(self._wan_addr(x) for x in group_a)
        b = ", ".join(self._wan_addr(x) for x in group_b)
        rules = f"ip saddr {{ {a} }} ip daddr {{ {b} }} drop; ip saddr {{ {b} }} ip daddr {{ {a} }} drop"
        chains = "".join(
            f"  chain {hook} {{ type filter hook {hook} priority -10; policy accept; {rules}; }}\n"
            for hook in ("input", "forward", "output")
        )
        self.heal()
        _sh("ip", "netns", "exec", self.sites["pub"].namespace, "nft", "-f", "-",
            input_text=f"table ip {PARTITION_TABLE} {{\n{chains}}}\n")

    def heal(self) -> None:
        """Remove the partition's rules (no-op when there is none)."""
        pub = self.sites["pub"].namespace
        self.exec(pub, "nft", "delete", "table", "ip", PARTITION_TABLE, check=False)

    def established_tcp_peers(self, site: str) -> set[str]:
        """The remote IPs of established TCP flows through ``site``'s router (its conntrack
        table): which uplinks a home talks to directly (a hole-punched flow goes to the other
        home's router, a relayed one only to pub)."""
        router = self.sites[site].router
        if router is None:
            raise ValueError("pub has no router")
        text = self.exec(router, "cat", "/proc/net/nf_conntrack", check=False).stdout
        peers = set()
        for line in text.splitlines():
            fields = line.split()
            if "tcp" in fields and "ESTABLISHED" in fields:
                dst = next((f[4:] for f in fields if f.startswith("dst=")), None)
                if dst is not None:
                    peers.add(dst)
        return peers

    # ---------------------------------------------------------------- nodes

    def spawn_node(
        self,
        site: str,
        *,
        bootstrap: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> NodeHandle:
        """Start ``peerinfer node --engine simulated --http none`` in ``site``'s namespace."""
        s = self.sites[site]
        index = len(self.nodes)
        identity = self.workdir / f"{site}.key"
        peer_id = _new_identity(identity)
        listen = f"/ip4/{s.addr}/tcp/{NODE_PORT}"
        argv = [
            "ip", "netns", "exec", s.namespace,
            self.python, "-m", "peerinfer", "node",
            "--engine", "simulated", "--http", "none", "--no-mdns",
            "--listen", listen, "--identity", str(identity),
        ]
        for addr in bootstrap:
            argv += ["--bootstrap", addr]
        argv += list(extra_args)
        out_path = self.workdir / f"{site}.out"
        err_path = self.workdir / f"{site}.err"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                env=child_environment("simulated", env), cwd=self.workdir,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        handle = NodeHandle(
            index=index, peer_id=peer_id, addr=f"{listen}/p2p/{peer_id}", process=process,
            identity=identity, stdout_path=out_path, stderr_path=err_path, argv=tuple(argv),
        )
        self.nodes.append(handle)
        return handle

    def wait_ready(self, handles: Sequence[NodeHandle], timeout_s: float = 60.0) -> None:
        end = time.monotonic() + timeout_s
        while not all(h._poll_ready() for h in handles):
            if time.monotonic() > end:
                late = [h for h in handles if not h.ready]
                raise NetnsError("node(s) not ready:\n" + "\n".join(h.log_tail() for h in late))
            time.sleep(0.05)

    def watch_statuses(self, nodes: dict[str, NodeHandle], period_s: float = 0.1) -> StatusWatch:
        """Poll these nodes' statuses (``{site: node}``) in the background: see StatusWatch."""
        return StatusWatch(self, nodes, period_s)

    def logs(self) -> str:
        return "\n".join(h.log_tail(60) for h in self.nodes)

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        for h in self.nodes:
            h.terminate()
        for h in self.nodes:
            if h.wait_exit_blocking(5.0) is None:
                h.kill()
        for daemon in self.daemons:
            daemon.terminate()
            try:
                daemon.wait(5.0)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(5.0)
        self.daemons.clear()
        for name in reversed(self.namespaces):
            _delete_namespace(name)
        self.namespaces.clear()


@contextlib.contextmanager
def emulated_internet(
    homes: Sequence[tuple[str, bool]] = (("home1", False), ("home2", False), ("home3", True)),
    *,
    workdir: str | os.PathLike[str] | None = None,
    upnp: Sequence[str] = (),
) -> Iterator[Internet]:
    """Build the emulated internet (``homes``: ``(name, symmetric_nat)``; ``upnp``: the homes
    whose router runs a UPnP gateway); tear it all down on exit, also on error. Node logs are
    printed to stderr when the body raises."""
    reason = netns_unavailable() or (upnp_gateway_unavailable() if upnp else None)
    if reason is not None:
        raise NetnsError(reason)
    sweep_leftovers()
    tmp = None if workdir is not None else tempfile.mkdtemp(prefix="peerinfer-netns-")
    net = Internet(prefix=f"{PREFIX}{os.getpid()}-", workdir=Path(workdir or tmp or "."))
    # A previous Internet of this same process that was not closed (should not happen).
    for name in _namespaces():
        if name.startswith(net.prefix):
            _delete_namespace(name)
    try:
        net.build(homes, upnp)
        yield net
    except BaseException:
        sys.stderr.write(net.logs() + "\n")
        raise
    finally:
        net.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
