"""The agent settings of a simulated node, written to ``<node>/agent.toml``.

The agent on a simulated node is the real agent; this file only points its roots and
sources at what the simulator keeps for that node (trees, stub NVML library, SMART logs,
clock skew, metadata service) and, given one, at the warm template the machine's agents
share (``warm_template_socket``), and shortens intervals and hold times so that an injected
fault shows within seconds. Whoever starts the agent passes ``--config <node>/agent.toml``;
command-line flags still override it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nodeagent.sim.node import SimulatedNode
from ringmaster.toml_out import to_toml

FILE = "agent.toml"


def settings(node: SimulatedNode) -> dict[str, Any]:
    tree = node.root
    gpu: dict[str, Any] = {"interval_s": 1.0, "topology_interval_s": 2.0}
    gpu |= {"thermal_hold_s": 3.0, "pcie_min_gbps": 12.0, "pcie_hold_s": 3.0}
    gpu |= {"expect_nvlink": "all"}
    if node.gpus is not None and node.gpus.library is not None:
        gpu["nvml_library"] = str(node.gpus.library)
    preemption: dict[str, Any] = {"provider": "none", "sigterm_notice": "never"}
    if node.metadata is not None:
        preemption |= {"provider": "aws", "aws_url": node.metadata.url, "interval_s": 1.0}
    return {
        "sysfs": str(node.roots.sysfs),
        "procfs": str(node.roots.procfs),
        "dev": str(node.roots.dev),
        "simulated": True,
        "nvme": {
            "udev": False,  # the host's uevents are not this node's
            "smart_command": ["cat", f"{node.smart_dir}/{{device}}.json"],
            "smart_interval_s": 5.0,
        },
        "gpu": gpu,
        "clock": {
            "interval_s": 1.0,
            "adjtimex": False,  # the host kernel's sync state is not this node's
            "chronyc": [],
            "skew_file": str(node.skew_file),
            "step_command": ["rm", "-f", str(node.skew_file)],
            "peer_interval_s": 2.0,
            "hold_s": 2.0,
        },
        "preemption": preemption,
        "network": {"data_interface": "data0"},  # the tree's class/net/data0
        "preflight": {
            "data_dir": str(tree),
            "checkpoint_dir": str(tree / "checkpoints"),
            "shm_min_gb": 1.0,
        },
    }


def write(node: SimulatedNode, overrides: dict[str, Any] | None = None) -> Path:
    """``<node>/agent.toml``; ``overrides`` merge into sections (tests tighten timings)."""
    data = settings(node)
    for key, value in (overrides or {}).items():
        data[key] = data[key] | value if isinstance(value, dict) else value
    path = node.root / FILE
    partial = path.with_suffix(".tmp")
    partial.write_text(to_toml(data))
    partial.replace(path)
    return path
