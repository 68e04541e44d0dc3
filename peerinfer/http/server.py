"""Serve a node's HTTP API inside the node's trio loop (hypercorn's trio worker), as a task
beside the node's own (``peerinfer.serve`` starts both).

``parse_http_address`` reads ``--http`` (``HOST:PORT``, ``[::1]:PORT``, ``none``);
``check_exposure`` refuses a non-loopback address without API keys (both in
``peerinfer.http.address``); :func:`serve_http` binds
the socket itself (so a port in use is a one-line ``ConfigError``, and port 0 reports the port
the kernel picked), hands it to hypercorn as an inherited file descriptor and reports
``http://HOST:PORT`` through ``task_status`` once it accepts.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from peerinfer.errors import ConfigError
from peerinfer.http.address import check_exposure, is_loopback, parse_http_address

if TYPE_CHECKING:
    from peerinfer.node import Node

logger = logging.getLogger("peerinfer.http")

DEFAULT_HTTP = "127.0.0.1:8000"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot serve HTTP on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
    try:
        # No SO_REUSEPORT: a second process must not share this port (and steal half its
        # connections). SO_REUSEADDR only lets a restart bind past TIME_WAIT connections; on
        # Linux it still fails while another socket listens here.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(infos[0][4])
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"cannot serve HTTP on {host}:{port}: the address is in use (another node?); "
                "pick another with --http HOST:PORT, or --http none"
            ) from None
        raise ConfigError(f"cannot serve HTTP on {host}:{port}: {exc.strerror}") from None
    return sock


async def serve_http(
    node: Node, host: str, port: int, api_keys: Sequence[str] = (), *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``node``'s API until cancelled; ``task_status.started(url)`` once it accepts."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from peerinfer.http.app import HttpApi

    check_exposure(host, api_keys)
    api = HttpApi(node, api_keys)
    sock = _bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the descriptor from here on
    config.accesslog = None
    config.errorlog = logger
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 30.0
    config.include_server_header = False
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{shown}:{bound_port}"

    async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await serve(api.app, config, mode="asgi", task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        await nursery.start(run)
        task_status.started(url)


__all__ = ["DEFAULT_HTTP", "check_exposure", "is_loopback", "parse_http_address", "serve_http"]
