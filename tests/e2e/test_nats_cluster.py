"""A 3-server NATS cluster with R3 streams and buckets: kill one server mid-job and the
job still completes (agents, coordinator and CLI reconnect to the survivors)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import Ctl, eventually

from coordinator.ctl.home import agent_run_dirs
from coordinator.embedded_nats import start_nats_cluster
from ringmaster.rundir import live_ranks

pytestmark = pytest.mark.slow


def log_tails(home: Path, lines: int = 30) -> str:
    """The last lines of every process log of the test (the coordinator's, the agents',
    the ranks'), leaving out the coordinator's repeated election attempts."""
    logs = sorted(home.glob("*.log")) + sorted(home.glob("nodes/*/agent/jobs/*/rank-*.log"))
    out = []
    for log in logs:
        text = [t for t in log.read_text(errors="replace").splitlines() if "election" not in t]
        out.append(f"--- {log.relative_to(home)}\n" + "\n".join(text[-lines:]))
    return "\n".join(out)


@pytest.mark.timeout(400)
def test_job_survives_losing_one_of_three_servers(tmp_path: Path) -> None:
    servers = start_nats_cluster(tmp_path / "nats", 3)
    urls = servers[0].cluster_url or ""
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "RINGMASTER_NATS": urls, "RINGMASTER_HOME": str(tmp_path)}

    def spawn(name: str, *args: str) -> None:
        log = (tmp_path / f"{name}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        )

    ctl = Ctl(tmp_path, RINGMASTER_NATS=urls)

    try:
        nodes = tmp_path / "nodes"
        # the simulator and agents reach the cluster through server 2, which survives
        spawn(
            "sim",
            "nodeagent.sim",
            "--root",
            str(nodes),
            "--nodes",
            "node-0,node-1",
            "--nats",
            servers[2].url,
            "--cluster",
            "local",
        )
        eventually(
            lambda: all((nodes / n / ".ready").exists() for n in ("node-0", "node-1")),
            30,
            lambda: "the simulator never got ready",
            0.1,
        )
        spawn("coordinator", "coordinator.cli", "--id", "c0", "--nats", urls, "--replicas", "3")
        for n in ("node-0", "node-1"):
            spawn(
                f"agent-{n}",
                "nodeagent.cli",
                "--config",  # the simulator's settings for this node's agent
                str(nodes / n / "agent.toml"),
                "--node",
                n,
                "--nats",
                urls,
                "--run-dir",
                str(nodes / n / "agent"),
                "--gpus",
                "1",
                "--advertise-addr",
                "127.0.0.1",
                "--metrics-port",  # its fixed default port would clash with another test's
                "0",
            )

        def both_ready() -> bool:
            done = ctl.run("status", "--json")
            if done.returncode != 0:
                return False
            ready = [n for n in json.loads(done.stdout)["nodes"] if n["state"] == "ready"]
            return len(ready) == 2

        eventually(both_ready, 90, lambda: "nodes never became ready", 0.5)
        job = ctl.start("tiny.toml", "train.steps=120", f"checkpoint.dir={tmp_path / 'ckpt'}")
        ctl.wait(job, lambda s: s["step"] >= 20, timeout=120)
        servers[0].kill()
        try:
            final = ctl.wait(job, lambda s: s["state"] == "completed", timeout=240)
        except AssertionError:
            print(log_tails(tmp_path))  # what each process last said, for the report
            raise
        assert final["step"] == 120 and final["restarts"] == 0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for server in servers:
            server.stop()
        for run_dir in agent_run_dirs(tmp_path):
            for rank in live_ranks(run_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rank.pid, 9)
