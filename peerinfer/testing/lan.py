"""An emulated LAN of two hosts: two Linux network namespaces joined by one veth pair, and
trio loops running in-process nodes inside them.

Needs root (``ip netns``) and ``tc``; :func:`lan_unavailable` says why not when either is
missing. ``tc netem`` (delay, loss) is not available on every kernel (not on the machine these
were written on), so the LAN has no added delay; a rate is set with a token bucket (``tc qdisc
... tbf``) on each end's egress, so both directions are shaped alike.

* :func:`veth_lan` builds the two namespaces (``pin<pid>-lana`` at 10.77.0.1 and
  ``pin<pid>-lanb`` at 10.77.0.2, a /24 on the veth between them) and deletes them on exit,
  also when the body raises; the veth goes with them. Leftovers of an earlier run whose process
  died are swept on entry (``netns.sweep_leftovers``: same name prefix).
* :class:`LoopThread` runs a trio loop on a thread that entered one namespace (``setns`` is
  per thread), with a nursery that outlives each call; :meth:`LoopThread.call` runs an async
  function there from another thread and returns its result. Sockets the loop opens (a node's
  listener, its dials) live in that namespace. Use it as a context manager: leaving cancels the
  nursery (nodes started in it stop) and joins the thread, bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from peerinfer.testing.netns import (
    PREFIX,
    NetnsError,
    _delete_namespace,
    _enter_netns,
    _namespaces,
    _sh,
    netns_unavailable,
    return_workers_home,
    sweep_leftovers,
)

__all__ = ["LAN_ADDRS", "Lan", "LoopThread", "lan_unavailable", "veth_lan"]

T = TypeVar("T")
#: The two hosts' addresses on the veth.
LAN_ADDRS = ("10.77.0.1", "10.77.0.2")


def lan_unavailable() -> str | None:
    """Why the two-host LAN cannot be built here, or None when it can."""
    reason = netns_unavailable()
    if reason is None and shutil.which("tc") is None:
        reason = "'tc' is not installed (iproute2)"
    return reason


@dataclass(frozen=True)
class Lan:
    """The two namespaces of a LAN, their addresses, and the rate each end's egress is held to
    (None: the veth unshaped)."""

    namespaces: tuple[str, str]
    addrs: tuple[str, str]
    rate_mbit: float | None

    def listen(self, host: int) -> str:
        """A libp2p listen address on ``host`` (0 or 1), on a port the kernel picks."""
        return f"/ip4/{self.addrs[host]}/tcp/0"

    def qdiscs(self) -> list[str]:
        """What ``tc`` reports for each end's egress (to show the shaping is in place)."""
        return [
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev, check=False).stdout.strip()
            for ns, dev in zip(self.namespaces, ("lan0", "lan1"), strict=True)
        ]


@contextlib.contextmanager
def veth_lan(rate_mbit: float | None = None) -> Iterator[Lan]:
    """Two namespaces joined by a veth, each end's egress shaped to ``rate_mbit`` by a token
    bucket when given; torn down on exit, also on error."""
    reason = lan_unavailable()
    if reason is not None:
        raise NetnsError(reason)
    sweep_leftovers()
    names = (f"{PREFIX}{os.getpid()}-lana", f"{PREFIX}{os.getpid()}-lanb")
    for name in names:  # a LAN of this same process that was not torn down (should not happen)
        if name in _namespaces():
            _delete_namespace(name)
    made: list[str] = []
    try:
        for name in names:
            _sh("ip", "netns", "add", name)
            made.append(name)
            _sh("ip", "-n", name, "link", "set", "lo", "up")
        _sh("ip", "link", "add", "lan0", "netns", names[0], "type", "veth",
            "peer", "name", "lan1", "netns", names[1])
        for name, dev, addr in zip(names, ("lan0", "lan1"), LAN_ADDRS, strict=True):
            _sh("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", name, "link", "set", dev, "up")
            if rate_mbit is not None:
                # The bucket holds about 1 ms of the rate (at least 64 KiB, so a 64 KiB TSO
                # segment fits); packets wait at most 50 ms for tokens before being dropped,
                # which TCP reads as congestion, as on a real link at its rate.
                burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 / 1000))
                _sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms")
        yield Lan(names, LAN_ADDRS, rate_mbit)
    finally:
        for name in reversed(made):
            _delete_namespace(name)


class LoopThread:
    """A trio loop on its own thread, inside ``namespace`` (None: this process's own), with a
    nursery that lives until :meth:`close`. See the module's docstring."""

    def __init__(self, namespace: str | None, name: str = "loop") -> None:
        self.namespace = namespace
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._main, name=f"loop-{name}", daemon=True)

    def __enter__(self) -> LoopThread:
        self._thread.start()
        if not self._ready.wait(30) or self._token is None:
            self.close()
            raise NetnsError(f"the loop in {self.namespace} did not start: {self._error}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _main(self) -> None:
        try:
            if self.namespace is not None:
                _enter_netns(self.namespace)
            trio.run(self._serve)
        except BaseException as exc:  # reported by __enter__ or close()
            self._error.append(exc)
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    @property
    def nursery(self) -> trio.Nursery:
        """The loop's long-lived nursery (for ``nursery.start`` inside a :meth:`call`)."""
        assert self._nursery is not None, "the loop is not running"
        return self._nursery

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout_s: float = 900.0) -> T:
        """Run ``await fn(*args)`` in the loop, bounded by ``timeout_s``; its result."""
        assert self._token is not None, "the loop is not running"

        async def bounded() -> T:
            with trio.fail_after(timeout_s):
                return await fn(*args)

        return trio.from_thread.run(bounded, trio_token=self._token)

    def close(self, timeout_s: float = 60.0) -> None:
        """Cancel the nursery (what runs in it stops) and join the thread, bounded."""
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise NetnsError(f"the loop in {self.namespace} did not stop within {timeout_s} s")
        if self.namespace is not None:
            return_workers_home()  # its loop's trio workers must not serve other loops in there
        if self._error:
            raise self._error[0]
