"""Simulated GPUs read through the real pynvml and the stub library, faults applied."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_stub import GpuNode, NvmlChild

from nodeagent.sim.node import SimulatedNode
from nodeagent.sim.nvml_state import hgx


@pytest.fixture
def sim(tmp_path: Path, nvml_cache: Path) -> Iterator[tuple[SimulatedNode, NvmlChild]]:
    node = SimulatedNode(tmp_path / "node-0", "node-0", gpus=4, seed=3, nvml_cache=nvml_cache)
    assert node.gpus is not None and node.gpus.library is not None
    helper = GpuNode(node.gpus.dir, hgx(4))
    try:
        yield node, helper.child(by_path=True)
    finally:
        helper.close()


def test_busy_gpus_then_temperature_and_pcie_faults(sim: tuple[SimulatedNode, NvmlChild]) -> None:
    node, child = sim
    gpus = child.collect()["gpus"]
    assert len(gpus) == 4
    for gpu in gpus:
        assert 56 <= gpu["temp_c"] <= 60 and 92 <= gpu["util_pct"] <= 98
        assert 23 <= gpu["pcie_tx_gbps"] <= 25 and gpu["clock_reasons"] == []
    node.apply("gpu-temp=95@2")
    node.apply("pcie-bw=3")
    assert node.faults() == ["gpu-temp=95@2", "pcie-bw=3"]
    node.tick(1.0)  # faults stay pinned while the rest drifts
    gpus = child.collect()["gpus"]
    assert gpus[2]["temp_c"] == 95 and gpus[2]["clock_reasons"] == ["hw_thermal_slowdown"]
    assert gpus[1]["temp_c"] < 61
    assert {g["pcie_tx_gbps"] for g in gpus} == {g["pcie_rx_gbps"] for g in gpus} == {3.0}
    node.apply("gpu-temp=70")
    assert node.faults() == ["gpu-temp=70", "pcie-bw=3"], "an all-GPU fault replaces others"
    node.apply("clear")
    assert node.faults() == []
    assert all(g["temp_c"] < 61 and g["pcie_tx_gbps"] > 20 for g in child.collect()["gpus"])


def test_link_faults(sim: tuple[SimulatedNode, NvmlChild]) -> None:
    node, child = sim
    assert child.collect("gpu_topology")["matrix"][0] == ["X", "NV2", "NV2", "NV2"]
    node.apply("link=1-0:NV1")
    node.apply("link=2-3:SYS")
    matrix = child.collect("gpu_topology")["matrix"]
    assert matrix[0][1] == matrix[1][0] == "NV1"
    assert matrix[2][3] == matrix[3][2] == "SYS"
    assert node.faults() == ["link=1-0:NV1", "link=2-3:SYS"]
    node.apply("link=0-1:PIX")
    assert child.collect("gpu_topology")["matrix"][0][1] == "PIX"
    with pytest.raises(ValueError, match="node-0: GPU0-GPU1 has 2 NVLinks, cannot show NV3"):
        node.apply("link=0-1:NV3")
    with pytest.raises(ValueError, match=r"node-0: there is no GPU 7 \(GPUs 0-3\)"):
        node.apply("gpu-temp=90@7")
    node.apply("clear")
    assert child.collect("gpu_topology")["matrix"][0] == ["X", "NV2", "NV2", "NV2"]


def test_no_compiler_means_no_simulated_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    node = SimulatedNode(tmp_path / "node-0", "node-0", gpus=2, nvml_cache=tmp_path / "cache")
    assert node.gpus is not None and node.gpus.library is None
    assert node.gpus.error == "no C compiler (gcc) to build the NVML stub"
    with pytest.raises(ValueError, match="node-0: simulated GPUs are unavailable: no C compiler"):
        node.apply("gpu-temp=90")
    node.apply("clear")
    node.tick(2.0)
