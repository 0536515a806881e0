"""GPU health from NVML: temperature and its thresholds, clock-event reasons, PCIe
throughput and replays, utilisation, memory, and the XID critical errors NVML reported.

A metric the device does not support is None. A GPU that fell off the bus (NVML "GPU is
lost") is listed in ``lost``; any other NVML error on a GPU is in ``errors``; the other GPUs
are read either way. No NVML at all raises :class:`CollectorUnavailable` ("no NVML: ...").
"""

from __future__ import annotations

import msgspec
import pynvml

from nodeagent.collectors.base import Sample
from nodeagent.collectors.nvml import Handle, NvmlSession, XidWatcher, optional, text
from ringmaster.clock import SYSTEM, Clock

# nvmlClocksEventReason* bits, named as nvidia-smi -q names them.
CLOCK_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
MB = 1 << 20


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in CLOCK_REASONS.items() if mask & bit]


class GpuIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What does not change while a GPU stays on the bus: read once."""

    name: str
    uuid: str
    bus_id: str
    slowdown_c: float | None  # NVML's thermal thresholds for this board
    shutdown_c: float | None


class GpuReading(msgspec.Struct, kw_only=True):
    """One GPU now. PCIe throughput is in GB/s (NVML counts KB/s over a 20 ms window)."""

    index: int
    identity: GpuIdentity
    temp_c: float | None = None
    clock_reasons: list[str] | None = None  # None: the driver cannot say
    pcie_tx_gbps: float | None = None
    pcie_rx_gbps: float | None = None
    pcie_replay: int | None = None  # the link's replay counter, cumulative
    util_pct: float | None = None
    mem_util_pct: float | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None


class XidReport(msgspec.Struct, kw_only=True):
    gpu: int  # -1: a device NVML did not name
    xid: int
    time: float


class GpuHealthSample(Sample, kw_only=True):
    driver: str = ""
    count: int = 0
    gpus: list[GpuReading] = msgspec.field(default_factory=list)
    lost: list[int] = msgspec.field(default_factory=list)  # fell off the bus
    errors: dict[str, str] = msgspec.field(default_factory=dict)  # GPU index → NVML error
    xids: list[XidReport] = msgspec.field(default_factory=list)  # since the last sample
    xid_watch: str = "ok"  # or why XIDs are not watched


class GpuCollector:
    name = "gpu"

    def __init__(
        self, session: NvmlSession, interval_s: float = 1.0, clock: Clock = SYSTEM
    ) -> None:
        self.interval_s = interval_s
        self._nvml = session
        self._xids = XidWatcher(clock=clock)  # an XID is stamped when the watcher sees it
        self._static: dict[int, GpuIdentity] = {}

    def fileno(self) -> int:
        """Readable when an XID arrived: the sampling loop collects at once."""
        return self._xids.fileno()

    def close(self) -> None:
        self._xids.close()

    def collect(self, now: float) -> GpuHealthSample:
        self._nvml.ensure()
        gpus: list[GpuReading] = []
        lost: list[int] = []
        errors: dict[str, str] = {}
        handles: dict[int, Handle] = {}
        count = self._nvml.count()
        for index in range(count):
            try:
                handles[index] = pynvml.nvmlDeviceGetHandleByIndex(index)
                gpus.append(self._read(index, handles[index]))
            except pynvml.NVMLError as exc:
                self._static.pop(index, None)  # whatever comes back may be another board
                if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                    lost.append(index)
                errors[str(index)] = str(exc)
                handles.pop(index, None)
        if not self._xids.started:
            self._xids.start(handles)
        return GpuHealthSample(
            time=now,
            driver=self._nvml.driver,
            count=count,
            gpus=gpus,
            lost=lost,
            errors=errors,
            xids=[XidReport(gpu=g, xid=x, time=t) for g, x, t in self._xids.drain()],
            xid_watch=self._xids.error or "ok",
        )

    def _identity(self, index: int, h: Handle) -> GpuIdentity:
        if index not in self._static:
            threshold = pynvml.nvmlDeviceGetTemperatureThreshold
            self._static[index] = GpuIdentity(
                name=text(pynvml.nvmlDeviceGetName(h)),
                uuid=text(pynvml.nvmlDeviceGetUUID(h)),
                bus_id=text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                slowdown_c=optional(threshold, h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                shutdown_c=optional(threshold, h, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            )
        return self._static[index]

    def _read(self, index: int, h: Handle) -> GpuReading:
        reasons = optional(pynvml.nvmlDeviceGetCurrentClocksEventReasons, h)
        if reasons is None:  # drivers before 535 only have the old name
            reasons = optional(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)
        tx = optional(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = optional(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        util = optional(pynvml.nvmlDeviceGetUtilizationRates, h)
        memory = optional(pynvml.nvmlDeviceGetMemoryInfo, h)
        return GpuReading(
            index=index,
            identity=self._identity(index, h),
            temp_c=optional(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
            clock_reasons=reason_names(reasons) if reasons is not None else None,
            pcie_tx_gbps=round(tx / 1e6, 3) if tx is not None else None,
            pcie_rx_gbps=round(rx / 1e6, 3) if rx is not None else None,
            pcie_replay=optional(pynvml.nvmlDeviceGetPcieReplayCounter, h),
            util_pct=util.gpu if util is not None else None,
            mem_util_pct=util.memory if util is not None else None,
            mem_used_mb=round(memory.used / MB, 1) if memory is not None else None,
            mem_total_mb=round(memory.total / MB, 1) if memory is not None else None,
        )
