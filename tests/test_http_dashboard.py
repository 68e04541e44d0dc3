"""The dashboard in a real headless browser (Debian's ``chromium``, installed by ``make``).

Two in-process nodes; the browser loads node a's page with ``?chat=...`` (the page sends that
message on load) and ``--dump-dom`` prints the DOM once the virtual-time budget is spent (the
browser does not advance virtual time while a fetch is pending, so the streamed answer
completes). The test checks what only a live page can show: the node's peer id, its peer, a
request counter and the routing decision of the chat request, and the streamed answer.

``PEERINFER_DASHBOARD_SCREENSHOT=PATH`` also saves a screenshot of the page there (how
docs/figures/dashboard.png was made).

Without chromium the test is skipped, unless ``PEERINFER_REQUIRE_BROWSER=1`` (``make test``
sets it), where a missing browser fails.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import pytest
import trio

from tests.test_http import nodes, wait_until

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_TIMEOUT_S = 120.0


def _need_browser() -> str:
    if BROWSER is None:
        if os.environ.get("PEERINFER_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium is not installed (make venv installs it)")
        pytest.skip("chromium is not installed")
    return BROWSER


async def dump_dom(url: str, *extra: str) -> str:
    browser = _need_browser()
    with tempfile.TemporaryDirectory(prefix="peerinfer-browser-") as profile:
        argv = [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}",
            "--virtual-time-budget=30000", *extra, url,
        ]
        with trio.fail_after(BROWSER_TIMEOUT_S):
            result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True,
                                            check=False)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return result.stdout.decode()


@pytest.mark.slow
async def test_the_dashboard_renders_live_data_and_streams_a_chat() -> None:
    _need_browser()
    async with nodes(2) as (a, b):
        await wait_until(lambda: len(a.core.peers(a._now())) == 1)  # type: ignore[union-attr]
        dom = await dump_dom(a.http_url + "/?chat=hello+from+the+browser", "--dump-dom")
        assert f'id="peer-id">{a.peer_id}<' in dom
        assert f"{b.peer_id[:6]}…{b.peer_id[-8:]}" in dom  # the peers table
        assert re.search(r'id="count-received">1<', dom), "the chat request was not counted"
        log = re.search(r'<div id="chat-log" data-state="(\w+)">(.*?)</div>\s*<form', dom, re.S)
        assert log is not None and log.group(1) == "done", dom[-3000:]
        reply = re.search(r'id="reply-0" data-served-by="(\w+)" data-chunks="(\d+)" '
                          r'data-usage="[^"]*">([^<]+)<', log.group(2))
        assert reply is not None, log.group(2)
        assert reply.group(1) in (a.peer_id, b.peer_id)
        assert int(reply.group(2)) > 1  # arrived in several chunks: streamed
        assert reply.group(3).strip()
        # The page showed the routing decision of its own chat request, with the reason.
        assert "cost:" in dom or "longest_prefix:" in dom
        shot = os.environ.get("PEERINFER_DASHBOARD_SCREENSHOT")
        if shot:
            await dump_dom(a.http_url + "/?chat=What+is+a+prefix+cache%3F",
                           "--hide-scrollbars", "--window-size=1280,1150",
                           f"--screenshot={os.path.abspath(shot)}")
