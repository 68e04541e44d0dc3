"""The command line a user meets: one-line errors, ports in use, and ``peerinfer chat``.

Each test runs ``python -m peerinfer`` as a child process (bounded by a deadline; trio kills it
on timeout) against in-process nodes on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from peerinfer.cli import _bytes_amount
from peerinfer.node import Node
from peerinfer.serve import serve_node
from tests.http.test_http import COSTS, RecordingEngine, options

CHILD_TIMEOUT_S = 90.0


async def run_cli(*args: str, stdin: bytes = b"", env: dict[str, str] | None = None) -> Any:
    child_env = {**os.environ, "PYTHONPATH": os.getcwd(), **(env or {})}
    with trio.fail_after(CHILD_TIMEOUT_S):
        return await trio.run_process(
            [sys.executable, "-m", "peerinfer", *args], stdin=stdin, capture_stdout=True,
            capture_stderr=True, check=False, env=child_env,
        )


def one_line_error(result: Any) -> str:
    err = result.stderr.decode()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@asynccontextmanager
async def node(**overrides: Any) -> AsyncIterator[Node]:
    async with trio.open_nursery() as nursery:
        n = Node(options(**overrides), engine=RecordingEngine(costs=COSTS))
        await nursery.start(serve_node, n)
        try:
            yield n
        finally:
            nursery.cancel_scope.cancel()


def test_cache_bytes_accepts_sizes_and_rejects_nonsense() -> None:
    import argparse

    assert _bytes_amount("512M") == 512 * 2**20
    assert _bytes_amount("2G") == 2 * 2**30
    assert _bytes_amount("1.5GiB") == int(1.5 * 2**30)
    assert _bytes_amount("1000000") == 1_000_000
    for bad in ("abc", "-5G", "0", "nanG", "infM", "1e400G", "", "5X"):
        with pytest.raises(argparse.ArgumentTypeError):
            _bytes_amount(bad)


def test_api_keys_come_from_flags_a_file_and_the_environment(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from peerinfer.cli import _api_keys
    from peerinfer.errors import ConfigError

    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-file-key-1\n\nsk-file-key-2\n")
    monkeypatch.setenv("PEERINFER_API_KEY", "sk-env-key-0")
    args = argparse.Namespace(api_key=["sk-flag-key"], api_key_file=keys)
    assert _api_keys(args) == ("sk-flag-key", "sk-file-key-1", "sk-file-key-2", "sk-env-key-0")
    monkeypatch.delenv("PEERINFER_API_KEY")
    with pytest.raises(ConfigError, match="8 characters"):
        _api_keys(argparse.Namespace(api_key=["short"], api_key_file=None))
    with pytest.raises(ConfigError, match="cannot read"):
        _api_keys(argparse.Namespace(api_key=None, api_key_file=tmp_path / "missing"))


@pytest.mark.slow
async def test_bad_options_end_in_one_line_with_exit_2() -> None:
    base = ("node", "--engine", "simulated", "--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0")
    result = await run_cli(*base, "--cache-bytes", "lots")
    assert result.returncode == 2 and "--cache-bytes" in one_line_error(result)
    result = await run_cli(*base, "--http", "0.0.0.0:0")
    assert result.returncode == 2 and "--api-key" in one_line_error(result)
    result = await run_cli(*base, "--http", "nonsense")
    assert result.returncode == 2 and "HOST:PORT" in one_line_error(result)
    result = await run_cli("node", "--model", "/nonexistent", "--http", "none", "--no-mdns")
    assert result.returncode == 2 and "/nonexistent" in one_line_error(result)


@pytest.mark.slow
async def test_an_offline_hub_id_ends_in_one_line() -> None:
    result = await run_cli("node", "--model", "HuggingFaceTB/no-such-model-here", "--http",
                           "none", "--no-mdns", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert "cannot load model 'HuggingFaceTB/no-such-model-here'" in one_line_error(result)
    # It said what it was loading first.
    assert "loading HuggingFaceTB/no-such-model-here" in result.stderr.decode()


@pytest.mark.slow
async def test_a_libp2p_port_in_use_is_an_error_not_shared() -> None:
    async with node(http=None) as first:
        port = first.addresses()[0].split("/tcp/")[1].split("/")[0]
        result = await run_cli("node", "--engine", "simulated", "--no-mdns", "--http", "none",
                               "--listen", f"/ip4/127.0.0.1/tcp/{port}")
        assert result.returncode == 2
        line = one_line_error(result)
        assert "in use" in line and port in line


@pytest.mark.slow
async def test_an_http_port_in_use_is_an_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = await run_cli("node", "--engine", "simulated", "--no-mdns", "--listen",
                               "/ip4/127.0.0.1/tcp/0", "--http", f"127.0.0.1:{port}")
        assert result.returncode == 2
        assert "in use" in one_line_error(result)


@pytest.mark.slow
async def test_the_node_prints_what_it_loads_and_its_http_url() -> None:
    # Started for real, then stopped by the test once it printed its addresses.
    argv = [sys.executable, "-m", "peerinfer", "node", "--engine", "simulated", "--no-mdns",
            "--listen", "/ip4/127.0.0.1/tcp/0", "--http", "127.0.0.1:0", "--cache-bytes", "64M"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    async with trio.open_nursery() as nursery:
        proc = await nursery.start(lambda task_status: trio.run_process(
            argv, stdout=-1, stderr=-1, check=False, env=env, task_status=task_status))
        out = b""
        try:
            with trio.fail_after(CHILD_TIMEOUT_S):
                while b"HTTP API at http://127.0.0.1:" not in out:
                    chunk = await proc.stdout.receive_some(4096)
                    assert chunk, "the node exited early"
                    out += chunk
        finally:
            proc.terminate()
        err = b""
        with trio.fail_after(CHILD_TIMEOUT_S):
            async for chunk in proc.stderr:
                err += chunk
    text = err.decode()
    assert "loading its model with the simulated engine" in text
    assert "loaded simulated on cpu" in text
    assert "prefix cache budget: 64 MiB" in text
    assert b"listening on /ip4/127.0.0.1/tcp/" in out


@pytest.mark.slow
@pytest.mark.parametrize("front", ["http", "peer"])
async def test_chat_keeps_the_conversation(front: str) -> None:
    async with node() as n:
        target = ["--http", n.http_url] if front == "http" else ["--peer", n.addresses()[0]]
        result = await run_cli("chat", *target, "--max-tokens", "4",
                               stdin=b"hello there\n\nwhat did I just say?\n/exit\nnot sent\n")
        assert result.returncode == 0, result.stderr.decode()
        answers = [line for line in result.stdout.decode().splitlines() if line.strip()]
        assert len(answers) == 2
        engine = n.engine
        assert isinstance(engine, RecordingEngine)
        first, second = engine.chats
        assert [m.content for m in first] == ["hello there"]
        # The second turn carried the history: the question, the answer, the new question.
        assert [m.role for m in second] == ["user", "assistant", "user"]
        assert second[1].content.strip() == answers[0].strip()
        assert second[2].content == "what did I just say?"
