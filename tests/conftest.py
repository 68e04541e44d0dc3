"""Shared pytest hooks: a fixture can ask whether the test it serves failed (``body_failed``),
e.g. to print the logs of the processes it ran, which its teardown then removes."""

from __future__ import annotations

from collections.abc import Generator

import pytest

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
