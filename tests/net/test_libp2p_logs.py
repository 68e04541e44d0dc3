"""py-libp2p's log records in peerinfer (``peerinfer.net.logs``): they reach the application's
logging, and the routine "failed to open a stream" ERROR is demoted to DEBUG."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import peerinfer.net  # noqa: F401  (routes py-libp2p's records when imported)
from peerinfer.testing import open_cluster

ROUTINE = "Failed to open stream to peer 12D3KooWExample:\n  Error: protocol read failed"


def test_libp2p_records_reach_the_applications_logging(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    logging.getLogger("libp2p.pubsub.gossipsub").warning("a real libp2p warning")
    assert [r.getMessage() for r in caplog.records] == ["a real libp2p warning"]


def test_the_routine_stream_failure_is_demoted_to_debug(caplog: pytest.LogCaptureFixture) -> None:
    basic_host = logging.getLogger("libp2p.host.basic_host")
    caplog.set_level(logging.WARNING)
    basic_host.error(ROUTINE)
    basic_host.error("Some other basic_host error")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "Some other basic_host error")
    ]
    caplog.clear()
    logging.getLogger("libp2p.pubsub.gossipsub").warning(
        "pending message queue for peer %s exceeded limit (%d > %d), dropping oldest messages",
        "12D3KooWClient", 101, 100)
    logging.getLogger("libp2p.transport.tcp.tcp").error(
        "Failed to open TCP stream: %s", "all attempts to connect to 127.0.0.1:9 failed")
    assert caplog.records == []
    # Where py-libp2p's logs are wanted at DEBUG, the record is there, as DEBUG.
    caplog.set_level(logging.DEBUG, logger="libp2p")
    basic_host.error(ROUTINE)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("DEBUG", ROUTINE)]


@pytest.mark.slow
async def test_a_cli_status_call_prints_no_libp2p_noise(tmp_path: Path) -> None:
    """``peerinfer status`` exits as soon as it has its answer, while py-libp2p may still be
    negotiating its identify and gossip streams with the node: each such failure was a 7-line
    ERROR on the client's stderr and on the node's."""
    async with open_cluster(1) as cluster:
        (node,) = list(cluster)
        for _ in range(3):
            done = await trio.to_thread.run_sync(lambda: subprocess.run(
                [sys.executable, "-m", "peerinfer", "status", "--json", "--peer", node.addr],
                capture_output=True, text=True, timeout=60,
                env={"PEERINFER_HOME": str(tmp_path / "client"), "PATH": "/usr/bin:/bin"},
            ))
            assert done.returncode == 0, done.stderr
            assert '"peer_id"' in done.stdout
            assert done.stderr == ""
        await trio.sleep(1)  # the node's side of the last call's failed negotiations
        assert "Failed to open stream" not in node.stderr_path.read_text()
