"""Admission through the whole stack: a node whose GPU pair fell back from NVLink to PCIe
(PHB) and a node whose preflight fails are refused, with the reason in ``tail``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_degraded_topology_and_failed_preflight_are_refused(tmp_path: Path) -> None:
    home = tmp_path / "cluster"
    env = {**os.environ, "RINGMASTER_HOME": str(home)}

    def ctl(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "coordinator.ctl.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def nodes() -> dict[str, dict]:
        return {n["id"]: n for n in json.loads(ctl("status", "--json"))["nodes"]}

    # node-2's kernel allows a small listen backlog: its preflight must fail
    backlog = home / "nodes" / "node-2" / "proc" / "sys" / "net" / "core" / "somaxconn"
    backlog.parent.mkdir(parents=True)
    backlog.write_text("128\n")
    ctl("up", "--nodes", "3", "--gpus-per-node", "2")
    try:
        ctl("inject", "node-1", "link=0-1:PHB")
        deadline = time.monotonic() + 60
        while True:
            view = nodes()
            if not view["node-1"]["topology_ok"] and not view["node-2"]["preflight_ok"]:
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.3)
        job = ctl(
            "start",
            str(ROOT / "examples" / "tiny.toml"),
            "--set",
            "job.nodes=1",
            "--set",
            "job.gpus_per_node=2",
            "--set",
            "train.steps=3",
            "--set",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
        ).strip()
        deadline = time.monotonic() + 120
        while json.loads(ctl("status", job, "--json"))["state"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.3)
        assert json.loads(ctl("status", job, "--json"))["nodes"] == ["node-0"]
        refused = [
            json.loads(x)
            for x in ctl(
                "tail", "--no-follow", "--json", "--job", job, "--kind", "node.refused"
            ).splitlines()
        ]
        reasons = {e["node"]: e["reason"] for e in refused}
        assert reasons == {"node-1": "GPU topology degraded", "node-2": "preflight failed"}
        degraded = [
            json.loads(x)
            for x in ctl(
                "tail", "--no-follow", "--json", "--kind", "topology.degraded"
            ).splitlines()
        ]
        assert degraded and degraded[0]["node"] == "node-1" and degraded[0]["found"] == "PHB"
    finally:
        ctl("down")
