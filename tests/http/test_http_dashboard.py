"""The dashboard in a real headless browser (Debian's ``chromium``, installed by ``make``).

Two in-process nodes; the browser loads node a's page with ``?chat=...`` (the page sends that
message on load) and tests/browser.py waits, in real time and bounded, until the page shows the
finished answer and its counters, then returns the DOM. The test checks what only a live page
can show: the node's peer id, its peer, a request counter and the routing decision of the chat
request, and the streamed answer.

``PEERINFER_DASHBOARD_SCREENSHOT=PATH`` also saves a screenshot of the page there (how
docs/figures/dashboard.png was made).

Without chromium the test is skipped, unless ``PEERINFER_REQUIRE_BROWSER=1`` (``make test``
sets it), where a missing browser fails.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import trio

from tests.http.browser import render
from tests.http.test_http import nodes, wait_until

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_TIMEOUT_S = 120.0


def _need_browser() -> str:
    if BROWSER is None:
        if os.environ.get("PEERINFER_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium is not installed (make venv installs it)")
        pytest.skip("chromium is not installed")
    return BROWSER


# What the test asserts, as the page shows it: the answer finished (or failed: then the
# assertions below say so) and the status poll after it counted the request.
PAGE_SETTLED = ("['done', 'error'].includes(document.getElementById('chat-log').dataset.state)"
                " && Number(document.getElementById('count-received').textContent) >= 1"
                " && /cost:|longest_prefix:/.test(document.body.textContent)")


async def rendered(url: str, **options: object) -> str:
    browser = _need_browser()
    return await trio.to_thread.run_sync(
        lambda: render(browser, url, until=PAGE_SETTLED, timeout_s=BROWSER_TIMEOUT_S,
                       **options))  # type: ignore[arg-type]


@pytest.mark.slow
async def test_the_dashboard_renders_live_data_and_streams_a_chat() -> None:
    _need_browser()
    async with nodes(2) as (a, b):
        await wait_until(lambda: len(a.statistics().peers) == 1)
        dom = await rendered(a.http_url + "/?chat=hello+from+the+browser")
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
            await rendered(a.http_url + "/?chat=What+is+a+prefix+cache%3F",
                           window=(1280, 1150), screenshot=os.path.abspath(shot))
