"""GPU events from ``gpu`` samples: thermal levels and XID errors (PCIe: :mod:`.pcie`).

The coordinator checkpoints and drains a node on a critical thermal event, so each event is
an action: levels rise after ``thermal_confirm`` samples and fall only once the temperature
is ``hysteresis_c`` under the level's threshold for ``thermal_hold_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodeagent.collectors.gpu import GpuHealthSample, GpuReading
from nodeagent.config import GpuSettings
from nodeagent.detectors.latch import Change, ConditionLatch, Latch
from proto.conditions import ConditionKind, Severity
from proto.events import EventBase, GpuThermal, GpuXid

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


@dataclass
class _Levels:
    """Two latches per GPU: ``warn`` holds the GPU's one ``gpu.thermal`` condition, open at
    warning or critical; ``critical`` only decides its severity. Whatever raises the
    critical latch raises the warning one at least as soon, and whatever clears the warning
    one clears the critical one at least as soon, so critical implies warning."""

    warn: ConditionLatch
    critical: Latch

    @property
    def level(self) -> int:
        return 2 if self.critical.raised else 1 if self.warn.open else 0


class GpuThermalDetector:
    """normal → warning (≥ ``warn_c`` or a software thermal slowdown) → critical
    (≥ ``critical_c`` or a hardware thermal slowdown), and back down with hysteresis."""

    def __init__(self, node: str, settings: GpuSettings) -> None:
        self.node = node
        self.settings = settings
        self.thresholds = (0.0, settings.warn_c, settings.critical_c)
        self._gpus: dict[int, _Levels] = {}

    def _state(self, index: int) -> _Levels:
        if index not in self._gpus:
            s = self.settings
            warn = ConditionLatch(
                ConditionKind.GPU_THERMAL,
                self.node,
                str(index),
                severity=Severity.WARNING,
                confirm=s.thermal_confirm,
                hold_s=s.thermal_hold_s,
            )
            self._gpus[index] = _Levels(warn, Latch(s.thermal_confirm, s.thermal_hold_s))
        return self._gpus[index]

    def _raw(self, temp: float, reasons: list[str]) -> int:
        if temp >= self.thresholds[2] or "hw_thermal_slowdown" in reasons:
            return 2
        if temp >= self.thresholds[1] or "sw_thermal_slowdown" in reasons:
            return 1
        return 0

    def _floor(self, level: int) -> float:
        """Under this, a level's hysteresis band no longer holds the temperature."""
        return self.thresholds[level] - self.settings.hysteresis_c

    def observe(self, sample: GpuHealthSample) -> list[EventBase]:
        events: list[EventBase] = []
        for gpu in sample.gpus:
            state = self._state(gpu.index)
            if gpu.temp_c is None:  # an unread temperature is no evidence
                state.warn.update(None, sample.time)
                state.critical.update(None, sample.time)
                continue
            temp, reasons = float(gpu.temp_c), list(gpu.clock_reasons or [])
            raw, before = self._raw(temp, reasons), state.level
            warm = raw >= 1 or (state.warn.open and temp > self._floor(1))
            hot = raw >= 2 or (state.critical.raised and temp > self._floor(2))
            change = state.warn.update(warm, sample.time)
            state.critical.update(hot, sample.time)
            if state.level != before:
                events.append(self._event(gpu, state, change, temp, reasons, sample.time))
        return events

    def _event(
        self,
        gpu: GpuReading,
        state: _Levels,
        change: Change | None,
        temp: float,
        reasons: list[str],
        t: float,
    ) -> GpuThermal:
        """The level changed: the condition opened, closed, or changed severity."""
        level = state.level
        message = _message(gpu.index, temp, reasons, level)
        if change is Change.CLEARED:
            condition = state.warn.record(
                change, t, reason=message, value=temp, threshold=self._floor(1)
            )
        else:  # opened now, or open already at the other level
            condition = state.warn.restate(
                t,
                reason=message,
                value=temp,
                threshold=self.thresholds[level],
                severity=_SEVERITY[level],
            )
        return GpuThermal(
            severity=_SEVERITY[level],
            node=self.node,
            gpu=gpu.index,
            temp_c=temp,
            level=LEVELS[level],
            slowdown_c=gpu.identity.slowdown_c,
            shutdown_c=gpu.identity.shutdown_c,
            reasons=reasons,
            message=message,
            condition=condition,
        )


def _message(index: int, temp: float, reasons: list[str], level: int) -> str:
    if level == 0:
        return f"GPU {index} back to normal at {temp:.0f} °C"
    why = [f"{temp:.0f} °C"] + [r for r in reasons if "thermal" in r]
    return f"GPU {index} {LEVELS[level]}: {', '.join(why)}"


@dataclass
class GpuXidDetector:
    """One ``gpu.xid`` per XID NVML reported, and one (XID 79) when a GPU is lost. One-shot
    events: an XID opens no condition (what it means is the policy's to decide)."""

    node: str
    _lost: set[int] = field(default_factory=set)

    def observe(self, sample: GpuHealthSample) -> list[EventBase]:
        events: list[EventBase] = []
        for report in sample.xids:
            meaning = HARDWARE_XIDS.get(report.xid, "application or driver error")
            events.append(
                GpuXid(
                    severity=Severity.CRITICAL if report.xid in HARDWARE_XIDS else Severity.WARNING,
                    node=self.node,
                    gpu=report.gpu,
                    xid=report.xid,
                    message=f"XID {report.xid} on GPU {report.gpu}: {meaning}",
                )
            )
        lost = set(sample.lost)
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
        back = {g.index for g in sample.gpus}
        self._lost = (self._lost | lost) - back
        return events
