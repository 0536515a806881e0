"""GPU interconnect topology from NVML, as the ``nvidia-smi topo -m`` matrix.

For each pair of GPUs: ``NV#`` when they share # active NVLinks, else the closest common
PCIe ancestor from ``nvmlDeviceGetTopologyCommonAncestor``: ``PIX`` (one PCIe switch),
``PXB`` (several switches), ``PHB`` (a host bridge), ``NODE`` (one NUMA node), ``SYS``
(across sockets). NVLinks count per pair from each link's state and its remote PCI bus id;
links that end on an NVSwitch join every pair of switch-attached GPUs (HGX boards), as many
as the pair's smaller count of switch links. The matrix is symmetric: a pair counts the
links both ends see as active. A GPU that cannot be read has "?" in its row and column.
"""

from __future__ import annotations

from collections import Counter

import msgspec
import pynvml

from nodeagent.collectors.base import Sample
from nodeagent.collectors.nvml import Handle, NvmlSession, optional, text

LEVEL_NAMES = {
    pynvml.NVML_TOPOLOGY_INTERNAL: "X",
    pynvml.NVML_TOPOLOGY_SINGLE: "PIX",
    pynvml.NVML_TOPOLOGY_MULTIPLE: "PXB",
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
    pynvml.NVML_TOPOLOGY_NODE: "NODE",
    pynvml.NVML_TOPOLOGY_SYSTEM: "SYS",
}
_SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
# The end of a GPU's links: an index past its last link, or no NVLink at all.
_NO_MORE_LINKS = frozenset({pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_SUPPORTED})


class GpuTopologySample(Sample, kw_only=True):
    gpus: list[str] = msgspec.field(default_factory=list)  # "GPU0", ...: the matrix's labels
    bus_ids: list[str] = msgspec.field(default_factory=list)
    matrix: list[list[str]] = msgspec.field(default_factory=list)
    nvlinks: list[int | None] = msgspec.field(default_factory=list)  # active links per GPU
    errors: dict[str, str] = msgspec.field(default_factory=dict)  # GPU or "i-j" → NVML error


class _Links:
    def __init__(self) -> None:
        self.to_bus: Counter[str] = Counter()
        self.to_switch = 0

    @property
    def active(self) -> int:
        return sum(self.to_bus.values()) + self.to_switch


def bus_key(bus_id: str) -> str:
    """NVML prints bus ids with an 8- or 4-digit domain; compare on one form."""
    domain, _, rest = bus_id.strip().upper().partition(":")
    return f"{int(domain or '0', 16):08X}:{rest}"


class GpuTopologyCollector:
    name = "gpu_topology"

    def __init__(self, session: NvmlSession, interval_s: float = 30.0) -> None:
        self.interval_s = interval_s
        self._nvml = session

    def collect(self, now: float) -> GpuTopologySample:
        self._nvml.ensure()
        count = self._nvml.count()
        handles: dict[int, Handle] = {}
        buses: list[str] = ["?"] * count
        links: dict[int, _Links] = {}
        errors: dict[str, str] = {}
        for i in range(count):
            try:
                handles[i] = pynvml.nvmlDeviceGetHandleByIndex(i)
                buses[i] = bus_key(text(pynvml.nvmlDeviceGetPciInfo(handles[i]).busId))
                links[i] = _read_links(handles[i])
            except pynvml.NVMLError as exc:
                errors[str(i)] = str(exc)
                handles.pop(i, None)
        matrix = [["?"] * count for _ in range(count)]
        for i in range(count):
            matrix[i][i] = "X"
            for j in range(i + 1, count):
                if i not in links or j not in links:
                    continue
                try:
                    cell = _cell(handles[i], handles[j], links[i], links[j], buses[i], buses[j])
                except pynvml.NVMLError as exc:
                    errors[f"{i}-{j}"] = str(exc)
                    continue
                matrix[i][j] = matrix[j][i] = cell
        return GpuTopologySample(
            time=now,
            gpus=[f"GPU{i}" for i in range(count)],
            bus_ids=buses,
            matrix=matrix,
            nvlinks=[links[i].active if i in links else None for i in range(count)],
            errors=errors,
        )


def _read_links(handle: Handle) -> _Links:
    found = _Links()
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError as exc:
            if exc.value in _NO_MORE_LINKS:
                break
            raise
        if not active:
            continue
        if optional(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link) == _SWITCH:
            found.to_switch += 1
        else:
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
            found.to_bus[bus_key(text(remote.busId))] += 1
    return found


def _cell(a: Handle, b: Handle, la: _Links, lb: _Links, bus_a: str, bus_b: str) -> str:
    nvlinks = min(la.to_bus[bus_b], lb.to_bus[bus_a]) + min(la.to_switch, lb.to_switch)
    if nvlinks:
        return f"NV{nvlinks}"
    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
    return LEVEL_NAMES.get(level, f"L{level}")


def render(labels: list[str], matrix: list[list[str]]) -> str:
    """The matrix as ``nvidia-smi topo -m`` lays it out, for messages and the CLI."""
    width = max([len(x) for x in labels] + [len(c) for row in matrix for c in row] + [4]) + 1
    lines = [" " * width + "".join(label.ljust(width) for label in labels)]
    lines += [
        label.ljust(width) + "".join(c.ljust(width) for c in row)
        for label, row in zip(labels, matrix, strict=True)
    ]
    return "\n".join(line.rstrip() for line in lines)
