"""Hypothesis profiles for the fuzz properties.

``RINGMASTER_FUZZ_EXAMPLES`` picks them: unset or ``ci``, a modest, derandomised count
(reproducible, the whole directory in well under a minute on two cores); ``bench``, 10,000
examples per property (``bench/fuzz.py``); a number, that many. No example database is
kept (nothing is written into the tree). With ``RINGMASTER_FUZZ_REPORT`` set to a path,
each property's examples, outcome and seconds are written there as JSON at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import COUNTS
from hypothesis import HealthCheck, settings

BENCH_EXAMPLES = 10_000
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile(
    "ci", max_examples=40, derandomize=True, deadline=None, database=None,
    suppress_health_check=_QUIET,
)  # fmt: skip
settings.register_profile(
    "bench", max_examples=BENCH_EXAMPLES, deadline=None, database=None,
    suppress_health_check=_QUIET,
)  # fmt: skip

_choice = os.environ.get("RINGMASTER_FUZZ_EXAMPLES", "ci").strip() or "ci"
if _choice.isdigit():
    settings.register_profile(
        "custom", max_examples=int(_choice), deadline=None, database=None,
        suppress_health_check=_QUIET,
    )  # fmt: skip
    _choice = "custom"
settings.load_profile(_choice)

_results: dict[str, dict[str, object]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[Any]:
    name = getattr(item, "originalname", item.name)
    before = COUNTS.get(name, 0)
    outcome: Any = yield
    entry = _results.setdefault(item.nodeid, {})
    entry["examples"] = COUNTS.get(name, 0) - before
    entry["failed"] = outcome.excinfo is not None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        entry = _results.setdefault(report.nodeid, {})
        entry["seconds"] = round(report.duration, 2)
        entry["failed"] = bool(entry.get("failed")) or report.failed


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get("RINGMASTER_FUZZ_REPORT")
    if not target:
        return
    Path(target).write_text(json.dumps(_results, indent=1))
