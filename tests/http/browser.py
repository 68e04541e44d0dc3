"""A headless Chromium driven over the DevTools protocol on a pipe, for the dashboard tests.

Why not ``--dump-dom --virtual-time-budget``: virtual time keeps advancing while a streamed
response body is being read, so on a loaded machine the budget ran out mid-answer and the DOM
was dumped with the chat still streaming (a CI failure). Here the test waits in real time, for
a condition the page itself reports, with a bound: deterministic and still never a hang.

``--remote-debugging-pipe`` makes Chromium read protocol commands from fd 3 and write replies
to fd 4, each a JSON object ended by a NUL byte: no port, no websocket, nothing to discover.
Everything runs in one worker thread (``trio.to_thread``), so the nodes under test keep serving
in the trio loop meanwhile.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import subprocess
import tempfile
import time
from typing import Any


class BrowserError(AssertionError):
    """The browser did not start, died, or did not answer in time."""


class _Pipe:
    """The protocol connection: numbered commands, replies matched by id, events skipped."""

    def __init__(self, write_fd: int, read_fd: int, deadline: float) -> None:
        self._write_fd = write_fd
        self._read_fd = read_fd
        self._deadline = deadline
        self._buffer = b""
        self._next_id = 0

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") != self._next_id:
                continue  # an event, or a reply to nobody
            if "error" in reply:
                raise BrowserError(f"{method}: {reply['error']}")
            result: dict[str, Any] = reply.get("result", {})
            return result

    def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("the browser did not answer in time")
            ready, _, _ = select.select([self._read_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._read_fd, 1 << 16)
            if not chunk:
                raise BrowserError("the browser closed its protocol pipe (it died)")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message


def render(browser: str, url: str, *, until: str, timeout_s: float,
           window: tuple[int, int] = (1280, 1000), screenshot: str | None = None) -> str:
    """Open ``url``, wait until the JS expression ``until`` is true, return the page's DOM.

    Waits at most ``timeout_s`` in all; if ``until`` never holds, the DOM as it is then is
    returned anyway, so the caller's assertions say what is missing. Saves a PNG to
    ``screenshot`` if given. The browser and its profile are always removed.
    """
    deadline = time.monotonic() + timeout_s
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()

    def wire_protocol_fds() -> None:  # runs in the child, before exec
        # Move both ends out of the way first: either may itself be fd 3 or 4.
        reads, writes = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
                         for fd in (to_browser_r, from_browser_w))
        os.dup2(reads, 3)
        os.dup2(writes, 4)
        os.set_inheritable(3, True)
        os.set_inheritable(4, True)

    with tempfile.TemporaryDirectory(prefix="peerinfer-browser-") as profile, \
            tempfile.TemporaryFile() as stderr:
        argv = [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--disable-extensions", "--hide-scrollbars",
            f"--window-size={window[0]},{window[1]}", f"--user-data-dir={profile}",
            "--remote-debugging-pipe", "about:blank",
        ]
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=stderr, close_fds=False,
                                   preexec_fn=wire_protocol_fds)
        os.close(to_browser_r)
        os.close(from_browser_w)
        try:
            pipe = _Pipe(to_browser_w, from_browser_r, deadline)
            target = pipe.call("Target.createTarget", url=url)["targetId"]
            session = pipe.call("Target.attachToTarget", targetId=target,
                                flatten=True)["sessionId"]
            while time.monotonic() < deadline - 1.0:
                done = pipe.call("Runtime.evaluate", session, expression=f"!!({until})",
                                 returnByValue=True)
                if done.get("result", {}).get("value") is True:
                    break
                time.sleep(0.1)
            dom = pipe.call("Runtime.evaluate", session,
                            expression="document.documentElement.outerHTML",
                            returnByValue=True)["result"]["value"]
            if screenshot is not None:
                png = pipe.call("Page.captureScreenshot", session, format="png")["data"]
                with open(screenshot, "wb") as out:
                    out.write(base64.b64decode(png))
            try:
                pipe.call("Browser.close")
            except BrowserError:
                pass  # it closes its pipe as it exits
            assert isinstance(dom, str)
            return dom
        except BrowserError as error:
            stderr.seek(0)
            raise BrowserError(f"{error}; browser stderr: "
                               f"{stderr.read().decode(errors='replace')[-1500:]}") from None
        finally:
            os.close(to_browser_w)
            os.close(from_browser_r)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
