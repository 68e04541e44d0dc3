"""Yamux receive-window credit as go-yamux gives it: once half the window is consumed.

py-libp2p 0.8.1's yamux answers nearly every read of a stream with a WINDOW_UPDATE frame: a
read of a few bytes returns that much credit ("release on read", on by default) and, within
four round trips of the previous update, doubles the stream's target window (256 KiB, then 512
KiB, ... up to 16 MiB), each time in another frame. A request and its one-frame reply cost 16
muxer frames on loopback, 7 of them window updates, each one a Noise encryption, a socket write
and, at the other end, a read and a dispatch, all in front of the next data frame (measured
here: ``bench/net_bench.py``, docs/performance.md).

``install()`` replaces that policy, process-wide, with go-yamux's plain rule: count what the
reader consumed and give it back in one WINDOW_UPDATE once it reaches half the default window
(256 KiB). A stream's window then stays 256 KiB (no auto-tuning): at most 256 KiB in flight per
stream, plenty for token streams and sync replies (5 MB/s per stream even at a 50 ms round
trip). The sender never stalls while the reader keeps up, since credit comes back half a window
ahead. Window updates are standard yamux, so peers without this change interoperate.

``install()`` also stamps each connection with the time its peer last delivered a frame (any
yamux frame: data, window update, ping, go-away), read by ``heard_at``: the proof of life that
liveness takes besides its own pings (``peerinfer.net.liveness``, "slow but alive").
"""

from __future__ import annotations

from typing import Any

import trio
from libp2p.io.utils import read_exactly
from libp2p.stream_muxer.yamux import yamux

#: Credit goes back once this much of a stream's receive window has been read.
CREDIT_THRESHOLD_BYTES = yamux.DEFAULT_WINDOW_SIZE // 2

_original = yamux.YamuxStream._auto_tune_and_send_window_update
#: yamux's frame reader (the header, then a data frame's body): its module's global, replaced
_read_exactly = read_exactly
_HEARD_AT = "_peerinfer_heard_at"


async def _credit_when_half_consumed(self: yamux.YamuxStream, *, bytes_read: int = 0) -> None:
    async with self.window_lock:
        self._pending_recv_release += bytes_read
        pending = self._pending_recv_release
        if pending < CREDIT_THRESHOLD_BYTES:
            return
        self._pending_recv_release = 0
        self.recv_window += pending
    # Outside the lock, as libp2p does: inbound window updates take it too.
    await self.send_window_update(pending, skip_lock=True)


async def widen_receive_window(net_stream: object, nbytes: int) -> bool:
    """Give the peer ``nbytes`` more credit on this yamux stream, for good: its window becomes
    256 KiB + ``nbytes`` (the half-window rule then keeps it there). For a stream that carries
    bulk data one way (a KV pull): measured on a loaded loopback, 8.4 MB moved at 17-18 MB/s with
    the 256 KiB window and 24-29 MB/s with 4 MiB. Call it after the stream's first frame went
    (its SYN). False when the stream is not yamux or was widened already (a kept stream is
    widened once, however many exchanges it carries)."""
    muxed = getattr(net_stream, "muxed_stream", None)
    if not isinstance(muxed, yamux.YamuxStream) or nbytes <= 0:
        return False
    if getattr(muxed, "_peerinfer_widened", False):
        return False
    muxed._peerinfer_widened = True  # type: ignore[attr-defined]
    async with muxed.window_lock:
        muxed.recv_window += nbytes
    await muxed.send_window_update(nbytes, skip_lock=True)
    return True


async def _stamped_read_exactly(reader: Any, n: int, *args: Any, **kwargs: Any) -> bytes:
    data = await _read_exactly(reader, n, *args, **kwargs)
    setattr(reader, _HEARD_AT, trio.current_time())
    return data


def heard_at(conn: object) -> float | None:
    """When the peer last delivered a frame on ``conn`` (a libp2p ``INetConn``, in
    ``trio.current_time()``), or None if never (or not a yamux connection)."""
    muxed = getattr(conn, "muxed_conn", None)
    secured = getattr(muxed, "secured_conn", None)
    stamp = getattr(secured, _HEARD_AT, None)
    return stamp if isinstance(stamp, float) else None


def install() -> None:
    """Use the half-window credit rule for every yamux stream of this process, and stamp each
    connection when its peer delivers a frame (``heard_at``). Idempotent."""
    yamux.YamuxStream._auto_tune_and_send_window_update = _credit_when_half_consumed  # type: ignore[method-assign]
    setattr(yamux, "read_exactly", _stamped_read_exactly)  # noqa: B010 (not exported, for mypy)


def uninstall() -> None:
    """Back to py-libp2p's own credit policy (for measurements); the stamps stay: liveness
    needs them."""
    yamux.YamuxStream._auto_tune_and_send_window_update = _original  # type: ignore[method-assign]


__all__ = ["CREDIT_THRESHOLD_BYTES", "heard_at", "install", "uninstall", "widen_receive_window"]
