"""SimulatedNode read by the real collector: baseline, injected latency, read-only, clear."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from nodeagent.collectors.nvme import NvmeLatencyCollector
from nodeagent.collectors.nvme_smart import NvmeSmartCollector
from nodeagent.sim.node import SimulatedNode

TICK = 0.1


class Clock:
    """Drives a node and its collector on simulated time: ticks then one collection."""

    def __init__(self, node: SimulatedNode) -> None:
        self.node = node
        self.collector = NvmeLatencyCollector(node.roots)
        self.t = 0.0
        self.collector.collect(self.t)

    def window(self, seconds: float = 0.5) -> dict[str, dict[str, Any]]:
        for _ in range(round(seconds / TICK)):
            self.node.tick(TICK)
            self.t += TICK
        sample = msgspec.to_builtins(self.collector.collect(self.t))
        assert sample["errors"] == {}
        devices: dict[str, dict[str, Any]] = sample["devices"]
        return devices


@pytest.fixture
def clock(tmp_path: Path) -> Clock:
    return Clock(SimulatedNode(tmp_path / "node-0", "node-0", seed=7))


def latencies(devices: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {dev: d["latency_us"] for dev, d in devices.items()}


def test_tree_layout(tmp_path: Path) -> None:
    SimulatedNode(tmp_path, "node-0", nvme_devices=3)
    assert (tmp_path / "proc").is_dir()
    block = tmp_path / "sys" / "block"
    assert sorted(p.name for p in block.iterdir()) == ["nvme0n1", "nvme1n1", "nvme2n1"]
    assert (block / "nvme2n1").is_symlink()
    assert len((block / "nvme2n1" / "stat").read_text().split()) == 17
    assert (block / "nvme2n1" / "ro").read_text() == "0\n"


def test_baseline_is_about_20_us_at_thousands_of_iops(clock: Clock) -> None:
    for _ in range(10):
        for device in clock.window().values():
            assert device["latency_us"] == pytest.approx(20.0, abs=2.5)
            assert 3000 <= device["iops"] <= 6000
            assert device["readonly"] is False


def test_injected_latency_then_clear(clock: Clock) -> None:
    clock.window()
    clock.node.apply("nvme-latency=500")
    assert clock.node.faults() == ["nvme-latency=500"]
    for latency in latencies(clock.window()).values():
        assert latency == pytest.approx(500.0, abs=2.5)
    clock.node.apply("clear")
    assert clock.node.faults() == []
    for latency in latencies(clock.window()).values():
        assert latency == pytest.approx(20.0, abs=2.5)


def test_latency_on_one_device(clock: Clock) -> None:
    clock.node.apply("nvme-latency=300@nvme1n1")
    got = latencies(clock.window())
    assert got["nvme0n1"] == pytest.approx(20.0, abs=2.5)
    assert got["nvme1n1"] == pytest.approx(300.0, abs=2.5)


def test_all_devices_fault_replaces_per_device_ones(clock: Clock) -> None:
    clock.node.apply("nvme-latency=300@nvme1n1")
    clock.node.apply("nvme-latency=150")
    assert clock.node.faults() == ["nvme-latency=150"]
    clock.node.apply("nvme-latency=400@nvme0n1")
    assert clock.node.faults() == ["nvme-latency=150", "nvme-latency=400@nvme0n1"]
    got = latencies(clock.window())
    assert got["nvme0n1"] == pytest.approx(400.0, abs=2.5)
    assert got["nvme1n1"] == pytest.approx(150.0, abs=2.5)


def test_readonly_on_off(clock: Clock) -> None:
    smart = NvmeSmartCollector(
        clock.node.roots, command=["cat", f"{clock.node.smart_dir}/{{device}}.json"]
    )
    assert smart.collect(0).devices["nvme1n1"].critical_warning == 0
    clock.node.apply("nvme-readonly=on")
    assert clock.node.faults() == ["nvme-readonly=on"]
    assert all(d["readonly"] for d in clock.window().values())
    assert all(d.media_readonly for d in smart.collect(1).devices.values())
    clock.node.apply("nvme-readonly=off")
    assert clock.node.faults() == []
    assert not any(d["readonly"] for d in clock.window().values())
    assert not any(d.warnings for d in smart.collect(2).devices.values())


def test_latency_is_accurate_over_short_windows(clock: Clock) -> None:
    """Integer ms ticks from a nanosecond sum, as the kernel prints them: even a 0.2 s window
    (~800 I/Os, ~16 ms of ticks) reads close to the true mean."""
    for _ in range(20):
        for latency in latencies(clock.window(0.2)).values():
            assert latency == pytest.approx(20.0, abs=3.5)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("nvme-latency=500@nvme7n1", "node-0 has no device nvme7n1 (it has nvme0n1, nvme1n1)"),
        ("gpu-temp=95", "node-0 has no GPUs"),
        ("kill-agent", "fault kill-agent is not the simulator's: coordinatorctl does it"),
        ("spot-notice=30", "node-0 has no metadata service to give notice"),
        ("nvme-readonly=maybe", "expected nvme-readonly=on|off"),
    ],
)
def test_refused_faults_change_nothing(clock: Clock, fault: str, message: str) -> None:
    clock.node.apply("nvme-latency=200")
    with pytest.raises(ValueError, match=re.escape(message)):
        clock.node.apply(fault)
    assert clock.node.faults() == ["nvme-latency=200"]
