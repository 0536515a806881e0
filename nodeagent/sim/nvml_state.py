"""The answers the stub NVML library gives, written as its ``nvml-state.txt``.

Tests and the simulator build a :class:`StubState`, change it and :meth:`StubState.write` it;
the stub re-reads the file on its next call. :func:`hgx` builds a plausible node: GPUs on
two PCIe switches per CPU socket, every pair joined by direct NVLinks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# nvmlGpuTopologyLevel_t
INTERNAL, SINGLE, MULTIPLE, HOSTBRIDGE, NODE, SYSTEM = 0, 10, 20, 30, 40, 50
LEVELS = {"PIX": SINGLE, "PXB": MULTIPLE, "PHB": HOSTBRIDGE, "NODE": NODE, "SYS": SYSTEM}
# nvmlIntNvLinkDeviceType_t
REMOTE_GPU, REMOTE_SWITCH = 0, 2
# nvmlReturn_t values tests inject
DRIVER_NOT_LOADED, NOT_SUPPORTED = 9, 3
GIB = 1 << 30


@dataclass
class StubLink:
    remote_bus: str
    active: bool = True
    remote_type: int = REMOTE_GPU


@dataclass
class StubGpu:
    bus_id: str
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    temp_c: int = 40
    slowdown_c: int = 90
    shutdown_c: int = 95
    reasons: int = 0
    tx_kbps: int = 0
    rx_kbps: int = 0
    replay: int = 0
    util_pct: int = 0
    mem_util_pct: int = 0
    mem_total: int = 80 * GIB
    mem_used: int = 0
    lost: bool = False
    links: list[StubLink] = field(default_factory=list)
    fails: dict[str, int] = field(default_factory=dict)  # NVML function → return code


@dataclass
class StubState:
    gpus: list[StubGpu] = field(default_factory=list)
    topo: dict[tuple[int, int], int] = field(default_factory=dict)  # (a, b), a < b
    xids: list[tuple[int, int]] = field(default_factory=list)  # (gpu, xid), in order
    init_error: int = 0
    driver: str = "550.54.15"

    def level(self, a: int, b: int) -> int:
        return self.topo[(min(a, b), max(a, b))]

    def set_level(self, a: int, b: int, level: int) -> None:
        self.topo[(min(a, b), max(a, b))] = level

    def links_between(self, a: int, b: int) -> list[StubLink]:
        """GPU a's direct links to GPU b."""
        return [link for link in self.gpus[a].links if link.remote_bus == self.gpus[b].bus_id]

    def render(self) -> str:
        lines = ["# nvml-state.txt: answers of the stub libnvidia-ml.so.1 (nvml_stub.c)"]
        lines += [f"init_error {self.init_error}", f"driver {self.driver}"]
        for i, g in enumerate(self.gpus):
            for key, value in (
                ("name", g.name),
                ("uuid", g.uuid),
                ("bus", g.bus_id),
                ("temp", g.temp_c),
                ("slowdown", g.slowdown_c),
                ("shutdown", g.shutdown_c),
                ("reasons", hex(g.reasons)),
                ("tx_kbps", g.tx_kbps),
                ("rx_kbps", g.rx_kbps),
                ("replay", g.replay),
                ("util", g.util_pct),
                ("mem_util", g.mem_util_pct),
                ("mem_total", g.mem_total),
                ("mem_used", g.mem_used),
                ("lost", int(g.lost)),
            ):
                lines.append(f"gpu {i} {key} {value}")
            lines += [f"gpu {i} fail {fn} {code}" for fn, code in sorted(g.fails.items())]
            lines += [
                f"link {i} {n} {int(link.active)} {link.remote_type} {link.remote_bus}"
                for n, link in enumerate(g.links)
            ]
        lines += [f"topo {a} {b} {level}" for (a, b), level in sorted(self.topo.items())]
        lines += [f"xid {seq} {gpu} {xid}" for seq, (gpu, xid) in enumerate(self.xids, 1)]
        return "\n".join(lines) + "\n"

    def write(self, directory: Path) -> None:
        """Replace ``directory/nvml-state.txt`` atomically (the stub may be reading it)."""
        target = directory / "nvml-state.txt"
        partial = directory / f".nvml-state.{os.getpid()}.tmp"
        partial.write_text(self.render(), encoding="ascii")
        partial.replace(target)


def hgx(gpus: int = 8, *, node_id: int = 0) -> StubState:
    """``gpus`` GPUs, idle and cool. Pairs under one PCIe switch are PIX, one socket's two
    switches NODE, across sockets SYS, as on an HGX board; every pair also has direct
    NVLinks (as many as fit in 18 links per GPU, at most 2), so ``nvidia-smi topo -m``
    would show NV# everywhere."""
    state = StubState()
    for i in range(gpus):
        bus = f"00000000:{0x18 + 0x10 * i:02X}:00.0"
        uuid = f"GPU-{node_id:08x}-{i:04x}-4000-8000-{0xAB0000000000 + i:012x}"
        state.gpus.append(StubGpu(bus_id=bus, uuid=uuid))
    per_pair = min(2, 18 // max(1, gpus - 1))
    half = max(1, gpus // 2)
    for a in range(gpus):
        for b in range(a + 1, gpus):
            if a // 2 == b // 2:
                level = SINGLE
            elif a // half == b // half:
                level = NODE
            else:
                level = SYSTEM
            state.set_level(a, b, level)
    for a in range(gpus):
        for b in range(gpus):
            if a != b:
                state.gpus[a].links += [StubLink(state.gpus[b].bus_id) for _ in range(per_pair)]
    return state
