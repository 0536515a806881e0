"""What alerting decides to say, without sockets or clocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.alerts import AlertPolicy, AlertSettings, TokenBucket, destinations, payload
from coordinator.cli import ENV_WEBHOOK, webhook_url
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import EventBase, GpuThermal, GpuXid, JobCompleted, JobSubmitted, NodeLost
from proto.job import AlertsSection, JobRecord, JobSection, JobSpec, JobState

URL = "http://chat.example/hook"
TO = frozenset({URL})


def thermal(node: str, level: int, temp: float) -> GpuThermal:
    """A GpuThermal as GpuThermalDetector makes it: level 0 closes the condition."""
    severity = (Severity.INFO, Severity.WARNING, Severity.CRITICAL)[level]
    cond = Condition(
        kind=ConditionKind.GPU_THERMAL,
        node=node,
        subject="0",
        active=level > 0,
        severity=severity if level else Severity.WARNING,
        value=temp,
    )
    msg = f"GPU 0 {('normal', 'warning', 'critical')[level]} at {temp:.0f} °C"
    return GpuThermal(severity=severity, node=node, temp_c=temp, message=msg, condition=cond)


def test_a_condition_is_told_once_when_it_opens_and_once_when_it_closes() -> None:
    policy = AlertPolicy(AlertSettings(summary_window_s=1.0))
    assert policy.offer(thermal("node-1", 2, 95), TO, 0.0) == []  # held for the window
    assert policy.offer(thermal("node-1", 2, 96), TO, 0.2) == []  # restated: no news
    assert policy.offer(thermal("node-1", 1, 90), TO, 0.4) == []  # still open
    opened = policy.due(1.0)
    assert [a.text for a in opened] == [
        "[CRITICAL] gpu.thermal:node-1:0 on node-1: GPU 0 critical at 95 °C"
    ]
    policy.offer(thermal("node-1", 0, 40), TO, 30.0)
    closed = policy.due(31.0)
    assert len(closed) == 1 and closed[0].text.startswith(
        "[RESOLVED] gpu.thermal:node-1:0 after 30 s"
    )
    policy.offer(thermal("node-1", 0, 40), TO, 32.0)  # closed again: nothing was open
    assert policy.due(40.0) == []


def test_warnings_and_closures_of_untold_conditions_are_silent() -> None:
    policy = AlertPolicy(AlertSettings(summary_window_s=0.0))
    policy.offer(thermal("node-1", 1, 88), TO, 0.0)
    policy.offer(thermal("node-1", 0, 40), TO, 1.0)
    assert policy.due(2.0) == []


def test_many_nodes_at_once_make_one_summary() -> None:
    policy = AlertPolicy(AlertSettings(summary_window_s=2.0, summary_over=5))
    for i in range(50):
        policy.offer(thermal(f"node-{i:02d}", 2, 95), TO, i * 0.01)
    assert policy.due(1.0) == []
    out = policy.due(2.0)
    assert len(out) == 1
    assert out[0].text.startswith("50 nodes: critical gpu.thermal ×50 — node-00, node-01")
    assert "(+40 more)" in out[0].text


def test_a_few_nodes_are_told_one_by_one() -> None:
    policy = AlertPolicy(AlertSettings(summary_window_s=2.0, summary_over=5))
    for i in range(3):
        policy.offer(NodeLost(node=f"node-{i}", severity=Severity.CRITICAL, message="gone"), TO, 0)
    assert [a.text for a in policy.due(2.0)] == [
        f"[CRITICAL] node.lost on node-{i}: gone" for i in range(3)
    ]


def test_job_ends_go_at_once_and_each_event_counts_once() -> None:
    policy = AlertPolicy()
    end = JobCompleted(job="j-1", step=200, message="reached step 200")
    assert [a.text for a in policy.offer(end, TO, 0.0)] == ["[COMPLETED] job j-1: reached step 200"]
    assert policy.offer(end, TO, 0.1) == []  # the same event again (published, then consumed)
    assert policy.offer(JobSubmitted(job="j-2"), TO, 0.2) == []  # info is no news


def test_a_repeated_critical_event_without_condition_is_told_once_per_window() -> None:
    policy = AlertPolicy(AlertSettings(summary_window_s=0.0, repeat_s=60.0))

    def xid(t: float) -> EventBase:
        return GpuXid(node="node-1", severity=Severity.CRITICAL, xid=79, message=f"XID at {t}")

    for t in (0.0, 10.0, 59.0):
        policy.offer(xid(t), TO, t)
    assert len(policy.due(59.0)) == 1
    policy.offer(xid(61.0), TO, 61.0)
    assert len(policy.due(61.0)) == 1


def test_destinations_are_the_coordinators_and_the_jobs_on_that_node() -> None:
    spec = JobSpec(job=JobSection(name="j"), alerts=AlertsSection(webhook_url="http://job/hook"))
    live = JobRecord(id="j-1", name="j", spec=spec, nodes=["node-1"], state=JobState.RUNNING)
    done = JobRecord(id="j-0", name="j", spec=spec, nodes=["node-2"], state=JobState.COMPLETED)
    jobs = [live, done]
    assert destinations(thermal("node-1", 2, 95), jobs, URL) == {URL, "http://job/hook"}
    assert destinations(thermal("node-2", 2, 95), jobs, URL) == {URL}
    assert destinations(JobCompleted(job="j-0"), jobs, "") == {"http://job/hook"}
    assert destinations(thermal("node-3", 2, 95), jobs, "") == frozenset()


def test_a_resolution_goes_where_the_opening_went() -> None:
    policy = AlertPolicy(AlertSettings(summary_window_s=0.0))
    policy.offer(thermal("node-1", 2, 95), frozenset({URL, "http://job/hook"}), 0.0)
    assert len(policy.due(0.0)) == 2
    policy.offer(thermal("node-1", 0, 40), frozenset(), 5.0)  # the job has left the node
    assert {a.url for a in policy.due(5.0)} == {URL, "http://job/hook"}


def test_token_bucket() -> None:
    bucket = TokenBucket(rate=2.0, burst=2, now=0.0)
    assert bucket.take(0.0) == 0.0 and bucket.take(0.0) == 0.0
    assert bucket.take(0.0) == 0.5
    assert bucket.take(0.5) == 0.0


def test_payload_text_reads_alone() -> None:
    body = payload("[CRITICAL] x")
    assert body["text"] == "[CRITICAL] x" and body["blocks"][0]["text"]["text"] == "[CRITICAL] x"


def test_the_coordinators_webhook_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_WEBHOOK, "https://hooks.example/T/x")
    assert webhook_url(None) == "https://hooks.example/T/x"
    secret = tmp_path / "url"
    secret.write_text("http://127.0.0.1:9/hook\n")
    assert webhook_url(secret) == "http://127.0.0.1:9/hook"
    secret.write_text("hooks.example")
    with pytest.raises(ValueError, match="http:// or https://"):
        webhook_url(secret)
    with pytest.raises(ValueError, match="No such file"):
        webhook_url(tmp_path / "missing")
