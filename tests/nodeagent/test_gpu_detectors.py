"""GPU detectors on hand-made samples: thermal levels, PCIe, XIDs, topology; no flapping;
each fault one condition, opened and closed once."""

from __future__ import annotations

from typing import Any

from nodeagent.collectors.gpu import GpuHealthSample, GpuIdentity, GpuReading, XidReport
from nodeagent.collectors.gpu_topology import GpuTopologySample
from nodeagent.config import GpuSettings
from nodeagent.detectors.gpu import GpuThermalDetector, GpuXidDetector
from nodeagent.detectors.gpu_topology import GpuTopologyDetector
from nodeagent.detectors.pcie import GpuPcieDetector
from proto.conditions import Condition, ConditionKind, condition_key
from proto.events import EventBase, GpuThermal, GpuXid, PcieDegraded, Topology, TopologyDegraded

IDENTITY = GpuIdentity(name="H100", uuid="GPU-0", bus_id="00:01.0", slowdown_c=90, shutdown_c=95)


def gpu(index: int = 0, **fields: Any) -> GpuReading:
    base = {"temp_c": 50, "clock_reasons": [], "util_pct": 95, "pcie_replay": 0}
    base |= {"pcie_tx_gbps": 20.0, "pcie_rx_gbps": 20.0}
    return GpuReading(index=index, identity=IDENTITY, **(base | fields))


def sample(t: float, *gpus: GpuReading, **fields: Any) -> GpuHealthSample:
    return GpuHealthSample(time=t, gpus=list(gpus), **fields)


def thermal(**settings: Any) -> GpuThermalDetector:
    return GpuThermalDetector("n", GpuSettings(**settings))


def run(detector: Any, temps: list[Any], step: float = 1.0, **fields: Any) -> list[EventBase]:
    events: list[EventBase] = []
    for i, temp in enumerate(temps):
        events += detector.observe(sample(i * step, gpu(temp_c=temp, **fields)))
    return events


def conditions(events: list[Any]) -> list[Condition]:
    return [e.condition for e in events if e.condition is not None]


def levels(events: list[EventBase]) -> list[str]:
    return [e.level for e in events if isinstance(e, GpuThermal)]


def test_thermal_levels_up_and_down_with_hysteresis() -> None:
    detector = thermal(thermal_hold_s=2.0)
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


def test_thermal_is_one_condition_per_gpu_whose_severity_follows_the_level() -> None:
    events = run(thermal(thermal_hold_s=2.0), [60, 86, 93, 95, 84, 84, 84, 70, 70, 70])
    key = condition_key(ConditionKind.GPU_THERMAL, "n", "0")
    assert [(c.key, c.active, c.severity, c.since) for c in conditions(events)] == [
        (key, True, "warning", 1.0),
        (key, True, "critical", 2.0),
        (key, True, "warning", 6.0),
        (key, False, "warning", 9.0),
    ]
    opened, critical, _, closed = conditions(events)
    assert (opened.value, opened.threshold) == (86, 85.0)
    assert (critical.value, critical.threshold, critical.reason) == (
        93,
        92.0,
        "GPU 0 critical: 93 °C",
    )
    assert (closed.value, closed.threshold) == (70, 80.0)


def test_thermal_no_flapping_at_a_threshold() -> None:
    assert levels(run(thermal(), [84, 86] * 30)) == ["warning"]
    assert levels(run(thermal(), [91, 93] * 30)) == ["warning", "critical"]


def test_hardware_slowdown_is_critical_whatever_the_temperature() -> None:
    events = run(thermal(), [70], clock_reasons=["hw_thermal_slowdown"])
    assert levels(events) == ["critical"]
    assert isinstance(events[0], GpuThermal) and "hw_thermal_slowdown" in events[0].message
    software = run(thermal(), [70], clock_reasons=["sw_thermal_slowdown"])
    assert levels(software) == ["warning"]


def test_thermal_confirm_and_unread_temperatures() -> None:
    detector = thermal(thermal_confirm=2)
    assert run(detector, [95, 60, 95, None]) == []
    assert levels(run(detector, [95, 95])) == ["critical"]


def test_thermal_gpus_are_independent() -> None:
    detector = thermal()
    events = detector.observe(sample(0, gpu(0, temp_c=60), gpu(5, temp_c=90)))
    assert [(e.gpu, e.level) for e in events if isinstance(e, GpuThermal)] == [(5, "warning")]


def test_thermal_thresholds_come_from_the_settings() -> None:
    assert levels(run(thermal(warn_c=70.0, critical_c=75.0), [72, 76])) == ["warning", "critical"]
    assert levels(run(thermal(), [72, 76])) == []


def pcie_detector(**settings: Any) -> GpuPcieDetector:
    return GpuPcieDetector("n", GpuSettings(**settings))


def pcie(detector: GpuPcieDetector, readings: list[dict[str, Any]]) -> list[tuple[float, Any]]:
    return [
        (float(i), e) for i, r in enumerate(readings) for e in detector.observe(sample(i, gpu(**r)))
    ]


def test_pcie_floor_while_busy_then_recovery() -> None:
    detector = pcie_detector(pcie_min_gbps=12.0, pcie_confirm=2, pcie_hold_s=2.0)
    slow = {"pcie_tx_gbps": 3.0, "pcie_rx_gbps": 2.5}
    trace = [{}, slow, {}, slow, slow, slow, {"util_pct": 5, **slow}, {}, {}, {}, {}]
    events = pcie(detector, trace)
    assert [(t, e.recovered) for t, e in events] == [(4.0, False), (9.0, True)]
    spike = events[0][1]
    assert isinstance(spike, PcieDegraded) and spike.severity == "warning"
    assert (spike.tx_gbps, spike.rx_gbps, spike.expected_gbps) == (3.0, 2.5, 12.0)
    assert spike.message == "GPU 0 PCIe degraded: TX 3 GB/s, RX 2.5 GB/s, 0 replays"
    assert events[1][1].severity == "info"
    opened, closed = conditions([e for _, e in events])
    assert opened.key == closed.key == condition_key(ConditionKind.PCIE, "n", "0")
    assert (opened.active, opened.value, opened.threshold) == (True, 3.0, 12.0)
    assert (closed.active, closed.since, closed.value) == (False, 9.0, 20.0)


def test_pcie_idle_gpu_is_no_evidence() -> None:
    detector = pcie_detector(pcie_min_gbps=12.0, pcie_confirm=1, pcie_hold_s=0.0)
    idle = {"util_pct": 0, "pcie_tx_gbps": 0.0, "pcie_rx_gbps": 0.0}
    assert pcie(detector, [idle] * 20) == []


def test_pcie_replays_growing_mean_a_bad_link() -> None:
    detector = pcie_detector(pcie_replay_limit=8, pcie_confirm=1, pcie_hold_s=1.0)
    counts = [100, 101, 103, 120, 140, 141, 141, 141, 5, 6]
    events = pcie(detector, [{"pcie_replay": c, "util_pct": 0} for c in counts])
    assert [(t, e.recovered, e.replay_count) for t, e in events] == [
        (3.0, False, 120),
        (6.0, True, 141),
    ]
    assert [(c.value, c.threshold) for c in conditions([e for _, e in events])] == [
        (17, 8),
        (0, 8),
    ]


def test_xids_and_a_lost_gpu_once() -> None:
    detector = GpuXidDetector("n")
    xids = [XidReport(gpu=3, xid=79, time=0), XidReport(gpu=1, xid=13, time=0)]
    first = detector.observe(sample(0, gpu(0), xids=xids))
    assert [(e.gpu, e.xid, e.severity) for e in first if isinstance(e, GpuXid)] == [
        (3, 79, "critical"),
        (1, 13, "warning"),
    ]
    assert first[0].message == "XID 79 on GPU 3: GPU has fallen off the bus"
    assert conditions(first) == [], "an XID is a one-shot event"
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
    return detector.observe(GpuTopologySample(time=t, gpus=labels, matrix=matrix))


def topology(expect_nvlink: Any = "baseline", confirm: int = 1) -> GpuTopologyDetector:
    settings = GpuSettings(expect_nvlink=expect_nvlink, topology_confirm=confirm)
    return GpuTopologyDetector("n", settings)


def full(n: int, cell: str = "NV2", **cells: str) -> list[list[str]]:
    matrix = [["X" if i == j else cell for j in range(n)] for i in range(n)]
    for pair, value in cells.items():
        a, b = int(pair[1]), int(pair[2])
        matrix[a][b] = matrix[b][a] = value
    return matrix


def test_topology_published_on_change_and_pair_degraded_once() -> None:
    detector = topology(confirm=2)
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
    opened, closed = degraded.condition, back[1].condition
    assert opened is not None and closed is not None
    assert opened.key == closed.key == condition_key(ConditionKind.TOPOLOGY, "n", "0-1")
    assert (opened.active, opened.severity, opened.value, opened.threshold) == (
        True,
        "critical",
        0,
        2,
    )
    assert (closed.active, closed.since) == (False, 6)


def test_topology_expectations() -> None:
    boot_degraded = full(3, p12="SYS")
    baseline = topology()
    assert [type(e) for e in topo(baseline, 0, boot_degraded)] == [Topology]
    everything = topology("all")
    events = topo(everything, 0, boot_degraded)
    assert [(e.gpu_a, e.gpu_b, e.expected) for e in events if isinstance(e, TopologyDegraded)] == [
        (1, 2, "NV")
    ]
    nothing = topology("none")
    assert [type(e) for e in topo(nothing, 0, full(3, "SYS"))] == [Topology]


def test_topology_unknown_cells_wait_for_a_baseline() -> None:
    detector = topology()
    partial = full(3, p02="?", p12="?")
    topo(detector, 0, partial)
    topo(detector, 1, full(3))  # the baseline
    events = topo(detector, 2, partial)
    assert [type(e) for e in events] == [Topology], "an unreadable GPU is not a degraded link"
    events = topo(detector, 3, full(3, p02="SYS"))
    assert [(e.gpu_a, e.gpu_b) for e in events if isinstance(e, TopologyDegraded)] == [(0, 2)]
