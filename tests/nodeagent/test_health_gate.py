"""The health gate's decision from what the agent's ``/metrics`` says (the agent's own
condition family, rendered by prometheus_client), without I/O; the command against the
real agent is in ``test_agent_golden.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from nodeagent.health_gate import REFUSED, check, metrics_url, open_conditions, verdict
from nodeagent.metrics import condition_family
from nodeagent.sampling import ActiveConditions
from proto.conditions import Condition, ConditionKind, Severity
from ringmaster import rundir


class Conditions(Collector):
    def __init__(self, *conditions: Condition) -> None:
        self.active = ActiveConditions()
        for condition in conditions:
            self.active.apply(condition)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield condition_family("n1", self.active)


def exposition(*conditions: Condition) -> str:
    registry = CollectorRegistry()
    registry.register(Conditions(*conditions))
    return generate_latest(registry).decode()


READONLY = Condition(kind=ConditionKind.NVME_READONLY, node="n1", subject="nvme0n1")
STOCK = Condition(kind=ConditionKind.PREFLIGHT, node="n1", severity=Severity.INFO)


def test_a_condition_against_the_node_refuses_it_in_one_line_naming_it() -> None:
    code, line = verdict("n1", open_conditions(exposition(READONLY, STOCK)))
    assert code == REFUSED
    assert line == "ringmaster: n1 must not take work: nvme.readonly nvme0n1 (warning)"


def test_only_advisory_conditions_or_none_let_the_node_take_work() -> None:
    assert verdict("n1", open_conditions(exposition(STOCK))) == (
        0,
        "ringmaster: n1 may take work (1 advisory condition(s) open)",
    )
    assert verdict("n1", open_conditions(exposition())) == (0, "ringmaster: n1 may take work")


def test_an_agent_that_cannot_be_asked_is_a_warning_and_no_refusal(tmp_path: Path) -> None:
    assert metrics_url("0.0.0.0", 0, tmp_path) is None
    assert metrics_url("", -1, tmp_path) is None  # a port chosen at start, not recorded
    assert metrics_url("0.0.0.0", 9402, tmp_path) == "http://127.0.0.1:9402/metrics"
    # as the agent records it once bound: on the address it was given, which the
    # configuration the gate reads may not name
    rundir.metrics_url(tmp_path).write_text("http://198.18.0.11:41234/metrics\n")
    assert metrics_url("0.0.0.0", -1, tmp_path) == "http://198.18.0.11:41234/metrics"
    rundir.metrics_url(tmp_path).write_text("garbage")
    assert metrics_url("0.0.0.0", -1, tmp_path) is None
    assert metrics_url("127.0.0.1", 0, tmp_path) is None  # off stays off
    code, line = check("n1", None)
    assert code == 0 and line.startswith("warning: ringmaster: cannot ask n1's agent")
