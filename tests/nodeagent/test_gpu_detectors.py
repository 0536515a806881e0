"""GPU detectors on hand-made samples: thermal levels, PCIe, XIDs, topology; no flapping."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.collectors.base import Sample
from nodeagent.detectors.gpu import GpuPcieDetector, GpuThermalDetector, GpuXidDetector
from nodeagent.detectors.gpu_topology import GpuTopologyDetector
from nodeagent.detectors.latch import Change, Latch
from proto.events import EventBase, GpuThermal, GpuXid, PcieDegraded, Topology, TopologyDegraded


def gpu(index: int = 0, **fields: Any) -> dict[str, Any]:
    base = {"index": index, "temp_c": 50, "clock_reasons": [], "slowdown_c": 90}
    base |= {"shutdown_c": 95, "util_pct": 95, "pcie_tx_gbps": 20.0, "pcie_rx_gbps": 20.0}
    return base | {"pcie_replay": 0} | fields


def sample(t: float, *gpus: dict[str, Any], **values: Any) -> Sample:
    return Sample(collector="gpu", time=t, values={"gpus": list(gpus), **values})


def run(detector: Any, temps: list[float], step: float = 1.0, **fields: Any) -> list[EventBase]:
    events: list[EventBase] = []
    for i, temp in enumerate(temps):
        events += detector.observe(sample(i * step, gpu(temp_c=temp, **fields)))
    return events


def levels(events: list[EventBase]) -> list[str]:
    return [e.level for e in events if isinstance(e, GpuThermal)]


def test_latch_confirms_and_holds() -> None:
    latch = Latch(confirm=2, hold_s=2.0)
    trace = [(True, 0), (False, 1), (True, 2), (True, 3), (None, 4), (False, 5), (True, 6)]
    trace += [(False, 7), (False, 8), (None, 9), (False, 10)]
    changes = [(t, latch.update(bad, t)) for bad, t in trace]
    assert [(t, c) for t, c in changes if c] == [(3, Change.RAISED), (10, Change.CLEARED)]
    assert latch.held_s == 3.0
    with pytest.raises(ValueError):
        Latch(confirm=0)


def test_thermal_levels_up_and_down_with_hysteresis() -> None:
    detector = GpuThermalDetector("n", hold_s=2.0)
    events = run(detector, [60, 86, 88, 93, 95, 90, 87, 86, 84, 83, 82, 79, 78, 70, 70])
    assert levels(events) == ["warning", "critical", "warning", "normal"]
    _, critical, back, normal = events
    assert isinstance(critical, GpuThermal) and critical.severity == "critical"
    assert (critical.gpu, critical.temp_c, critical.slowdown_c, critical.shutdown_c) == (
        0,
        93,
        90,
        95,
    )
    assert critical.node == "n" and critical.message == "GPU 0 critical: 93 °C"
    assert isinstance(back, GpuThermal) and back.temp_c == 84  # ≤ 92 - 5 from t=6 to 8, > 85 - 5
    assert isinstance(normal, GpuThermal) and normal.severity == "info" and normal.temp_c == 70
    assert normal.message == "GPU 0 back to normal at 70 °C"


def test_thermal_no_flapping_at_a_threshold() -> None:
    assert levels(run(GpuThermalDetector("n"), [84, 86] * 30)) == ["warning"]
    assert levels(run(GpuThermalDetector("n"), [91, 93] * 30)) == ["warning", "critical"]


def test_hardware_slowdown_is_critical_whatever_the_temperature() -> None:
    events = run(GpuThermalDetector("n"), [70], clock_reasons=["hw_thermal_slowdown"])
    assert levels(events) == ["critical"]
    assert isinstance(events[0], GpuThermal) and "hw_thermal_slowdown" in events[0].message
    software = run(GpuThermalDetector("n"), [70], clock_reasons=["sw_thermal_slowdown"])
    assert levels(software) == ["warning"]


def test_thermal_confirm_and_unread_temperatures() -> None:
    detector = GpuThermalDetector("n", confirm=2)
    assert run(detector, [95, 60, 95, None]) == []  # type: ignore[list-item]
    assert levels(run(detector, [95, 95])) == ["critical"]


def test_thermal_gpus_are_independent() -> None:
    detector = GpuThermalDetector("n")
    events = detector.observe(sample(0, gpu(0, temp_c=60), gpu(5, temp_c=90)))
    assert [(e.gpu, e.level) for e in events if isinstance(e, GpuThermal)] == [(5, "warning")]


@pytest.mark.parametrize("kwargs", [{"warn_c": 95.0}, {"confirm": 0}, {"hold_s": -1.0}])
def test_thermal_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GpuThermalDetector("n", **kwargs)


def pcie(detector: GpuPcieDetector, readings: list[dict[str, Any]]) -> list[tuple[float, Any]]:
    return [
        (float(i), e) for i, r in enumerate(readings) for e in detector.observe(sample(i, gpu(**r)))
    ]


def test_pcie_floor_while_busy_then_recovery() -> None:
    detector = GpuPcieDetector("n", min_gbps=12.0, confirm=2, hold_s=2.0)
    slow = {"pcie_tx_gbps": 3.0, "pcie_rx_gbps": 2.5}
    trace = [{}, slow, {}, slow, slow, slow, {"util_pct": 5, **slow}, {}, {}, {}, {}]
    events = pcie(detector, trace)
    assert [(t, e.recovered) for t, e in events] == [(4.0, False), (9.0, True)]
    spike = events[0][1]
    assert isinstance(spike, PcieDegraded) and spike.severity == "warning"
    assert (spike.tx_gbps, spike.rx_gbps, spike.expected_gbps) == (3.0, 2.5, 12.0)
    assert spike.message == "GPU 0 PCIe degraded: TX 3 GB/s, RX 2.5 GB/s, 0 replays"
    assert events[1][1].severity == "info"


def test_pcie_idle_gpu_is_no_evidence() -> None:
    detector = GpuPcieDetector("n", min_gbps=12.0, confirm=1, hold_s=0.0)
    idle = {"util_pct": 0, "pcie_tx_gbps": 0.0, "pcie_rx_gbps": 0.0}
    assert pcie(detector, [idle] * 20) == []


def test_pcie_replays_growing_mean_a_bad_link() -> None:
    detector = GpuPcieDetector("n", replay_limit=8, confirm=1, hold_s=1.0)
    counts = [100, 101, 103, 120, 140, 141, 141, 141, 5, 6]
    events = pcie(detector, [{"pcie_replay": c, "util_pct": 0} for c in counts])
    assert [(t, e.recovered, e.replay_count) for t, e in events] == [
        (3.0, False, 120),
        (6.0, True, 141),
    ]


def test_xids_and_a_lost_gpu_once() -> None:
    detector = GpuXidDetector("n")
    first = detector.observe(
        sample(0, gpu(0), xids=[{"gpu": 3, "xid": 79, "time": 0}, {"gpu": 1, "xid": 13}])
    )
    assert [(e.gpu, e.xid, e.severity) for e in first if isinstance(e, GpuXid)] == [
        (3, 79, "critical"),
        (1, 13, "warning"),
    ]
    assert first[0].message == "XID 79 on GPU 3: GPU has fallen off the bus"
    lost = [detector.observe(sample(t, gpu(0), lost=[2])) for t in (1, 2, 3)]
    assert [[(e.gpu, e.xid) for e in batch if isinstance(e, GpuXid)] for batch in lost] == [
        [(2, 79)],
        [],
        [],
    ]
    detector.observe(sample(4, gpu(0), gpu(2), lost=[]))
    assert len(detector.observe(sample(5, gpu(0), lost=[2]))) == 1, "lost again: reported again"


def topo(detector: GpuTopologyDetector, t: float, matrix: list[list[str]]) -> list[EventBase]:
    labels = [f"GPU{i}" for i in range(len(matrix))]
    values = {"gpus": labels, "matrix": matrix}
    return detector.observe(Sample(collector="gpu_topology", time=t, values=values))


def full(n: int, cell: str = "NV2", **cells: str) -> list[list[str]]:
    matrix = [["X" if i == j else cell for j in range(n)] for i in range(n)]
    for pair, value in cells.items():
        a, b = int(pair[1]), int(pair[2])
        matrix[a][b] = matrix[b][a] = value
    return matrix


def test_topology_published_on_change_and_pair_degraded_once() -> None:
    detector = GpuTopologyDetector("n", confirm=2)
    first = topo(detector, 0, full(4))
    assert [type(e) for e in first] == [Topology]
    assert isinstance(first[0], Topology) and first[0].matrix == full(4)
    assert "GPU0 X    NV2  NV2  NV2" in first[0].message
    assert topo(detector, 1, full(4)) == []
    broken = full(4, p01="PHB")
    assert [type(e) for e in topo(detector, 2, broken)] == [Topology]
    events = topo(detector, 3, broken)
    assert len(events) == 1 and isinstance(events[0], TopologyDegraded)
    degraded = events[0]
    assert (degraded.gpu_a, degraded.gpu_b, degraded.expected, degraded.found) == (
        0,
        1,
        "NV2",
        "PHB",
    )
    assert degraded.severity == "critical" and not degraded.recovered
    assert topo(detector, 4, broken) == []
    fewer = topo(detector, 5, full(4, p01="NV1"))
    assert [type(e) for e in fewer] == [Topology], "NV1 < NV2 is still degraded"
    back = topo(detector, 6, full(4))
    assert [type(e) for e in back] == [Topology, TopologyDegraded]
    assert isinstance(back[1], TopologyDegraded) and back[1].recovered
    assert back[1].severity == "info" and back[1].found == "NV2"


def test_topology_expectations() -> None:
    boot_degraded = full(3, p12="SYS")
    baseline = GpuTopologyDetector("n", confirm=1)
    assert [type(e) for e in topo(baseline, 0, boot_degraded)] == [Topology]
    everything = GpuTopologyDetector("n", expect_nvlink="all", confirm=1)
    events = topo(everything, 0, boot_degraded)
    assert [(e.gpu_a, e.gpu_b, e.expected) for e in events if isinstance(e, TopologyDegraded)] == [
        (1, 2, "NV")
    ]
    nothing = GpuTopologyDetector("n", expect_nvlink="none", confirm=1)
    assert [type(e) for e in topo(nothing, 0, full(3, "SYS"))] == [Topology]
    with pytest.raises(ValueError):
        GpuTopologyDetector("n", expect_nvlink="some")


def test_topology_unknown_cells_wait_for_a_baseline() -> None:
    detector = GpuTopologyDetector("n", confirm=1)
    partial = full(3, p02="?", p12="?")
    topo(detector, 0, partial)
    topo(detector, 1, full(3))  # the baseline
    events = topo(detector, 2, partial)
    assert [type(e) for e in events] == [Topology], "an unreadable GPU is not a degraded link"
    events = topo(detector, 3, full(3, p02="SYS"))
    assert [(e.gpu_a, e.gpu_b) for e in events if isinstance(e, TopologyDegraded)] == [(0, 2)]
