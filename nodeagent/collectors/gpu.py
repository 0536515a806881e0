"""GPU health from NVML: temperature and its thresholds, clock-event reasons, PCIe
throughput and replays, utilisation, memory, and the XID critical errors NVML reported.

``values``::

    {"driver": str, "count": int,
     "gpus": [{"index", "name", "uuid", "bus_id", "temp_c", "slowdown_c", "shutdown_c",
               "clock_reasons": [str], "pcie_tx_gbps", "pcie_rx_gbps", "pcie_replay",
               "util_pct", "mem_util_pct", "mem_used_mb", "mem_total_mb"}],
     "lost": [int], "errors": {index: str},
     "xids": [{"gpu", "xid", "time"}], "xid_watch": "ok" | why not}

A metric the device does not support is None. A GPU that fell off the bus (NVML "GPU is
lost") is listed in ``lost``; any other NVML error on a GPU is in ``errors``; the other GPUs
are read either way. No NVML at all raises :class:`CollectorUnavailable` ("no NVML: ...").
"""

from __future__ import annotations

from typing import Any

import pynvml

from nodeagent.collectors.base import Sample
from nodeagent.collectors.nvml import Handle, NvmlSession, XidWatcher, optional, text

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


class GpuCollector:
    name = "gpu"

    def __init__(self, session: NvmlSession, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._nvml = session
        self._xids = XidWatcher()
        self._static: dict[int, dict[str, Any]] = {}

    def fileno(self) -> int:
        """Readable when an XID arrived: the sampling loop collects at once."""
        return self._xids.fileno()

    def close(self) -> None:
        self._xids.close()

    def collect(self, now: float) -> Sample:
        self._nvml.ensure()
        gpus: list[dict[str, Any]] = []
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
        xids = [{"gpu": g, "xid": x, "time": t} for g, x, t in self._xids.drain()]
        values = {
            "driver": self._nvml.driver,
            "count": count,
            "gpus": gpus,
            "lost": lost,
            "errors": errors,
            "xids": xids,
            "xid_watch": self._xids.error or "ok",
        }
        return Sample(collector=self.name, time=now, values=values)

    def _identity(self, index: int, h: Handle) -> dict[str, Any]:
        """What does not change while the GPU stays on the bus, read once."""
        if index not in self._static:
            self._static[index] = {
                "index": index,
                "name": text(pynvml.nvmlDeviceGetName(h)),
                "uuid": text(pynvml.nvmlDeviceGetUUID(h)),
                "bus_id": text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                "slowdown_c": optional(
                    pynvml.nvmlDeviceGetTemperatureThreshold,
                    h,
                    pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
                ),
                "shutdown_c": optional(
                    pynvml.nvmlDeviceGetTemperatureThreshold,
                    h,
                    pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
                ),
            }
        return self._static[index]

    def _read(self, index: int, h: Handle) -> dict[str, Any]:
        reasons = optional(pynvml.nvmlDeviceGetCurrentClocksEventReasons, h)
        if reasons is None:  # drivers before 535 only have the old name
            reasons = optional(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)
        tx = optional(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = optional(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        util = optional(pynvml.nvmlDeviceGetUtilizationRates, h)
        memory = optional(pynvml.nvmlDeviceGetMemoryInfo, h)
        return self._identity(index, h) | {
            "temp_c": optional(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
            "clock_reasons": reason_names(reasons) if reasons is not None else None,
            # NVML counts PCIe throughput in KB/s over a 20 ms window.
            "pcie_tx_gbps": round(tx / 1e6, 3) if tx is not None else None,
            "pcie_rx_gbps": round(rx / 1e6, 3) if rx is not None else None,
            "pcie_replay": optional(pynvml.nvmlDeviceGetPcieReplayCounter, h),
            "util_pct": util.gpu if util is not None else None,
            "mem_util_pct": util.memory if util is not None else None,
            "mem_used_mb": round(memory.used / MB, 1) if memory is not None else None,
            "mem_total_mb": round(memory.total / MB, 1) if memory is not None else None,
        }
