"""Start and stop a cluster of real ``peerinfer node`` processes on the loopback interface.

Used by the multi-process tests, ``bench/cluster_bench.py`` and the demo. Each node is an OS
process running ``python -m peerinfer node`` with ``--listen /ip4/127.0.0.1/tcp/<port>
--no-mdns --identity <workdir>/node<i>.key``; nothing leaves 127.0.0.1.

How a cluster starts
--------------------
1. Identities and ports are chosen *before* any process starts: the parent creates every
   node's Ed25519 key file (so it knows each peer id) and picks a free TCP port for each node
   outside the kernel's ephemeral range (so no outgoing connection can take it meanwhile). Every
   node's address is therefore known in advance and all processes start at once, which on a
   small machine is several times faster than starting them one after another.
2. Topology: ``"chain"`` (node ``i`` bootstraps from node ``i - 1``) or ``"star"`` (every node
   bootstraps from node 0). Peer exchange and gossip must do the rest.
3. A node is *ready* once it printed ``peerinfer node <peer-id> listening on <multiaddr>``
   (its stdout and stderr go to files in the work directory, so a chatty node never blocks on a
   full pipe; ``NodeHandle.log_tail()`` shows them). A node that exits first, or is not ready
   within ``ready_timeout_s``, fails the start with a ``ClusterError`` carrying its log tail.
4. With ``wait_converged=True`` (the default) the start then waits, bounded, until every node's
   status (``/peerinfer/status/1.0.0``, asked through :class:`peerinfer.client.Client`) lists
   every other node as a peer: the cluster is fully known, and every node is routable.

How it stops
------------
Leaving the context manager stops every process that is still running, whatever happened: all
of them get SIGTERM at once (a node then finishes its in-flight requests), and those still
running after ``stop_grace_s`` get SIGKILL. Each child also asks the kernel for SIGKILL should
the parent die (Linux ``PR_SET_PDEATHSIG``), so a killed test run leaves no orphan nodes.
Processes are only ever signalled by their own pid.

When the body of the block raises, every node's log tail is written to stderr first (the work
directory is removed afterwards unless ``workdir`` was given).

Two flavours of the same API: ``open_cluster`` (an async context manager, for trio code; waits
never block the event loop) and ``start_cluster`` (a plain context manager, for scripts; it may
also be used from trio code, blocking the loop while it starts). Methods that wait are async;
each has a ``*_blocking`` twin for synchronous code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import trio

import peerinfer
from peerinfer.errors import PeerInferError

__all__ = [
    "Cluster",
    "ClusterError",
    "NodeHandle",
    "open_cluster",
    "start_cluster",
]

Topology = Literal["chain", "star"]
T = TypeVar("T")

_READY = re.compile(r"^peerinfer node (\S+) listening on (\S+)\s*$")
#: Ports we pick from when the kernel's ephemeral range cannot be read.
_DEFAULT_EPHEMERAL = (32768, 60999)
_PR_SET_PDEATHSIG = 1


class ClusterError(PeerInferError):
    """A node process did not start, died, or the cluster did not converge in time."""


# --------------------------------------------------------------------------------------------
# One node process.


@dataclass(eq=False)
class NodeHandle:
    """One running (or exited) node process.

    ``addr`` is its loopback multiaddr with ``/p2p/<peer id>`` (what clients and
    ``--bootstrap`` take); ``addrs`` every address it printed.
    """

    index: int
    peer_id: str
    addr: str
    process: subprocess.Popen[bytes]
    identity: Path
    stdout_path: Path
    stderr_path: Path
    argv: tuple[str, ...]
    addrs: tuple[str, ...] = ()
    ready: bool = False
    _stdout_pos: int = field(default=0, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def send_signal(self, sig: int) -> None:
        """Signal this process (no-op once it has exited)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the node vanishes without a word, as on a power cut. Reaps it."""
        self.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM: the node stops taking requests and finishes those in flight; returns at once."""
        self.send_signal(signal.SIGTERM)

    def wait_exit_blocking(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the process to exit; its exit status, or None."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    async def wait_exit(self, timeout_s: float) -> int | None:
        """As ``wait_exit_blocking``, without blocking the trio loop."""
        with trio.move_on_after(timeout_s):
            while self.process.poll() is None:
                await trio.sleep(0.02)
        return self.process.poll()

    def stop_blocking(self, grace_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit status."""
        self.terminate()
        if self.wait_exit_blocking(grace_s) is None:
            self.kill()
        return self.process.wait()

    async def stop(self, grace_s: float = 10.0) -> int:
        """As ``stop_blocking``, without blocking the trio loop."""
        self.terminate()
        if await self.wait_exit(grace_s) is None:
            self.kill()
        return self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the node's stderr and stdout (for failure messages)."""
        out = []
        for label, path in (("stderr", self.stderr_path), ("stdout", self.stdout_path)):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                text = ""
            tail = "\n".join(text.splitlines()[-lines:])
            out.append(f"--- node {self.index} {label} ({path}) ---\n{tail}")
        return "\n".join(out)

    def _poll_ready(self) -> bool:
        """Read new stdout lines; True once the node printed its listening address."""
        try:
            with self.stdout_path.open("rb") as f:
                f.seek(self._stdout_pos)
                data = f.read()
        except OSError:
            data = b""
        # Only whole lines: a line may be half written.
        end = data.rfind(b"\n") + 1
        self._stdout_pos += end
        for raw in data[:end].decode(errors="replace").splitlines():
            m = _READY.match(raw)
            if m is None:
                continue
            if m.group(1) != self.peer_id:
                raise ClusterError(
                    f"node {self.index} reports peer id {m.group(1)}, expected {self.peer_id}\n"
                    + self.log_tail()
                )
            self.addrs = (*self.addrs, m.group(2))
            self.ready = True
        if self.ready:
            loopback = [a for a in self.addrs if a.startswith("/ip4/127.0.0.1/")]
            self.addr = (loopback or list(self.addrs))[0]
            return True
        if self.process.poll() is not None:
            raise ClusterError(
                f"node {self.index} exited with status {self.process.returncode} before it was "
                f"ready\n{self.log_tail()}"
            )
        return False


# --------------------------------------------------------------------------------------------
# Helpers.


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_taken_ports: set[int] = set()
_port_lock = threading.Lock()


def pick_port(rng: random.Random | None = None) -> int:
    """A free loopback TCP port outside the ephemeral range (never handed out twice here)."""
    rng = rng or random.Random()
    low, high = _ephemeral_range()
    candidates = [(10_000, low - 1)] if low > 11_000 else []
    if high < 64_000:
        candidates.append((high + 1, 65_000))
    if not candidates:
        candidates = [(low, high)]
    with _port_lock:
        for _ in range(1000):
            lo, hi = rng.choice(candidates)
            port = rng.randint(lo, hi)
            if port not in _taken_ports and _port_is_free(port):
                _taken_ports.add(port)
                return port
    raise ClusterError("found no free TCP port on 127.0.0.1")


def _new_identity(path: Path) -> str:
    from peerinfer.net.identity import load_or_create_identity, peer_id_of

    return peer_id_of(load_or_create_identity(path))


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # not Linux: best effort only
        pass


def child_environment(engine: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a node process: ours, unbuffered output, this checkout of peerinfer
    importable, and one compute thread per process for the ``hf`` engine (several nodes share
    the machine; torch would otherwise start one thread per core in each)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(peerinfer.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    if engine == "hf":
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = "1"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update(extra)
    return env


def _run_in_thread(fn: Callable[[], Awaitable[T]]) -> T:
    """Run an async function to completion in a fresh trio loop on a helper thread (so that
    it also works when the caller's thread already runs a trio loop)."""
    result: list[T] = []
    error: list[BaseException] = []

    def main() -> None:
        async def body() -> None:
            result.append(await fn())

        try:
            trio.run(body)
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=main, name="peerinfer-cluster-wait", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


# --------------------------------------------------------------------------------------------
# The cluster.


class Cluster:
    """A set of node processes sharing one work directory. Build it with ``open_cluster`` or
    ``start_cluster``; ``nodes`` lists every node started, in order (dead ones included)."""

    def __init__(
        self,
        workdir: Path,
        *,
        engine: str = "simulated",
        extra_args: Sequence[str] = (),
        costs_file: str | os.PathLike[str] | None = None,
        policy: str | None = None,
        cache_bytes: int | str | None = None,
        announce_interval_s: float | None = None,
        model: str | None = None,
        seed: int | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        ready_timeout_s: float | None = None,
        stop_grace_s: float = 10.0,
    ) -> None:
        self.workdir = workdir
        self.engine = engine
        self.extra_args = tuple(extra_args)
        self.costs_file = None if costs_file is None else Path(costs_file)
        self.policy = policy
        self.cache_bytes = cache_bytes
        self.announce_interval_s = announce_interval_s
        self.model = model
        self.seed = seed
        self.env = child_environment(engine, env)
        self.python = python
        # The hf engine loads (and on first use converts) a model before it listens.
        self.ready_timeout_s = (
            ready_timeout_s if ready_timeout_s is not None else (600.0 if engine == "hf" else 60.0)
        )
        self.stop_grace_s = stop_grace_s
        self.nodes: list[NodeHandle] = []
        self._rng = random.Random()

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, index: int) -> NodeHandle:
        return self.nodes[index]

    def __iter__(self) -> Iterator[NodeHandle]:
        return iter(self.nodes)

    @property
    def alive(self) -> list[NodeHandle]:
        """The nodes whose process is still running."""
        return [h for h in self.nodes if h.alive]

    def by_peer_id(self, peer_id: str) -> NodeHandle:
        for h in self.nodes:
            if h.peer_id == peer_id:
                return h
        raise KeyError(peer_id)

    # ------------------------------------------------------------------ starting nodes

    def spawn(
        self,
        *,
        bootstrap: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        port: int | None = None,
    ) -> NodeHandle:
        """Start one node process (returns at once; it is not ready yet: see ``wait_ready``).

        ``bootstrap``: multiaddrs with ``/p2p/<id>`` to join through. ``extra_args`` are added
        after the cluster's own (later flags win for single-valued options).
        """
        index = len(self.nodes)
        identity = self.workdir / f"node{index}.key"
        peer_id = _new_identity(identity)
        port = pick_port(self._rng) if port is None else port
        listen = f"/ip4/127.0.0.1/tcp/{port}"
        argv: list[str] = [
            self.python, "-m", "peerinfer", "node",
            "--engine", self.engine,
            "--listen", listen,
            "--no-mdns",
            "--identity", str(identity),
            # The HTTP API's default port would be shared by every node of the cluster.
            "--http", "none",
        ]
        if self.model is not None:
            argv += ["--model", self.model]
        if self.costs_file is not None:
            argv += ["--costs", str(self.costs_file)]
        if self.policy is not None:
            argv += ["--policy", self.policy]
        if self.cache_bytes is not None:
            argv += ["--cache-bytes", str(self.cache_bytes)]
        if self.announce_interval_s is not None:
            argv += ["--announce-interval", repr(float(self.announce_interval_s))]
        if self.seed is not None:
            argv += ["--seed", str(self.seed + index)]
        for addr in bootstrap:
            argv += ["--bootstrap", addr]
        argv += [*self.extra_args, *extra_args]
        stdout_path = self.workdir / f"node{index}.out"
        stderr_path = self.workdir / f"node{index}.err"
        with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=self.env,
                cwd=self.workdir,
                start_new_session=True,  # a Ctrl-C at the terminal reaches us, not the nodes
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        handle = NodeHandle(
            index=index,
            peer_id=peer_id,
            addr=f"{listen}/p2p/{peer_id}",
            process=process,
            identity=identity,
            stdout_path=stdout_path,
            stderr_path=stderr_path,
            argv=tuple(argv),
        )
        self.nodes.append(handle)
        return handle

    def _spawn_many(self, n: int, topology: Topology, extra_args: Sequence[str]) -> list[NodeHandle]:
        if topology not in ("chain", "star"):
            raise ValueError(f"topology must be 'chain' or 'star', got {topology!r}")
        first = len(self.nodes)
        handles: list[NodeHandle] = []
        for i in range(n):
            if first + i == 0:
                bootstrap: tuple[str, ...] = ()
            elif topology == "chain":
                bootstrap = (self.nodes[-1].addr,)
            else:
                bootstrap = (self.nodes[0].addr,)
            handles.append(self.spawn(bootstrap=bootstrap, extra_args=extra_args))
        return handles

    def wait_ready_blocking(self, handles: Sequence[NodeHandle], timeout_s: float | None = None) -> None:
        """Wait until every handle printed its address; ClusterError if one dies or is late."""
        deadline = time.monotonic() + (self.ready_timeout_s if timeout_s is None else timeout_s)
        while not all(h._poll_ready() for h in handles):
            if time.monotonic() > deadline:
                raise self._late(handles)
            time.sleep(0.02)

    async def wait_ready(self, handles: Sequence[NodeHandle], timeout_s: float | None = None) -> None:
        """As ``wait_ready_blocking``, without blocking the trio loop."""
        deadline = trio.current_time() + (self.ready_timeout_s if timeout_s is None else timeout_s)
        while not all(h._poll_ready() for h in handles):
            if trio.current_time() > deadline:
                raise self._late(handles)
            await trio.sleep(0.02)

    def _late(self, handles: Sequence[NodeHandle]) -> ClusterError:
        late = [h for h in handles if not h.ready]
        return ClusterError(
            f"{len(late)} node(s) not ready within {self.ready_timeout_s:g} s\n"
            + "\n".join(h.log_tail() for h in late)
        )

    async def add_node(
        self,
        *,
        bootstrap: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> NodeHandle:
        """Start one more node (joining through node 0 unless ``bootstrap`` says otherwise)
        and wait until it is ready (not until the others know it: see ``wait_converged``)."""
        if bootstrap is None:
            bootstrap = (self.nodes[0].addr,) if self.nodes else ()
        handle = self.spawn(bootstrap=bootstrap, extra_args=extra_args)
        await self.wait_ready([handle], timeout_s)
        return handle

    def add_node_blocking(
        self,
        *,
        bootstrap: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> NodeHandle:
        if bootstrap is None:
            bootstrap = (self.nodes[0].addr,) if self.nodes else ()
        handle = self.spawn(bootstrap=bootstrap, extra_args=extra_args)
        self.wait_ready_blocking([handle], timeout_s)
        return handle

    # ------------------------------------------------------------------ status and convergence

    async def status(self, handle: NodeHandle, timeout_s: float = 10.0) -> dict[str, Any]:
        """One node's status (the ``peerinfer status --json`` object)."""
        from peerinfer.client import Client

        with trio.fail_after(timeout_s):
            async with Client.connect(handle.addr, timeout_s=timeout_s) as client:
                return await client.status()

    async def statuses(
        self, handles: Sequence[NodeHandle] | None = None, timeout_s: float = 10.0
    ) -> list[dict[str, Any]]:
        """The status of each handle (default: every live node), asked concurrently."""
        targets = list(self.alive if handles is None else handles)
        results: list[dict[str, Any] | None] = [None] * len(targets)

        async def one(i: int) -> None:
            results[i] = await self.status(targets[i], timeout_s)

        async with trio.open_nursery() as nursery:
            for i in range(len(targets)):
                nursery.start_soon(one, i)
        return [r for r in results if r is not None]

    def statuses_blocking(
        self, handles: Sequence[NodeHandle] | None = None, timeout_s: float = 10.0
    ) -> list[dict[str, Any]]:
        return _run_in_thread(lambda: self.statuses(handles, timeout_s))

    async def wait_converged(
        self,
        timeout_s: float = 60.0,
        *,
        handles: Sequence[NodeHandle] | None = None,
        digests: bool = False,
        poll_s: float = 0.2,
    ) -> list[dict[str, Any]]:
        """Wait until every node (of ``handles``, default the live ones) lists all the others
        as peers, and with ``digests`` also agrees with each of them on its cache size (the
        ``cached_tokens`` it reports for a peer equals that peer's own ``cache.tokens``, and
        the peer's digest is confirmed). Returns the last statuses. ClusterError on timeout
        or if a node dies meanwhile.

        Uses one persistent client connection per node, so polling costs little.
        """
        from peerinfer.client import Client

        targets = list(self.alive if handles is None else handles)
        last: list[dict[str, Any]] = []
        problem: str | None = "no status yet"
        try:
            with trio.fail_after(timeout_s):
                async with contextlib.AsyncExitStack() as stack:
                    clients = [
                        await stack.enter_async_context(Client.connect(h.addr, timeout_s=10.0))
                        for h in targets
                    ]
                    while True:
                        dead = [h for h in targets if not h.alive]
                        if dead:
                            raise ClusterError(
                                f"node {dead[0].index} died while waiting for convergence\n"
                                + dead[0].log_tail()
                            )
                        last = [await c.status() for c in clients]
                        problem = convergence_problem(last, digests=digests)
                        if problem is None:
                            return last
                        await trio.sleep(poll_s)
        except trio.TooSlowError:
            raise ClusterError(
                f"the cluster did not converge within {timeout_s:g} s: {problem}"
            ) from None

    def wait_converged_blocking(
        self,
        timeout_s: float = 60.0,
        *,
        handles: Sequence[NodeHandle] | None = None,
        digests: bool = False,
    ) -> list[dict[str, Any]]:
        return _run_in_thread(
            lambda: self.wait_converged(timeout_s, handles=handles, digests=digests)
        )

    # ------------------------------------------------------------------ stopping

    def stop_all_blocking(self, grace_s: float | None = None) -> None:
        """SIGTERM every live node at once; SIGKILL whichever still runs after ``grace_s``."""
        grace = self.stop_grace_s if grace_s is None else grace_s
        running = [h for h in self.nodes if h.alive]
        for h in running:
            h.terminate()
        deadline = time.monotonic() + grace
        while any(h.alive for h in running) and time.monotonic() < deadline:
            time.sleep(0.02)
        for h in running:
            if h.alive:
                h.kill()
        for h in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.process.wait(timeout=10)

    async def stop_all(self, grace_s: float | None = None) -> None:
        """As ``stop_all_blocking``, without blocking the trio loop while the nodes drain."""
        grace = self.stop_grace_s if grace_s is None else grace_s
        running = [h for h in self.nodes if h.alive]
        for h in running:
            h.terminate()
        with trio.move_on_after(grace):
            while any(h.alive for h in running):
                await trio.sleep(0.02)
        self._kill_all()

    def print_logs(self, lines: int = 25, file: Any = None) -> None:
        """Write every node's log tail to ``file`` (default stderr; pytest shows it for a
        failed test). Called when the body of a cluster block raises."""
        out = sys.stderr if file is None else file
        for h in self.nodes:
            print(h.log_tail(lines), file=out)

    def _kill_all(self) -> None:
        for h in self.nodes:
            if h.alive:
                h.kill()
        for h in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.process.wait(timeout=10)


def convergence_problem(statuses: Sequence[dict[str, Any]], *, digests: bool = False) -> str | None:
    """What keeps these node statuses from agreeing (None when they do): a node missing a peer
    or, with ``digests``, holding a stale or unconfirmed view of a peer's cache size."""
    own = {s["peer_id"]: s["cache"]["tokens"] for s in statuses}
    for s in statuses:
        seen = {p["peer_id"]: p for p in s["peers"]}
        for other, tokens in own.items():
            if other == s["peer_id"]:
                continue
            p = seen.get(other)
            if p is None:
                return f"{s['peer_id']} does not know {other} yet"
            if digests and (p["cached_tokens"] != tokens or p["digest_age_s"] >= 1e10):
                return (
                    f"{s['peer_id']} sees {p['cached_tokens']} cached tokens at {other}, which "
                    f"holds {tokens} (digest age {p['digest_age_s']:.3g} s)"
                )
    return None


# --------------------------------------------------------------------------------------------
# Context managers.


def _make_cluster(workdir: str | os.PathLike[str] | None, kwargs: dict[str, Any]) -> tuple[Cluster, Callable[[], None]]:
    if workdir is None:
        path = Path(tempfile.mkdtemp(prefix="peerinfer-cluster-"))

        def cleanup() -> None:
            shutil.rmtree(path, ignore_errors=True)
    else:
        path = Path(workdir)
        path.mkdir(parents=True, exist_ok=True)

        def cleanup() -> None:
            return None

    return Cluster(path, **kwargs), cleanup


@contextlib.asynccontextmanager
async def open_cluster(
    n: int,
    *,
    engine: str = "simulated",
    extra_args: Sequence[str] = (),
    topology: Topology = "chain",
    costs_file: str | os.PathLike[str] | None = None,
    policy: str | None = None,
    cache_bytes: int | str | None = None,
    announce_interval_s: float | None = None,
    model: str | None = None,
    seed: int | None = None,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    workdir: str | os.PathLike[str] | None = None,
    wait_converged: bool = True,
    ready_timeout_s: float | None = None,
    converge_timeout_s: float = 60.0,
    stop_grace_s: float = 10.0,
) -> AsyncIterator[Cluster]:
    """``n`` node processes on 127.0.0.1, started at once, joined per ``topology``; yields
    the :class:`Cluster` once every node is ready (and, with ``wait_converged``, knows every
    other). Every process is stopped on exit (SIGTERM, then SIGKILL after ``stop_grace_s``).

    ``workdir`` (default: a temporary directory, removed afterwards) holds the identities and
    the node logs. ``seed`` gives node ``i`` the routing seed ``seed + i``. ``extra_args`` are
    more ``peerinfer node`` flags for every node. ``python`` is the interpreter (or a wrapper
    script taking the interpreter's arguments, e.g. to profile the nodes).
    """
    cluster, cleanup = _make_cluster(
        workdir,
        dict(
            engine=engine, extra_args=extra_args, costs_file=costs_file, policy=policy,
            cache_bytes=cache_bytes, announce_interval_s=announce_interval_s, model=model,
            seed=seed, env=env, python=python, ready_timeout_s=ready_timeout_s,
            stop_grace_s=stop_grace_s,
        ),
    )
    try:
        try:
            handles = cluster._spawn_many(n, topology, ())
            await cluster.wait_ready(handles)
            if wait_converged and n > 1:
                await cluster.wait_converged(converge_timeout_s)
            yield cluster
        except Exception as exc:
            if not isinstance(exc, ClusterError):  # those carry the log tails already
                cluster.print_logs()
            raise
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()
    finally:
        cluster._kill_all()  # whatever happened above, no process outlives the block
        cleanup()


@contextlib.contextmanager
def start_cluster(
    n: int,
    *,
    engine: str = "simulated",
    extra_args: Sequence[str] = (),
    topology: Topology = "chain",
    costs_file: str | os.PathLike[str] | None = None,
    policy: str | None = None,
    cache_bytes: int | str | None = None,
    announce_interval_s: float | None = None,
    model: str | None = None,
    seed: int | None = None,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    workdir: str | os.PathLike[str] | None = None,
    wait_converged: bool = True,
    ready_timeout_s: float | None = None,
    converge_timeout_s: float = 60.0,
    stop_grace_s: float = 10.0,
) -> Iterator[Cluster]:
    """The synchronous twin of :func:`open_cluster` (same arguments, same guarantees)."""
    cluster, cleanup = _make_cluster(
        workdir,
        dict(
            engine=engine, extra_args=extra_args, costs_file=costs_file, policy=policy,
            cache_bytes=cache_bytes, announce_interval_s=announce_interval_s, model=model,
            seed=seed, env=env, python=python, ready_timeout_s=ready_timeout_s,
            stop_grace_s=stop_grace_s,
        ),
    )
    try:
        try:
            handles = cluster._spawn_many(n, topology, ())
            cluster.wait_ready_blocking(handles)
            if wait_converged and n > 1:
                cluster.wait_converged_blocking(converge_timeout_s)
            yield cluster
        except Exception as exc:
            if not isinstance(exc, ClusterError):  # those carry the log tails already
                cluster.print_logs()
            raise
        finally:
            cluster.stop_all_blocking()
    finally:
        cluster._kill_all()
        cleanup()
