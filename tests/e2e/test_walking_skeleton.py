"""The README's scenario, as a user runs it: a local 2-node cluster trains, is disturbed
by an NVMe latency spike, pauses, resumes, completes, ``report`` accounts for its time and
cost, and ``down`` leaves nothing.

The example script runs the scenario and makes its own checks; this test does not take its
word for it: with the cluster kept up, it reads the job's record and event history through
``coordinatorctl``, then brings the cluster down itself and looks for survivors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import ROOT, Ctl, eventually

from coordinator.ctl.home import pids_dir
from proto.job import GOODPUT_BUCKETS
from ringmaster.procs import pid_alive, read_pid


def in_order(kinds: list[str], *expected: str) -> bool:
    """Whether each of ``expected`` occurs in ``kinds``, in that order."""
    rest = iter(kinds)
    return all(kind in rest for kind in expected)


def check_report(ctl: Ctl, job: str, tmp_path: Path) -> None:
    """``report`` of the job that paused through the spike: every goodput bucket, summing
    to the total in hours and in cost, the spike named, and the timeline drawn."""
    page = tmp_path / "out.html"
    out = ctl("report", job, "--price-per-gpu-hour", "2.5", "--html", str(page))
    rows = {
        line.split()[0]: (float(line.split()[1]), float(line.split()[2]))
        for line in out.splitlines()
        if line.split() and line.split()[0] in (*GOODPUT_BUCKETS, "total")
    }
    assert set(rows) == {*GOODPUT_BUCKETS, "total"}, out
    hours, cost = rows.pop("total")
    assert hours > 0 and sum(h for h, _ in rows.values()) == pytest.approx(hours, abs=5e-4)
    # printed to 4 decimals: each figure is within half a unit of the last place
    assert sum(c for _, c in rows.values()) == pytest.approx(cost, abs=5e-4)
    assert cost == pytest.approx(hours * 2.5, abs=2.5e-4)
    assert all(c == pytest.approx(h * 2.5, abs=2.5e-4) for h, c in rows.values())
    assert "nvme.latency:node-1" in out and "estimate" in out.lower()
    svg = page.read_text()
    for kind in ("nvme.latency_spike", "job.paused", "job.resumed"):
        assert f'data-kind="{kind}"' in svg, kind
    assert ctl.run("report", "no-such-job").returncode == 2
    data = json.loads(ctl("report", job, "--json"))
    assert data["faults"] and data["steps"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nvme_spike_pauses_and_resumes_the_job_to_completion(tmp_path: Path) -> None:
    ctl = Ctl(tmp_path / "cluster")
    try:
        script = ROOT / "examples" / "nvme_spike.py"
        done = subprocess.run(
            # the README's demo, shorter: 80 steps (its spike comes at step 40)
            [sys.executable, str(script), "--home", str(ctl.home), "--keep", "--steps", "80"],
            capture_output=True,
            text=True,
            timeout=340,
            check=False,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        daemons = {f.stem: read_pid(f) for f in pids_dir(ctl.home).glob("*.pid")}
        expected = {"nats-server", "simulator", "coordinator-0", "nodeagent-node-0"}
        assert expected <= set(daemons), daemons
        [job] = ctl.status()["jobs"]
        final = ctl.status(job["id"])
        assert final["state"] == "completed", final
        assert final["target_steps"] == 80 and final["step"] == final["target_steps"]
        assert final["pauses"] >= 1 and final["restarts"] == 0
        assert final["world_size"] == 2 and sorted(final["nodes"]) == ["node-0", "node-1"]

        # every rank's exit is reported (the job may be recorded complete just before)
        history: list[dict[str, Any]] = []

        def both_exits() -> list[dict[str, Any]] | None:
            history[:] = ctl.events("--job", job["id"])
            exits = [e for e in history if e["kind"] == "worker.exited"]
            return exits if len(exits) >= 2 else None

        exits = eventually(both_exits, 30, lambda: f"rank exits missing: {history}", 0.5)
        assert sorted(e["rank"] for e in exits) == [0, 1], exits
        assert all(e["exit_code"] == 0 and e["signal"] is None for e in exits), exits
        kinds = [e["kind"] for e in history]
        assert in_order(kinds, "job.started", "job.paused", "job.resumed", "job.completed"), kinds
        assert "job.failed" not in kinds and "job.recovering" not in kinds, kinds
        [completed] = [e for e in history if e["kind"] == "job.completed"]
        assert completed["step"] == final["target_steps"]

        # the operator's own command prints the same history
        assert ctl.tail_via_cli("--job", job["id"])[: len(history)] == history

        nvme = [e for e in ctl.events("--node", "node-1") if e["kind"].startswith("nvme.latency")]
        spiked = {e["device"] for e in nvme if e["kind"] == "nvme.latency_spike"}
        recovered = {e["device"] for e in nvme if e["kind"] == "nvme.latency_recovered"}
        assert spiked and spiked == recovered, nvme
        assert in_order([e["kind"] for e in nvme], "nvme.latency_spike", "nvme.latency_recovered")

        figures = json.loads(
            next(line for line in done.stdout.splitlines() if line.startswith("==> timings "))[12:]
        )
        assert 0 < figures["spike_event_to_paused_s"] < figures["inject_to_paused_s"]
        check_report(ctl, job["id"], tmp_path)
    finally:
        ctl.run("down")
    survivors = [name for name, pid in daemons.items() if pid is not None and pid_alive(pid)]
    assert not survivors, f"still running after down: {survivors}"
    assert not list(pids_dir(ctl.home).glob("*.pid")), "down must remove every PID file"
