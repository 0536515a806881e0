"""Admission through the whole stack: a node whose GPU pair fell back from NVLink to PCIe
(PHB) and a node whose preflight fails are refused, with the reason in ``tail``; a node
whose kernel tunable is only under its recommendation is admitted, its warning shown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_harness import Ctl, eventually

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_degraded_topology_and_failed_preflight_are_refused(ctl: Ctl, tmp_path: Path) -> None:
    # node-0's kernel allows a small listen backlog: a warning, not a refusal
    backlog = ctl.home / "nodes" / "node-0" / "proc" / "sys" / "net" / "core" / "somaxconn"
    backlog.parent.mkdir(parents=True)
    backlog.write_text("128\n")
    # node-2's /dev/shm is a filesystem without a single block (procfs): a measured
    # shortfall, so its preflight must fail
    shm = ctl.home / "nodes" / "node-2" / "dev" / "shm"
    shm.parent.mkdir(parents=True)
    shm.symlink_to("/proc")
    ctl("up", "--nodes", "3", "--gpus-per-node", "2")
    ctl("inject", "node-1", "link=0-1:PHB")
    view: dict[str, Any] = {}

    def both_refusable() -> bool:
        nonlocal view
        view = {n["id"]: n for n in ctl.status()["nodes"]}
        warned = any("somaxconn 128" in c["reason"] for c in view["node-0"]["conditions"])
        refusable = not view["node-1"]["topology_ok"] and not view["node-2"]["preflight_ok"]
        return warned and refusable

    eventually(both_refusable, 60, lambda: str(view), 0.3)
    assert view["node-0"]["state"] == "ready" and view["node-0"]["preflight_ok"]
    shown = " ".join(c["reason"] for c in view["node-2"]["conditions"])
    assert "shm_size 0.0 GB (want >= 1 GB)" in shown
    job = ctl.start(
        "tiny.toml",
        "job.nodes=1",
        "job.gpus_per_node=2",
        "train.steps=3",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    final = ctl.wait(job, lambda s: s["state"] == "completed", timeout=120)
    assert final["nodes"] == ["node-0"]
    refused = ctl.events("--job", job, "--kind", "node.refused")
    reasons = {e["node"]: e["reason"] for e in refused}
    assert reasons == {"node-1": "GPU topology degraded", "node-2": "preflight failed"}
    degraded = ctl.events("--kind", "topology.degraded")
    assert degraded and degraded[0]["node"] == "node-1" and degraded[0]["found"] == "PHB"
