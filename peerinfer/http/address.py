"""The HTTP API's address: ``--http`` parsed, and the rule that an API reachable from other
machines must demand a key. Pure; the server and the ASGI app both use it."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from peerinfer.errors import ConfigError


def parse_http_address(text: str | None) -> tuple[str, int] | None:
    """``HOST:PORT`` -> (host, port); ``none``/``off``/empty -> None. Raises ``ConfigError``."""
    if text is None or text.strip().lower() in ("", "none", "off"):
        return None
    value = text.strip()
    if value.startswith("http://"):
        value = value.removeprefix("http://").rstrip("/")
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        port_text = rest.removeprefix(":") if sep else ""
    else:
        host, _, port_text = value.rpartition(":")
    if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"--http takes HOST:PORT (e.g. 127.0.0.1:8000) or none, not {text!r}")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_keys: Sequence[str]) -> None:
    """An API reachable from other machines must demand a key."""
    if not is_loopback(host) and not any(api_keys):
        raise ConfigError(
            f"refusing to serve the HTTP API on {host} without an API key: anyone on the "
            "network could use it; pass --api-key (or --api-key-file, or PEERINFER_API_KEY), "
            "or bind 127.0.0.1"
        )


__all__ = ["check_exposure", "is_loopback", "parse_http_address"]
