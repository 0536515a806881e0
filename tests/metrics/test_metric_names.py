"""promtool's lint rules, and Prometheus' naming conventions, over every family both
daemons export (from state where every family has samples)."""

from __future__ import annotations

import re

import pytest
from metric_states import agent_registry, coordinator
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
# What promtool calls abbreviated or non-base units.
NOT_BASE = {
    "ms", "us", "ns", "msec", "usec", "millis", "milliseconds", "microseconds",
    "nanoseconds", "minutes", "hours", "days", "percent", "pct", "kb", "mb", "gb", "kib",
    "mib", "gib", "kilobytes", "megabytes", "gigabytes", "gbps", "mbps", "bps", "fahrenheit",
    "sec", "secs", "temp", "util",
}  # fmt: skip
# Labels Prometheus sets on every target: exported ones are renamed ``exported_*``.
TARGET_LABELS = {"job", "instance"}


def exported() -> list[Metric]:
    registries: list[CollectorRegistry] = [agent_registry(), coordinator()[0]]
    return [family for registry in registries for family in registry.collect()]


def problems(family: Metric) -> list[str]:
    """What promtool's ``check metrics`` (and our conventions) would say about ``family``."""
    name, kind = family.name, family.type
    exposed = name + "_total" if kind == "counter" else name
    found = []
    if not SNAKE.match(name):
        found.append("not snake_case")
    if not name.startswith("ringmaster_"):
        found.append("missing the ringmaster_ prefix")
    if kind != "counter" and name.endswith("_total"):
        found.append("_total on a non-counter")
    if kind not in ("histogram", "summary") and name.endswith(("_count", "_sum", "_bucket")):
        found.append("a histogram suffix on a non-histogram")
    words = set(name.split("_"))
    if bad := words & NOT_BASE:
        found.append(f"non-base or abbreviated unit {sorted(bad)}")
    bare = exposed.removesuffix("_total")
    for unit in ("seconds", "bytes", "celsius", "ratio"):
        if unit in words and not bare.endswith(("_" + unit, f"_{unit}_per_second")):
            found.append(f"unit {unit} not at the end")
    if "second" in words and not bare.endswith("_per_second"):
        found.append("a rate not spelt _per_second")
    if not family.documentation.strip():
        found.append("no help text")
    for sample in family.samples:
        for label in sample.labels:
            if not SNAKE.match(label) or (label == "le" and kind != "histogram"):
                found.append(f"bad label {label!r}")
            if label in TARGET_LABELS:
                found.append(f"label {label!r} is the scrape target's")
    return found


@pytest.mark.parametrize("family", exported(), ids=lambda f: f.name)
def test_promtool_lint(family: Metric) -> None:
    assert problems(family) == []


def test_the_lint_catches_what_promtool_would() -> None:
    """A lint that finds nothing proves nothing unless it would have found something."""
    assert problems(GaugeMetricFamily("ringmaster_nvme_latency_us", "x")) == [
        "non-base or abbreviated unit ['us']"
    ]
    assert problems(GaugeMetricFamily("ringmaster_requests_total", "x")) == [
        "_total on a non-counter"
    ]
    assert problems(GaugeMetricFamily("ringmaster_step_count", "x")) == [
        "a histogram suffix on a non-histogram"
    ]
    assert problems(GaugeMetricFamily("ringmaster_seconds_latency", "x")) == [
        "unit seconds not at the end"
    ]
    assert problems(GaugeMetricFamily("gpuTemp", "")) == [
        "not snake_case",
        "missing the ringmaster_ prefix",
        "no help text",
    ]
    counter = CounterMetricFamily("ringmaster_restarts", "Restarts.")
    assert problems(counter) == []
    per_job = GaugeMetricFamily("ringmaster_job_step", "Step.", labels=["job"])
    per_job.add_metric(["tiny-1"], 1)
    assert problems(per_job) == ["label 'job' is the scrape target's"]
