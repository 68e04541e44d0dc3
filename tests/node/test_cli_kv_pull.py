"""``peerinfer node --kv-pull`` and ``--kv-pull-open-swarm`` (issue 24) reach the node's options
and its core's configuration: off by default; on, members of a private swarm are trusted for
pulls, an open swarm only with the explicit opt-in; a bad combination is refused."""

from __future__ import annotations

import dataclasses

import pytest

from peerinfer.cli import build_parser, node_options
from peerinfer.core.kvpull import DEFAULT_VERIFY_RATE
from peerinfer.errors import ConfigError
from peerinfer.node import NodeOptions
from peerinfer.node.options import core_config
from peerinfer.types import PeerId

BASE = ("node", "--engine", "simulated", "--listen", "/ip4/127.0.0.1/tcp/0", "--no-mdns",
        "--http", "none")


def options_of(*flags: str) -> NodeOptions:
    return node_options(build_parser("node").parse_args([*BASE, *flags]))


def config_of(opts: NodeOptions, kv_bytes_per_token: int | None = None):  # type: ignore[no-untyped-def]
    return core_config(opts, PeerId("A"), max_batch_size=1, cache_capacity_bytes=None,
                       kv_bytes_per_token=kv_bytes_per_token)


def test_pulls_are_off_by_default() -> None:
    opts = options_of()
    assert opts.kv_pull is None and not opts.kv_pull_open_swarm
    config = config_of(opts)
    assert config.kv_pull is None and not config.private_swarm


def test_the_flags_reach_the_core_with_the_engine_kv_size() -> None:
    opts = options_of("--kv-pull", "auto", "--kv-pull-open-swarm")
    assert opts.kv_pull == "auto" and opts.kv_pull_open_swarm
    config = config_of(opts, kv_bytes_per_token=23_040)
    assert config.kv_pull is not None
    assert config.kv_pull.mode == "auto" and config.kv_pull.open_swarm
    assert config.kv_pull.kv_bytes_per_token == 23_040
    assert options_of("--kv-pull", "off").kv_pull is None
    assert config_of(options_of("--kv-pull", "always")).kv_pull.mode == "always"


def test_the_verify_rate_is_the_operators_to_raise() -> None:
    assert options_of("--kv-pull", "auto").kv_pull_verify_rate is None
    default = config_of(options_of("--kv-pull", "auto")).kv_pull
    assert default is not None and default.verify_rate == DEFAULT_VERIFY_RATE
    raised = config_of(options_of("--kv-pull", "auto", "--kv-pull-verify-rate", "0.14")).kv_pull
    assert raised is not None and raised.verify_rate == 0.14
    with pytest.raises(ConfigError, match="needs --kv-pull"):
        options_of("--kv-pull-verify-rate", "0.14")
    for bad in ("0", "1.5", "nan", "-0.1"):
        with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
            options_of("--kv-pull", "auto", "--kv-pull-verify-rate", bad)


def test_a_private_swarm_trusts_its_members_for_pulls() -> None:
    opts = dataclasses.replace(options_of("--kv-pull", "auto"), swarm_key=b"k")
    config = config_of(opts)
    assert config.private_swarm and config.kv_pull is not None and not config.kv_pull.open_swarm


def test_bad_combinations_are_refused() -> None:
    with pytest.raises(ConfigError, match="kv-pull-open-swarm"):
        options_of("--kv-pull-open-swarm")
    with pytest.raises(ConfigError, match="kv-pull"):
        NodeOptions(kv_pull="sometimes")
    with pytest.raises(ConfigError, match="cost policy"):
        options_of("--kv-pull", "auto", "--policy", "local")
    with pytest.raises(SystemExit):
        options_of("--kv-pull", "sometimes")
