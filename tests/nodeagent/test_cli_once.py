"""``nodeagent --once --json``: one full sample of every collector, on this machine and on
a simulated node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from nodeagent.sim import agent_config
from nodeagent.sim.metadata import MetadataServer
from nodeagent.sim.node import SimulatedNode

REPO = Path(__file__).resolve().parents[2]
UNIX_2020 = 1_577_836_800.0  # 2020-01-01T00:00:00Z
EVERY = [
    "clock",
    "gpu",
    "gpu_topology",
    "nic",
    "nvme",
    "nvme_smart",
    "nvme_udev",
    "preemption",
    "rdma",
    "tcp",
]


def once(*args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "nodeagent.cli", "--once", "--json", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
        timeout=60,
    )
    out: dict[str, Any] = json.loads(result.stdout)
    return out


def test_this_machine(tmp_path: Path) -> None:
    """No GPU, no NVMe, no cloud here: each says so cleanly; the rest are read. The cloud
    probes go to a closed loopback port: tests send traffic to this machine only."""
    config = tmp_path / "agent.toml"
    closed = "http://127.0.0.1:9"
    config.write_text(
        f'[preemption]\naws_url = "{closed}"\ngcp_url = "{closed}"\nazure_url = "{closed}"\n'
    )
    got = once("--config", str(config), "--run-dir", str(tmp_path))
    assert sorted(got) == sorted([*EVERY, "preflight"])
    assert got["gpu"] == {
        "ok": False,
        "duration_s": got["gpu"]["duration_s"],
        "error": "unavailable: no NVML: NVML Shared Library Not Found",
        "values": None,
    }
    assert got["gpu_topology"]["error"] == got["gpu"]["error"]
    assert got["nvme"]["error"] == "unavailable: no NVMe block devices under /sys/block"
    assert got["preemption"]["error"].startswith("unavailable: no cloud metadata service")
    assert got["clock"]["ok"] and got["clock"]["values"]["adjtimex"]["state"]
    assert got["preflight"]["ok"] and got["preflight"]["values"]["checks"][0]["name"] == "somaxconn"
    assert got["nvme_udev"]["values"]["source"] in ("kernel", "udev")
    assert got["nic"]["ok"] and got["nic"]["values"]["errors"] == {}
    assert got["tcp"]["ok"] and got["tcp"]["values"]["out_segs"] >= 0
    if not Path("/sys/class/infiniband").exists():
        assert got["rdma"]["error"].startswith("unavailable: no RDMA devices")


def test_a_simulated_node(tmp_path: Path, nvml_cache: Path) -> None:
    metadata = MetadataServer(("aws",)).start()
    try:
        node = SimulatedNode(
            tmp_path / "node-1", "node-1", 4, gpus=8, nvml_cache=nvml_cache, metadata=metadata
        )
        node.tick(0.1)
        got = once("--config", str(agent_config.write(node)))
    finally:
        metadata.stop()
    assert sorted(got) == sorted(["preflight", *[c for c in EVERY if c != "nvme_udev"]])
    assert got.pop("rdma")["error"].startswith("unavailable"), "a simulated node has no RDMA"
    assert all(v["ok"] for v in got.values()), {k: v["error"] for k, v in got.items()}
    assert got["nic"]["values"]["interfaces"]["data0"]["operstate"] == "up"
    assert (got["tcp"]["values"]["out_segs"], got["tcp"]["values"]["retrans_segs"]) == (0, 0)
    assert len(got["gpu"]["values"]["gpus"]) == 8
    assert got["gpu_topology"]["values"]["matrix"][0][1] == "NV2"
    assert sorted(got["nvme"]["values"]["devices"]) == [f"nvme{i}n1" for i in range(4)]
    preemption = got["preemption"]["values"]
    assert (preemption["provider"], preemption["notice"]) == ("aws", None)
    # each sample says when it was taken: in wall-clock Unix seconds (not 0, nor a monotonic
    # reading, which counts from boot), the pass's samples within moments of each other
    stamps = [v["values"]["time"] for v in got.values()]
    assert preemption["time"] in stamps and min(stamps) > UNIX_2020
    assert max(stamps) - min(stamps) < 60, stamps
    assert got["preflight"]["values"]["ok"] is True
