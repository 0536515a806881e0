"""GPU collectors through the real pynvml, against the stub libnvidia-ml.so.1 in C.

Each test runs the collectors in a child process (pynvml loads its library once per
process) that finds the stub through LD_LIBRARY_PATH, as pynvml finds the driver's library
on a node, or through the nvml_library setting, as simulated nodes do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_stub import GpuNode

from nodeagent.collectors.gpu_topology import render
from nodeagent.sim.nvml_state import (
    DRIVER_NOT_LOADED,
    GIB,
    HOSTBRIDGE,
    NOT_SUPPORTED,
    REMOTE_SWITCH,
    StubLink,
)
from ringmaster.clock import EPOCH
from ringmaster.procs import wait_until


def test_health_of_every_gpu(gpu_node: GpuNode) -> None:
    gpu = gpu_node.state.gpus[3]
    gpu.temp_c, gpu.reasons, gpu.util_pct, gpu.mem_util_pct = 87, 0x20 | 0x4, 97, 61
    gpu.tx_kbps, gpu.rx_kbps, gpu.replay = 12_500_000, 3_000_000, 17
    gpu.mem_used = 60 * GIB
    gpu_node.write()
    values = gpu_node.child().collect()
    assert values["driver"] == "550.54.15"
    assert values["count"] == 8 and [g["index"] for g in values["gpus"]] == list(range(8))
    assert values["lost"] == [] and values["errors"] == {} and values["xids"] == []
    assert values["xid_watch"] == "ok"
    assert values["gpus"][3] == {
        "index": 3,
        "identity": {
            "name": "NVIDIA H100 80GB HBM3",
            "uuid": "GPU-00000000-0003-4000-8000-ab0000000003",
            "bus_id": "00000000:48:00.0",
            "slowdown_c": 90,
            "shutdown_c": 95,
        },
        "temp_c": 87,
        "clock_reasons": ["sw_power_cap", "sw_thermal_slowdown"],
        "pcie_tx_gbps": 12.5,
        "pcie_rx_gbps": 3.0,
        "pcie_replay": 17,
        "util_pct": 97,
        "mem_util_pct": 61,
        "mem_used_mb": 61440.0,
        "mem_total_mb": 81920.0,
    }


def test_found_through_the_nvml_library_setting(gpu_node: GpuNode) -> None:
    assert gpu_node.child(by_path=True).collect()["count"] == 8


def test_no_library_is_unavailable(gpu_node: GpuNode, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    child = gpu_node.child(library_dir=empty)
    for collector in ("gpu", "gpu_topology"):
        answer = child.ask({"collect": collector})
        assert answer == {"ok": False, "error": "no NVML: NVML Shared Library Not Found"}


def test_driver_not_loaded_is_unavailable_until_it_is(gpu_node: GpuNode) -> None:
    gpu_node.state.init_error = DRIVER_NOT_LOADED
    gpu_node.write()
    child = gpu_node.child()
    assert child.ask({"collect": "gpu"}) == {"ok": False, "error": "no NVML: Driver Not Loaded"}
    gpu_node.state.init_error = 0
    gpu_node.write()
    assert child.collect()["count"] == 8, "the next collection initialises NVML again"


def test_a_lost_gpu_is_reported_and_the_others_read(gpu_node: GpuNode) -> None:
    child = gpu_node.child()
    child.collect()
    gpu_node.state.gpus[5].lost = True
    gpu_node.write()
    values = child.collect()
    assert values["lost"] == [5] and values["errors"] == {"5": "GPU is lost"}
    assert [g["index"] for g in values["gpus"]] == [0, 1, 2, 3, 4, 6, 7]
    topology = child.collect("gpu_topology")
    assert topology["matrix"][5] == ["?"] * 5 + ["X", "?", "?"]
    assert topology["matrix"][0][5] == "?" and topology["matrix"][0][6] == "NV2"
    assert topology["errors"] == {"5": "GPU is lost"}


def test_unsupported_metrics_are_none_not_errors(gpu_node: GpuNode) -> None:
    gpu_node.state.gpus[0].fails = {
        "nvmlDeviceGetPcieThroughput": NOT_SUPPORTED,
        "nvmlDeviceGetTemperatureThreshold": NOT_SUPPORTED,
    }
    gpu_node.write()
    values = gpu_node.child().collect()
    first = values["gpus"][0]
    assert values["errors"] == {}
    assert first["pcie_tx_gbps"] is None and first["pcie_rx_gbps"] is None
    assert first["identity"]["slowdown_c"] is None and first["temp_c"] == 40


def test_xid_wakes_the_collector_and_is_reported_once(gpu_node: GpuNode) -> None:
    child = gpu_node.child()
    gpu_node.state.xids.append((1, 13))  # before the event set exists: never delivered
    gpu_node.write()
    child.collect()
    assert child.ask({"wait": 0.3}) == {"readable": False}
    gpu_node.state.xids += [(2, 79), (6, 48)]
    gpu_node.write()
    woken = child.ask({"wait": 60.0})
    assert woken == {"readable": True}, "woken by the XID, not by the wait running out"
    xids: list[dict[str, Any]] = []

    def both() -> bool:  # the second XID follows within the watcher's next 10 ms poll
        xids.extend(child.collect()["xids"])
        return len(xids) >= 2

    wait_until(both, timeout=30)
    assert [(x["gpu"], x["xid"]) for x in xids] == [(2, 79), (6, 48)]
    assert all(x["time"] == EPOCH for x in xids), "stamped with the collector's clock"
    assert child.collect()["xids"] == []


def test_topology_matrix_as_nvidia_smi_shows_it(gpu_node: GpuNode) -> None:
    values = gpu_node.child().collect("gpu_topology")
    assert values["gpus"] == [f"GPU{i}" for i in range(8)]
    assert values["nvlinks"] == [14] * 8
    assert values["bus_ids"][1] == "00000000:28:00.0"
    assert all(values["matrix"][i][i] == "X" for i in range(8))
    assert {c for i, row in enumerate(values["matrix"]) for j, c in enumerate(row) if i != j} == {
        "NV2"
    }
    assert render(values["gpus"][:2], [r[:2] for r in values["matrix"][:2]]) == (
        "     GPU0 GPU1\nGPU0 X    NV2\nGPU1 NV2  X"
    )


def test_pcie_levels_where_no_nvlink(gpu_node: GpuNode) -> None:
    for gpu in gpu_node.state.gpus:
        gpu.links = []
    gpu_node.write()
    matrix = gpu_node.child().collect("gpu_topology")["matrix"]
    assert matrix[0][:4] == ["X", "PIX", "NODE", "NODE"]
    assert matrix[0][4] == matrix[3][7] == "SYS"


def test_a_link_going_down_shows_the_pcie_path(gpu_node: GpuNode) -> None:
    child = gpu_node.child()
    assert child.collect("gpu_topology")["matrix"][0][1] == "NV2"
    gpu_node.state.links_between(0, 1)[0].active = False
    gpu_node.write()
    assert child.collect("gpu_topology")["matrix"][1][0] == "NV1", "counted from both ends"
    for a, b in ((0, 1), (1, 0)):
        for link in gpu_node.state.links_between(a, b):
            link.active = False
    gpu_node.state.set_level(0, 1, HOSTBRIDGE)
    gpu_node.write()
    values = child.collect("gpu_topology")
    assert values["matrix"][0][1] == values["matrix"][1][0] == "PHB"
    assert values["nvlinks"][:3] == [12, 12, 14]


def test_nvswitch_boards(gpu_node: GpuNode) -> None:
    """HGX H100: 18 links per GPU, all to NVSwitches; nvidia-smi shows NV18 for each pair."""
    for gpu in gpu_node.state.gpus:
        gpu.links = [StubLink("00000000:C0:00.0", remote_type=REMOTE_SWITCH) for _ in range(18)]
    gpu_node.state.gpus[2].links[0].active = False
    gpu_node.write()
    matrix = gpu_node.child().collect("gpu_topology")["matrix"]
    assert matrix[0][1] == "NV18" and matrix[0][2] == matrix[2][7] == "NV17"
