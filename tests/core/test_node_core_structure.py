"""The shape of ``peerinfer.core.node``: NodeCore composes sub-machines that never import each
other, and no core module keeps a switch or memo of the simulator's as module state."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import peerinfer.core.node as node_package
from peerinfer.core import digest, merkle
from peerinfer.core.node import NodeCore

PACKAGE = Path(node_package.__file__).resolve().parent
#: what every part may import; ``machine`` (the composer) and ``__init__`` import the parts
SHARED = {"config", "events"}
SUB_MACHINES = {"requests", "choice", "announcing", "members", "trust"}


def _imported_node_modules(path: Path) -> set[str]:
    """The ``peerinfer.core.node.*`` modules ``path`` imports, TYPE_CHECKING blocks included."""
    out: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module:
            names = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
        elif isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        else:
            continue
        for name in names:
            if name.startswith("peerinfer.core.node."):
                out.add(name.split(".")[3])
    return out


def test_the_package_holds_the_composer_and_its_parts() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == SUB_MACHINES | SHARED | {"machine", "__init__"}


@pytest.mark.parametrize("part", sorted(SUB_MACHINES | SHARED))
def test_no_sub_machine_imports_another(part: str) -> None:
    imported = _imported_node_modules(PACKAGE / f"{part}.py")
    # events imports nothing of the package; config is the tuning every part reads
    allowed = set() if part in SHARED else SHARED
    assert imported <= allowed, f"{part} imports {sorted(imported - allowed)}"


def test_the_peer_view_and_the_digest_do_not_reach_up_into_the_node() -> None:
    for module in ("peerview", "digest", "merkle", "merklehash", "antientropy", "index"):
        path = PACKAGE.parent / f"{module}.py"
        assert not _imported_node_modules(path), module


class _Batch:
    """An observer that takes a delta's changes at once, as a replica's index does (the only
    digests whose delta results are shared)."""

    def block_added(self, h: int) -> None: ...

    def block_removed(self, h: int) -> None: ...

    def blocks_changed(self, added: list[int], removed: list[int]) -> None: ...


def test_the_shared_delta_memo_is_an_argument_not_module_state() -> None:
    """A digest shares delta results only through a ``DeltaMemo`` it was given: two cores
    without one share nothing, and the modules hold no switch to turn sharing on."""
    assert not hasattr(digest, "share_applied_deltas")
    assert not any(name.startswith("_SHARED") for name in vars(merkle))
    assert not any(name.startswith("_SHARED") for name in vars(digest))
    memo = digest.DeltaMemo()
    delta = ((1, 2, 3), ())
    given = [merkle.MerkleDigest(_Batch(), lazy=True, memo=memo) for _ in range(2)]
    alone = [merkle.MerkleDigest(_Batch(), lazy=True) for _ in range(2)]
    for d in given + alone:
        d.apply_delta(*delta)
    assert given[0]._flat is given[1]._flat  # one set, through the memo
    assert alone[0]._flat is not alone[1]._flat
    assert set(alone[0]) == set(given[0]) == {1, 2, 3}
    assert len(memo.deltas) == 1


def test_node_core_keeps_its_public_surface() -> None:
    """The names the shells, the simulator and the benchmarks read on a NodeCore."""
    for name in ("handle", "tick", "next_deadline", "statistics", "check_invariants", "index",
                 "local", "reputation", "policy", "load", "peers", "route", "silence", "phase",
                 "pending_requests", "is_member", "take_refusals", "answer_sync", "shares"):
        assert hasattr(NodeCore, name), name


def test_a_restored_reputation_is_the_one_routing_reads() -> None:
    """The shell replaces ``core.reputation`` with the one it saved (peerinfer.node.trust): trust
    records into it and choice excludes by it, not the one the core started with."""
    import random

    from peerinfer.core.node import NodeConfig
    from peerinfer.core.prefix import PrefixHasher
    from peerinfer.core.reputation import Reputation
    from peerinfer.types import PeerId

    config = NodeConfig(peer_id=PeerId("A"))
    core = NodeCore(config, PrefixHasher(b"test-model"), rng=random.Random(0))
    restored = Reputation(config.reputation)
    core.reputation = restored
    assert core.reputation is restored
    assert core.trust.reputation is restored and core.choice.reputation is restored


def test_a_new_config_reaches_every_part() -> None:
    """Retuning a running core (a test narrowing ``trusted_peers``) retunes all its parts."""
    import random
    from dataclasses import replace

    from peerinfer.core.node import NodeConfig
    from peerinfer.core.prefix import PrefixHasher
    from peerinfer.types import PeerId

    core = NodeCore(NodeConfig(peer_id=PeerId("A")), PrefixHasher(b"test-model"),
                    rng=random.Random(0))
    narrowed = replace(core.config, trusted_peers=frozenset({PeerId("B")}),
                       lazy_announcements=False)
    core.config = narrowed
    for part in (core.members, core.announcing, core.requests, core.trust, core.choice):
        assert part.config is narrowed, type(part).__name__
    assert core.view.lazy is False
