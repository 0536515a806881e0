"""``coordinatorctl report``'s computations from a list of events, and its HTML."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from coordinator.ctl.main import main
from coordinator.ctl.report import text
from coordinator.ctl.report_html import html
from coordinator.ctl.report_model import build
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import (
    EventBase,
    GpuThermal,
    JobCheckpointed,
    JobCompleted,
    JobLoop,
    JobPaused,
    JobRecovering,
    JobRestarted,
    JobResumed,
    JobStarted,
    NvmeLatencyRecovered,
    NvmeLatencySpike,
)
from proto.job import GOODPUT_BUCKETS, JobRecord, JobSection, JobSpec, JobState

T0 = 1_700_000_000.0
NVME = "nvme.latency:node-1:nvme0n1"


def at(s: float) -> datetime:
    return datetime.fromtimestamp(T0 + s, UTC)


def record(**goodput: float) -> JobRecord:
    return JobRecord(
        id="j-1",
        name="j",
        spec=JobSpec(job=JobSection(name="j", nodes=2)),
        state=JobState.COMPLETED,
        step=100,
        target_steps=100,
        world_size=2,
        nodes=["node-0", "node-1"],
        started_at=T0,
        first_step_at=T0 + 5,
        goodput=dict.fromkeys(GOODPUT_BUCKETS, 0.0) | goodput,
    )


def nvme(s: float, active: bool) -> EventBase:
    cond = Condition(kind=ConditionKind.NVME_LATENCY, node="node-1", subject="nvme0n1")
    cond.active = active
    kind = NvmeLatencySpike if active else NvmeLatencyRecovered
    return kind(time=at(s), node="node-1", message="nvme0n1 latency", condition=cond)


def test_a_pause_costs_its_time_and_saves_a_restart_and_the_work_since_the_checkpoint() -> None:
    job = record(productive=200.0, startup=10.0, paused=6.0)  # 1 s a step on 2 GPUs
    events = [
        JobStarted(time=at(0), job="j-1", nodes=["node-0", "node-1"]),
        nvme(20, True),
        JobPaused(time=at(21), job="j-1", step=40, reason=NVME),
        nvme(23, False),
        JobResumed(time=at(24), job="j-1", step=40),
        JobCheckpointed(time=at(40), job="j-1", step=50),
        JobCompleted(time=at(100), job="j-1", step=100),
    ]
    steps = [(T0 + 5 + i, i) for i in range(1, 101)]
    r = build(job, events, steps)
    [fault] = r.faults
    assert fault.key == NVME and fault.reaction == "paused 3.0 s"
    assert fault.closed == T0 + 23
    assert fault.cost_gpu_s == pytest.approx(6.0)
    # avoided: recovery (start-up took 5 s) + 40 steps since checkpoint 0, at 1 s, on 2 GPUs
    assert fault.saved_gpu_s == pytest.approx((5 + 40) * 2)
    assert r.pauses == [(T0 + 21, T0 + 24)]
    kinds = [m.kind for m in r.markers]
    assert kinds == [
        "job.started",
        "nvme.latency_spike",
        "job.paused",
        "nvme.latency_recovered",
        "job.resumed",
        "job.checkpointed",
        "job.completed",
    ]
    page = html(r, 2.5)
    for kind in ("nvme.latency_spike", "job.paused", "job.resumed"):
        assert f'data-kind="{kind}"' in page
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org", "")
    out = text(r, 2.5)
    assert "total" in out and "estimate" in out.lower()


def test_a_restart_costs_its_recovery_and_the_work_redone() -> None:
    job = record(productive=200.0, recovery=20.0)
    hot = Condition(
        kind=ConditionKind.GPU_THERMAL, node="node-1", subject="0", severity=Severity.CRITICAL
    )
    events = [
        JobStarted(time=at(0), job="j-1", nodes=["node-0", "node-1"]),
        JobCheckpointed(time=at(55), job="j-1", step=50),
        GpuThermal(time=at(70), node="node-1", severity=Severity.CRITICAL, condition=hot),
        JobRecovering(time=at(70.5), job="j-1", reason="GPU 0 on node-1 critical"),
        JobRestarted(time=at(75), job="j-1", nodes=["node-0", "node-2"], from_step=50),
    ]
    steps = [(T0 + 5 + i, i) for i in range(1, 66)] + [(T0 + 80 + i, 50 + i) for i in range(50)]
    r = build(job, events, sorted(steps))
    [fault] = r.faults
    assert fault.key == "gpu.thermal:node-1:0" and fault.reaction == "restarted"
    # 9.5 s from the restart to its first step, plus 15 steps redone (65 → 50), on 2 GPUs
    assert fault.cost_gpu_s == pytest.approx((9.5 + 15 * 1.0) * 2)


def test_the_work_redone_counts_from_where_the_ranks_said_they_resumed() -> None:
    """The coordinator's forecast (``from_step``) can trail the ranks' newest snapshot;
    the loop's own word after the restart is what the ranks did."""
    job = record(productive=200.0, recovery=20.0)
    events = [
        JobStarted(time=at(0), job="j-1", nodes=["node-0", "node-1"]),
        JobRecovering(time=at(70.5), job="j-1", reason="rank 1 exited with signal 9"),
        JobRestarted(time=at(75), job="j-1", nodes=["node-0", "node-1"], from_step=50),
        JobRecovering(time=at(85), job="j-1", reason="rank 0 exited with signal 9"),
        JobRestarted(time=at(88), job="j-1", nodes=["node-0", "node-1"], from_step=55),
        JobLoop(time=at(90), job="j-1", resumed_from="memory", step=62),
    ]
    steps = [(T0 + 5 + i, i) for i in range(1, 66)] + [(T0 + 91 + i, 63 + i) for i in range(5)]
    r = build(job, events, sorted(steps))
    first, second = r.faults
    # the first attempt's loop never spoke before the next fault: its forecast stands,
    # 20.5 s to the first step after, plus 15 steps redone (65 → 50)
    assert first.cost_gpu_s == pytest.approx((20.5 + 15 * 1.0) * 2)
    # the second's said memory step 62: 6 s, plus 3 steps redone (65 → 62), not 10
    assert second.cost_gpu_s == pytest.approx((6 + 3 * 1.0) * 2)


def test_an_on_demand_checkpoint_saves_the_work_since_the_periodic_one() -> None:
    job = record(productive=200.0)
    spot = Condition(kind=ConditionKind.PREEMPTION, node="node-1", subject="aws")
    events = [
        JobCheckpointed(time=at(50), job="j-1", step=50),
        GpuThermal(time=at(60), node="node-1", condition=spot),  # any event carrying it
        JobCheckpointed(time=at(61), job="j-1", step=62),
    ]
    [fault] = build(job, events, []).faults
    assert fault.reaction == "checkpointed at step 62"
    assert fault.saved_gpu_s == pytest.approx(12 * 1.0 * 2)


def test_without_progress_the_steps_come_from_the_events() -> None:
    events = [
        JobStarted(time=at(0), job="j-1"),
        JobCheckpointed(time=at(50), job="j-1", step=50),
        JobCompleted(time=at(100), job="j-1", step=100),
    ]
    assert build(record(), events, []).steps == [(T0, 0), (T0 + 50, 50), (T0 + 100, 100)]


@pytest.mark.parametrize("price", ["-1", "abc", "nan", "inf"])
def test_price_must_be_a_non_negative_number(
    price: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["report", "j-1", "--price-per-gpu-hour", price])
    assert exit_.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def nvme_on(device: str, s: float, active: bool, node: str = "node-1") -> EventBase:
    cond = Condition(kind=ConditionKind.NVME_LATENCY, node=node, subject=device)
    cond.active = active
    kind = NvmeLatencySpike if active else NvmeLatencyRecovered
    return kind(time=at(s), node=node, message=f"{device} latency", condition=cond)


def test_a_second_device_spiking_during_the_pause_is_covered_by_it() -> None:
    job = record(productive=200.0, startup=10.0, paused=6.0)
    events = [
        JobStarted(time=at(0), job="j-1", nodes=["node-0", "node-1"]),
        nvme_on("nvme0n1", 20, True),
        JobPaused(time=at(21), job="j-1", step=40, reason=NVME),
        nvme_on("nvme1n1", 22, True),  # the pause is already taken
        nvme_on("nvme0n1", 23, False),
        nvme_on("nvme1n1", 23.5, False),
        JobResumed(time=at(24), job="j-1", step=40),
    ]
    first, second = build(job, events, []).faults
    assert first.reaction == "paused 3.0 s" and first.cost_gpu_s == pytest.approx(6.0)
    assert second.key == "nvme.latency:node-1:nvme1n1"
    assert second.reaction == f"covered by the pause for {NVME}"
    assert second.cost_gpu_s == 0.0 and second.saved_gpu_s is None  # counted once


def test_names_and_messages_from_the_cluster_are_escaped_in_the_html() -> None:
    job = record(productive=200.0)
    job.name = "<script>alert('job')</script>"
    evil_node = "<script>alert('node')</script>"
    spike = nvme_on("nvme0n1", 20, True, node=evil_node)
    spike.message = "<script>alert('event')</script>"
    events = [JobStarted(time=at(0), job="j-1"), spike, JobCompleted(time=at(100), job="j-1")]
    page = html(build(job, events, []), None)
    assert "<script" not in page
    assert "&lt;script&gt;alert(&#39;job&#39;)&lt;/script&gt;" in page  # the h1
    assert "nvme.latency:&lt;script&gt;alert(&#39;node&#39;)&lt;/script&gt;:nvme0n1" in page
    assert page.count("&lt;script&gt;alert(&#39;event&#39;)") == 2  # fault table, title
