"""The coordinator's /metrics from known state: leadership everywhere; nodes, jobs, the
goodput ledger and decision latency from the leader alone."""

from __future__ import annotations

from typing import Any

import pytest
from metric_states import FakeElection, FakeJobs, FakeNodes, coordinator, families, job, value

from coordinator import cli
from coordinator.election import Role
from coordinator.metrics import RETENTION_S, registry_for
from proto.job import GOODPUT_BUCKETS, JobState
from ringmaster.clock import ManualClock


def test_leadership_and_nodes_by_state() -> None:
    f = families(coordinator()[0])
    assert value(f["ringmaster_coordinator_leader"], coordinator="coordinator-0") == 1
    assert value(f["ringmaster_coordinator_epoch"], coordinator="coordinator-0") == 12
    nodes = {s.labels["state"]: s.value for s in f["ringmaster_nodes"].samples}
    assert nodes == {"ready": 1, "degraded": 1, "draining": 0, "away": 0, "lost": 1}


def test_job_series() -> None:
    f = families(coordinator()[0])
    state = f["ringmaster_job_state"]
    running = {
        s.labels["state"]: s.value for s in state.samples if s.labels["job_name"] == "tiny-1"
    }
    assert set(running) == {s.value for s in JobState}
    assert [s for s, v in running.items() if v == 1] == ["running"]
    assert value(f["ringmaster_job_step"], job_name="tiny-1") == 120
    assert value(f["ringmaster_job_target_steps"], job_name="tiny-1") == 200
    assert value(f["ringmaster_job_world_size"], job_name="tiny-1") == 2
    assert value(f["ringmaster_job_tokens_per_second"], job_name="tiny-1") == 5120.0
    assert value(f["ringmaster_job_loss"], job_name="tiny-1") == 3.25
    # a pending job has no throughput or loss yet: absent, not 0
    assert {s.labels["job_name"] for s in f["ringmaster_job_loss"].samples} == {"tiny-1"}
    restarts = f["ringmaster_job_restarts"]
    assert restarts.type == "counter"
    assert [(s.name, s.value) for s in restarts.samples if s.labels["job_name"] == "tiny-1"] == [
        ("ringmaster_job_restarts_total", 1)
    ]
    assert value(f["ringmaster_job_pauses"], job_name="tiny-1") == 2


def test_goodput_ledger_every_bucket() -> None:
    goodput = families(coordinator()[0])["ringmaster_job_goodput_gpu_seconds"]
    assert goodput.type == "counter"
    ledger = {
        s.labels["bucket"]: s.value for s in goodput.samples if s.labels["job_name"] == "tiny-1"
    }
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


def test_no_label_prometheus_gives_its_targets() -> None:
    """``job`` and ``instance`` are the scrape target's: an exported ``job`` would become
    ``exported_job`` under the default ``honor_labels: false``."""
    exposed = families(coordinator()[0])
    labels = {k for f in exposed.values() for s in f.samples for k in s.labels}
    assert "job_name" in labels
    assert not labels & {"job", "instance", "exported_job"}


def test_an_ended_job_is_dropped_after_the_retention() -> None:
    """A long-lived leader exports the live jobs and the recently ended, not every job it
    ever ran; a live job stays however old it is."""
    clock = ManualClock(wall=100_000.0)
    jobs = FakeJobs(
        {
            "old-1": job("old-1", JobState.RUNNING, started_at=1.0),
            "done-1": job("done-1", JobState.COMPLETED, finished_at=90_000.0),
            "failed-1": job("failed-1", JobState.FAILED, finished_at=99_000.0),
        }
    )
    registry = registry_for("c-0", FakeElection(), FakeNodes(), jobs, 3600.0, clock)

    def shown() -> set[str]:
        f = families(registry)
        per_job = [fam for name, fam in f.items() if name.startswith("ringmaster_job_")]
        found = {s.labels["job_name"] for fam in per_job for s in fam.samples}
        assert found == {s.labels["job_name"] for s in f["ringmaster_job_state"].samples}
        return found

    assert shown() == {"old-1", "failed-1"}
    clock.set_wall(99_000.0 + 3600.0 - 1.0)
    assert shown() == {"old-1", "failed-1"}
    clock.set_wall(99_000.0 + 3600.0)
    assert shown() == {"old-1"}
    jobs.jobs["old-1"] = job("old-1", JobState.STOPPED, finished_at=clock.time())
    assert shown() == {"old-1"}  # shown for the retention after it ended
    assert RETENTION_S == 3600.0  # the documented default


def test_the_retention_is_a_coordinator_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    given: dict[str, Any] = {}

    class Recorded:
        def __init__(self, *args: object, **kwargs: Any) -> None:
            given.update(kwargs)

        async def run(self, stop: object) -> None:
            return None

    monkeypatch.setattr(cli, "Coordinator", Recorded)
    assert cli.main(["--metrics-retention-s", "600"]) == 0
    assert given["metrics_retention_s"] == 600.0
    assert cli.main([]) == 0
    assert given["metrics_retention_s"] == RETENTION_S


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_retention_is_one_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--metrics-retention-s", value]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "--metrics-retention-s" in line
