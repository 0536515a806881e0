"""GPU events from ``gpu`` samples: thermal levels, PCIe degradation, XID errors.

The coordinator checkpoints and drains a node on a critical thermal event, so each event is
an action: levels rise after ``confirm`` samples and fall only once the temperature is
``hysteresis_c`` under the level's threshold for ``hold_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nodeagent.collectors.base import Sample
from nodeagent.detectors.latch import Change, Latch
from proto.events import EventBase, GpuThermal, GpuXid, PcieDegraded, Severity

LEVELS = ("normal", "warning", "critical")
_SEVERITY = (Severity.INFO, Severity.WARNING, Severity.CRITICAL)

# XIDs that mean the GPU or its links are unusable (NVIDIA's XID catalogue); others (13,
# 31, 43: an application's fault) are warnings.
HARDWARE_XIDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


def _gpus(sample: Sample) -> list[dict[str, Any]]:
    gpus: list[dict[str, Any]] = sample.values.get("gpus", [])
    return gpus


@dataclass
class _Thermal:
    level: int = 0
    rising: int = 0  # consecutive samples above the current level
    cool_since: float | None = None  # first of the consecutive samples cool enough to step down


class GpuThermalDetector:
    """normal → warning (≥ ``warn_c`` or a software thermal slowdown) → critical
    (≥ ``critical_c`` or a hardware thermal slowdown), and back down with hysteresis."""

    collector = "gpu"

    def __init__(
        self,
        node: str,
        *,
        warn_c: float = 85.0,
        critical_c: float = 92.0,
        hysteresis_c: float = 5.0,
        hold_s: float = 10.0,
        confirm: int = 1,
    ) -> None:
        if not warn_c <= critical_c or hysteresis_c < 0 or hold_s < 0 or confirm < 1:
            raise ValueError("need warn_c <= critical_c, hysteresis_c, hold_s >= 0, confirm >= 1")
        self.node = node
        self.thresholds = (0.0, warn_c, critical_c)
        self.hysteresis_c = hysteresis_c
        self.hold_s = hold_s
        self.confirm = confirm
        self._state: dict[int, _Thermal] = {}

    def _raw(self, temp: float, reasons: list[str]) -> int:
        if temp >= self.thresholds[2] or "hw_thermal_slowdown" in reasons:
            return 2
        if temp >= self.thresholds[1] or "sw_thermal_slowdown" in reasons:
            return 1
        return 0

    def observe(self, sample: Sample) -> list[EventBase]:
        events: list[EventBase] = []
        for gpu in _gpus(sample):
            if gpu.get("temp_c") is None:
                continue
            temp, reasons = float(gpu["temp_c"]), list(gpu.get("clock_reasons") or [])
            state = self._state.setdefault(int(gpu["index"]), _Thermal())
            level = self._step(state, self._raw(temp, reasons), temp, sample.time)
            if level is not None:
                events.append(self._event(gpu, temp, reasons, level))
        return events

    def _step(self, state: _Thermal, raw: int, temp: float, t: float) -> int | None:
        if raw > state.level:
            state.cool_since = None
            state.rising += 1
            if state.rising < self.confirm:
                return None
            state.level, state.rising = raw, 0
            return raw
        state.rising = 0
        cool = raw < state.level and temp <= self._floor(state.level)
        if not cool:
            state.cool_since = None
            return None
        if state.cool_since is None:
            state.cool_since = t
        if t - state.cool_since < self.hold_s:
            return None
        # Step down to the highest level whose hysteresis band still holds the temperature.
        bands = [lv for lv in range(raw + 1, state.level) if temp > self._floor(lv)]
        state.level, state.cool_since = max(bands, default=raw), None
        return state.level

    def _floor(self, level: int) -> float:
        return self.thresholds[level] - self.hysteresis_c

    def _event(
        self, gpu: dict[str, Any], temp: float, reasons: list[str], level: int
    ) -> GpuThermal:
        index = int(gpu["index"])
        if level == 0:
            message = f"GPU {index} back to normal at {temp:.0f} °C"
        else:
            why = [f"{temp:.0f} °C"] + [r for r in reasons if "thermal" in r]
            message = f"GPU {index} {LEVELS[level]}: {', '.join(why)}"
        return GpuThermal(
            severity=_SEVERITY[level],
            node=self.node,
            gpu=index,
            temp_c=temp,
            level=LEVELS[level],
            slowdown_c=gpu.get("slowdown_c"),
            shutdown_c=gpu.get("shutdown_c"),
            reasons=reasons,
            message=message,
        )


class GpuPcieDetector:
    """A GPU's PCIe link is degraded when, while the GPU is busy (utilisation at least
    ``busy_pct``), both directions move less than ``min_gbps`` (0 turns this off: what a
    job moves over PCIe is its own business), or when the link replay counter grows by
    ``replay_limit`` or more between two samples (0 turns this off)."""

    collector = "gpu"

    def __init__(
        self,
        node: str,
        *,
        min_gbps: float = 0.0,
        busy_pct: float = 80.0,
        replay_limit: int = 8,
        confirm: int = 2,
        hold_s: float = 10.0,
    ) -> None:
        self.node = node
        self.min_gbps = min_gbps
        self.busy_pct = busy_pct
        self.replay_limit = replay_limit
        self._confirm, self._hold_s = confirm, hold_s
        self._latches: dict[int, Latch] = {}
        self._replays: dict[int, int] = {}

    def observe(self, sample: Sample) -> list[EventBase]:
        events: list[EventBase] = []
        for gpu in _gpus(sample):
            index = int(gpu["index"])
            latch = self._latches.setdefault(index, Latch(self._confirm, self._hold_s))
            change = latch.update(self._bad(index, gpu), sample.time)
            if change is not None:
                events.append(self._event(gpu, change))
        return events

    def _bad(self, index: int, gpu: dict[str, Any]) -> bool | None:
        floor: bool | None = None
        tx, rx, util = gpu.get("pcie_tx_gbps"), gpu.get("pcie_rx_gbps"), gpu.get("util_pct")
        if self.min_gbps > 0 and tx is not None and rx is not None and util is not None:
            floor = max(tx, rx) < self.min_gbps if util >= self.busy_pct else None
        replays: bool | None = None
        count, last = gpu.get("pcie_replay"), self._replays.get(index)
        if count is not None:
            self._replays[index] = count
            if self.replay_limit > 0 and last is not None and count >= last:
                replays = count - last >= self.replay_limit
        if floor or replays:
            return True
        if floor is None and self.min_gbps > 0:
            return None  # an idle GPU says nothing about its link's bandwidth
        return replays if floor is None else False

    def _event(self, gpu: dict[str, Any], change: Change) -> PcieDegraded:
        index = int(gpu["index"])
        tx, rx = gpu.get("pcie_tx_gbps") or 0.0, gpu.get("pcie_rx_gbps") or 0.0
        recovered = change is Change.CLEARED
        state = "recovered" if recovered else "degraded"
        return PcieDegraded(
            severity=Severity.INFO if recovered else Severity.WARNING,
            node=self.node,
            gpu=index,
            tx_gbps=tx,
            rx_gbps=rx,
            expected_gbps=self.min_gbps,
            replay_count=int(gpu.get("pcie_replay") or 0),
            recovered=recovered,
            message=f"GPU {index} PCIe {state}: TX {tx:g} GB/s, RX {rx:g} GB/s, "
            f"{gpu.get('pcie_replay')} replays",
        )


@dataclass
class GpuXidDetector:
    """One ``gpu.xid`` per XID NVML reported, and one (XID 79) when a GPU is lost."""

    node: str
    collector: str = "gpu"
    _lost: set[int] = field(default_factory=set)

    def observe(self, sample: Sample) -> list[EventBase]:
        events: list[EventBase] = []
        for xid in sample.values.get("xids", []):
            code, gpu = int(xid["xid"]), int(xid["gpu"])
            meaning = HARDWARE_XIDS.get(code, "application or driver error")
            events.append(
                GpuXid(
                    severity=Severity.CRITICAL if code in HARDWARE_XIDS else Severity.WARNING,
                    node=self.node,
                    gpu=gpu,
                    xid=code,
                    message=f"XID {code} on GPU {gpu}: {meaning}",
                )
            )
        lost = set(sample.values.get("lost", []))
        for gpu in sorted(lost - self._lost):
            events.append(
                GpuXid(
                    severity=Severity.CRITICAL,
                    node=self.node,
                    gpu=gpu,
                    xid=79,
                    message=f"GPU {gpu} lost: NVML says the GPU is lost (XID 79)",
                )
            )
        back = {int(g["index"]) for g in _gpus(sample)}
        self._lost = (self._lost | lost) - back
        return events
