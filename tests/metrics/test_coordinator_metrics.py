"""The coordinator's /metrics from known state: leadership everywhere; nodes, jobs, the
goodput ledger and decision latency from the leader alone."""

from __future__ import annotations

from metric_states import coordinator, families, value

from coordinator.election import Role
from proto.job import GOODPUT_BUCKETS, JobState


def test_leadership_and_nodes_by_state() -> None:
    f = families(coordinator()[0])
    assert value(f["ringmaster_coordinator_leader"], coordinator="coordinator-0") == 1
    assert value(f["ringmaster_coordinator_epoch"], coordinator="coordinator-0") == 12
    nodes = {s.labels["state"]: s.value for s in f["ringmaster_nodes"].samples}
    assert nodes == {"ready": 1, "degraded": 1, "draining": 0, "lost": 1}


def test_job_series() -> None:
    f = families(coordinator()[0])
    state = f["ringmaster_job_state"]
    running = {s.labels["state"]: s.value for s in state.samples if s.labels["job"] == "tiny-1"}
    assert set(running) == {s.value for s in JobState}
    assert [s for s, v in running.items() if v == 1] == ["running"]
    assert value(f["ringmaster_job_step"], job="tiny-1") == 120
    assert value(f["ringmaster_job_target_steps"], job="tiny-1") == 200
    assert value(f["ringmaster_job_world_size"], job="tiny-1") == 2
    assert value(f["ringmaster_job_tokens_per_second"], job="tiny-1") == 5120.0
    assert value(f["ringmaster_job_loss"], job="tiny-1") == 3.25
    # a pending job has no throughput or loss yet: absent, not 0
    assert {s.labels["job"] for s in f["ringmaster_job_loss"].samples} == {"tiny-1"}
    restarts = f["ringmaster_job_restarts"]
    assert restarts.type == "counter"
    assert [(s.name, s.value) for s in restarts.samples if s.labels["job"] == "tiny-1"] == [
        ("ringmaster_job_restarts_total", 1)
    ]
    assert value(f["ringmaster_job_pauses"], job="tiny-1") == 2


def test_goodput_ledger_every_bucket() -> None:
    goodput = families(coordinator()[0])["ringmaster_job_goodput_gpu_seconds"]
    assert goodput.type == "counter"
    ledger = {s.labels["bucket"]: s.value for s in goodput.samples if s.labels["job"] == "tiny-1"}
    assert set(ledger) == set(GOODPUT_BUCKETS)
    assert ledger["productive"] == 300.0 and ledger["paused"] == 8.5 and ledger["idle"] == 0


def test_decision_latency_histogram() -> None:
    latency = families(coordinator()[0])["ringmaster_event_decision_seconds"]
    assert latency.type == "histogram"
    count = next(s for s in latency.samples if s.name.endswith("_count"))
    assert count.value == 2
    le_50ms = next(s for s in latency.samples if s.labels.get("le") == "0.05")
    assert le_50ms.value == 1


def test_a_standby_reports_only_itself() -> None:
    """A sum over every coordinator must count each job and node once."""
    registry, election, _, _ = coordinator(Role.FOLLOWER)
    f = families(registry)
    assert value(f["ringmaster_coordinator_leader"], coordinator="coordinator-0") == 0
    assert "ringmaster_job_step" not in f and "ringmaster_nodes" not in f
    election.role = Role.LEADER  # read at scrape time: a takeover shows at the next scrape
    assert "ringmaster_job_step" in families(registry)
