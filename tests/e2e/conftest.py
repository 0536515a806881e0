"""End-to-end fixtures: a CLI bound to a fresh local cluster directory; a failed
scenario's report ends with its cluster's event history, the evidence for what happened."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from cli_harness import Ctl

HISTORY_LINES = 60  # the newest events: a failure's cause is rarely older


@pytest.fixture
def ctl(tmp_path: Path) -> Iterator[Ctl]:
    """A CLI bound to a fresh local cluster directory; whatever it brought up goes down."""
    cli = Ctl(tmp_path / "cluster")
    yield cli
    cli.run("down")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    cli = getattr(item, "funcargs", {}).get("ctl")
    if call.when == "call" and report.failed and isinstance(cli, Ctl):
        done = cli.run("tail", "--no-follow")  # the cluster is still up: teardown is next
        lines = (done.stdout or done.stderr).splitlines()[-HISTORY_LINES:]
        report.sections.append(("cluster events", "\n".join(lines)))
    return report
