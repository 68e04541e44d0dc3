"""trio's worker threads must not stay behind in a test's network namespace.

trio keeps one process-wide cache of worker threads, and a new thread inherits the namespace of
the thread that starts it. A loop run inside a namespace (``LoopThread``, ``run_in_netns``)
starts workers there; before ``return_workers_home``, the next ``to_thread`` call or
``open_process`` of a loop outside could run in the namespace, and a child process started so
listened where nobody could reach it (a later test in the same process failed to connect to its
helper process). Skipped where namespaces cannot be made (not root, no ``tc``); `make test`
requires them.
"""

from __future__ import annotations

import os

import pytest
import trio

from peerinfer.testing.lan import LoopThread, lan_unavailable, veth_lan
from peerinfer.testing.netns import run_in_netns

_UNAVAILABLE = lan_unavailable()
if _UNAVAILABLE is not None and os.environ.get("PEERINFER_REQUIRE_NETNS") == "1":
    raise RuntimeError(f"the emulated LAN cannot run here: {_UNAVAILABLE}")
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=str(_UNAVAILABLE))


def _netns() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


async def _async_netns() -> int:
    return _netns()


async def _worker_netns() -> int:
    return await trio.to_thread.run_sync(_netns)


def _workers_netns_from_outside(count: int) -> set[int]:
    """The namespaces of ``count`` workers used at once by a loop outside any namespace."""

    async def main() -> set[int]:
        seen: set[int] = set()
        release = trio.Event()

        async def one() -> None:
            seen.add(await trio.to_thread.run_sync(_hold, release_token, release))

        release_token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
            await trio.sleep(0.5)  # every job holds its own worker
            release.set()
        return seen

    return trio.run(main)


def _hold(token: trio.lowlevel.TrioToken, release: trio.Event) -> int:
    trio.from_thread.run(release.wait, trio_token=token)
    return _netns()


def test_a_loop_inside_a_namespace_leaves_no_worker_there() -> None:
    home = _netns()
    with veth_lan() as lan:
        with LoopThread(lan.namespaces[0], name="workers") as loop:
            inside = {loop.call(_worker_netns) for _ in range(3)}
        assert inside and home not in inside  # the workers did run inside it
        assert run_in_netns(lan.namespaces[1], _async_netns) != home
        run_in_netns(lan.namespaces[1], _worker_netns)  # a worker of (or taken up in) there
        # Every cached worker a loop outside can pick up now is back home; 4 at once covers the
        # LoopThread's and run_in_netns's workers, whichever of them the cache hands out.
        assert _workers_netns_from_outside(4) == {home}
