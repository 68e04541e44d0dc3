"""Shared pytest hooks: a fixture can ask whether the test it serves failed (``body_failed``),
e.g. to print the logs of the processes it ran, which its teardown then removes; and the
Hypothesis profile every property test runs under."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis's timing checks (a per-example deadline, "input generation is slow") measure the
# machine, not the code: on the 2-core CI machine, or a developer's laptop under load, they fail
# a test whose every example passed (seen: tests/core/test_index.py at load 9). Behaviour is what
# the tests check; a test that wants a timing bound sets it itself.
settings.register_profile(
    "peerinfer", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("peerinfer")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where the core runs compiled (peerinfer/native.py), the tests that need it pure are left
    to make test's second pass (``PEERINFER_PURE=1 pytest -m "pure_python or core_logic"``),
    which also runs every test of the core itself on the pure modules."""
    from peerinfer import native

    core_dir = Path(__file__).parent / "core"
    for item in items:
        if core_dir in Path(item.path).parents:
            item.add_marker(pytest.mark.core_logic)
    if native.compiled():
        deselected = [item for item in items if item.get_closest_marker("pure_python")]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not item.get_closest_marker("pure_python")]


_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


def body_failed(request: pytest.FixtureRequest) -> bool:
    """Whether the test body (its "call" phase) of ``request``'s test failed."""
    report = request.node.stash.get(_REPORTS, {}).get("call")
    return report is not None and report.failed
