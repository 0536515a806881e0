"""Admission through the whole stack: a node whose GPU pair fell back from NVLink to PCIe
(PHB) and a node whose preflight fails are refused, with the reason in ``tail``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_harness import Ctl, eventually

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_degraded_topology_and_failed_preflight_are_refused(ctl: Ctl, tmp_path: Path) -> None:
    # node-2's kernel allows a small listen backlog: its preflight must fail
    backlog = ctl.home / "nodes" / "node-2" / "proc" / "sys" / "net" / "core" / "somaxconn"
    backlog.parent.mkdir(parents=True)
    backlog.write_text("128\n")
    ctl("up", "--nodes", "3", "--gpus-per-node", "2")
    ctl("inject", "node-1", "link=0-1:PHB")
    view: dict[str, Any] = {}

    def both_refusable() -> bool:
        nonlocal view
        view = {n["id"]: n for n in ctl.status()["nodes"]}
        return not view["node-1"]["topology_ok"] and not view["node-2"]["preflight_ok"]

    eventually(both_refusable, 60, lambda: str(view), 0.3)
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
