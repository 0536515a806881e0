"""A simulated node's GPUs: the stub NVML library's state, busy with training, and the GPU
faults of ``coordinatorctl inject`` (``gpu-temp``, ``pcie-bw``, ``link``).

The agent reads these GPUs through the real pynvml and the stub ``libnvidia-ml.so.1`` in
``<node>/nvml/``; this class only rewrites ``nvml-state.txt`` next to it. Values drift a
little every second so that telemetry looks alive; faults pin them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from nodeagent.sim import nvml_stub
from nodeagent.sim.nvml_state import GIB, LEVELS, hgx
from proto.faults import GpuTempFault, LinkFault, PcieBwFault

BUSY_TEMP_C = 58.0
BUSY_UTIL_PCT = 95
BUSY_PCIE_GBPS = 24.0  # both directions: input pipeline plus GPUDirect traffic
HW_THERMAL_SLOWDOWN = 0x40
REFRESH_S = 1.0
F = TypeVar("F", GpuTempFault, PcieBwFault)


@dataclass
class _Faults:
    temp: dict[int | None, GpuTempFault] = field(default_factory=dict)  # None: every GPU
    pcie: dict[int | None, PcieBwFault] = field(default_factory=dict)
    links: dict[tuple[int, int], LinkFault] = field(default_factory=dict)


class SimulatedGpus:
    """``count`` GPUs behind ``directory/libnvidia-ml.so.1``. Without a C compiler there is
    no library: ``error`` says why, the agent's GPU collectors report NVML unavailable, and
    GPU faults are refused."""

    def __init__(self, directory: Path, count: int, cache: Path, rng: random.Random) -> None:
        self.dir = directory
        self.count = count
        self.error = ""
        self._rng = rng
        self._since_refresh = REFRESH_S
        self._faults = _Faults()
        self._state = hgx(count, node_id=rng.randrange(1 << 32))
        self._pristine = hgx(count)  # topology before any link fault
        try:
            self.library: Path | None = nvml_stub.install(directory, cache)
        except nvml_stub.StubBuildError as exc:
            self.library, self.error = None, str(exc)
            return
        self._refresh()

    def tick(self, dt: float) -> None:
        self._since_refresh += dt
        if self.library is not None and self._since_refresh >= REFRESH_S:
            self._refresh()

    def _refresh(self) -> None:
        self._since_refresh = 0.0
        rng = self._rng
        for i, gpu in enumerate(self._state.gpus):
            temp = self._pick(self._faults.temp, i)
            gpu.temp_c = round(temp.temp_c if temp else BUSY_TEMP_C + rng.uniform(-2, 2))
            gpu.reasons = HW_THERMAL_SLOWDOWN if gpu.temp_c >= gpu.slowdown_c else 0
            gpu.util_pct = BUSY_UTIL_PCT + rng.randint(-3, 3)
            gpu.mem_util_pct = 40 + rng.randint(-5, 5)
            gpu.mem_used = 60 * GIB + rng.randrange(GIB)
            pcie = self._pick(self._faults.pcie, i)
            gbps = pcie.gbps if pcie else BUSY_PCIE_GBPS + rng.uniform(-1, 1)
            gpu.tx_kbps = gpu.rx_kbps = round(gbps * 1e6)
        self._state.write(self.dir)

    @staticmethod
    def _pick(faults: dict[int | None, F], index: int) -> F | None:
        return faults.get(index) or faults.get(None)

    def apply(self, fault: GpuTempFault | PcieBwFault | LinkFault) -> None:
        if self.library is None:
            raise ValueError(f"simulated GPUs are unavailable: {self.error}")
        if isinstance(fault, LinkFault):
            self._check(fault.gpu_a)
            self._check(fault.gpu_b)
            self._link(fault)
        else:
            table: dict[int | None, GpuTempFault] | dict[int | None, PcieBwFault]
            table = self._faults.temp if isinstance(fault, GpuTempFault) else self._faults.pcie
            if fault.gpu is None:
                table.clear()
            else:
                self._check(fault.gpu)
            table[fault.gpu] = fault  # type: ignore[assignment]
        self._refresh()

    def _check(self, gpu: int) -> None:
        if gpu >= self.count:
            raise ValueError(f"there is no GPU {gpu} (GPUs 0-{self.count - 1})")

    def _link(self, fault: LinkFault) -> None:
        a, b = sorted((fault.gpu_a, fault.gpu_b))
        state, pristine = self._state, self._pristine
        wired = len(pristine.links_between(a, b))
        wanted = int(fault.link[2:]) if fault.link.startswith("NV") else 0
        if wanted > wired:
            raise ValueError(f"GPU{a}-GPU{b} has {wired} NVLinks, cannot show {fault.link}")
        for x, y in ((a, b), (b, a)):
            for n, link in enumerate(state.links_between(x, y)):
                link.active = n < wanted
        state.set_level(a, b, LEVELS.get(fault.link, pristine.level(a, b)))
        self._faults.links[(a, b)] = fault

    def clear(self) -> None:
        self._faults = _Faults()
        for a, gpu in enumerate(self._state.gpus):
            for link in gpu.links:
                link.active = True
            for b in range(a + 1, self.count):
                self._state.set_level(a, b, self._pristine.level(a, b))
        if self.library is not None:
            self._refresh()

    def faults(self) -> list[str]:
        active = [*self._faults.temp.values(), *self._faults.pcie.values()]
        return [str(f) for f in [*active, *self._faults.links.values()]]
