"""Network links from ``<sysfs>/class/net/<if>/``: carrier, operstate and the counters that
show a link going bad before a collective times out.

``carrier_changes`` counts every carrier transition since the interface appeared, so a flap
shows as that counter rising even between two samples that both see the link up; the
``statistics/`` counters do the same for errors and drops. Reading ``carrier`` on an
interface that is administratively down fails with EINVAL: that is the kernel saying "no
carrier", read as 0. ``lo`` is skipped (it has no link).

One bad interface never hides the others: a file that is missing or holds what the kernel
never writes there becomes a one-line entry in ``errors``. Only the absence of
``class/net`` itself raises (:class:`CollectorUnavailable`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import msgspec

from nodeagent.collectors.base import CollectorUnavailable, Roots, Sample
from nodeagent.collectors.nvme import read_small

# Documentation/networking/operstates.rst (RFC 2863)
OPERSTATES = frozenset(
    {"unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up"}
)
COUNTERS = ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped")
RTF_UP = 0x1


class NicError(ValueError):
    """A file that does not hold what the kernel writes there."""


class NicReading(msgspec.Struct, kw_only=True):
    carrier: int  # 1: carrier; 0: none (also read on an administratively down interface)
    operstate: str
    carrier_changes: int
    rx_errors: int
    tx_errors: int
    rx_dropped: int
    tx_dropped: int
    physical: bool  # backed by a device (a NIC), not a veth, bridge, ifb or tunnel

    @property
    def link_up(self) -> bool:
        return self.carrier == 1 and self.operstate != "down"


class NicSample(Sample, kw_only=True):
    interfaces: dict[str, NicReading] = msgspec.field(default_factory=dict)
    errors: dict[str, str] = msgspec.field(default_factory=dict)  # interface → what is wrong


class NicCollector:
    name = "nic"

    def __init__(self, roots: Roots, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._net = roots.sysfs / "class" / "net"

    def collect(self, now: float) -> NicSample:
        try:
            names = sorted(n for n in os.listdir(self._net) if n != "lo")  # noqa: PTH208
        except OSError as exc:
            raise CollectorUnavailable(f"cannot list {self._net}: {exc.strerror}") from exc
        interfaces: dict[str, NicReading] = {}
        errors: dict[str, str] = {}
        for name in names:
            try:
                interfaces[name] = self._read(f"{self._net}/{name}")
            except (OSError, NicError) as exc:
                errors[name] = describe(exc)
        return NicSample(time=now, interfaces=interfaces, errors=errors)

    def _read(self, base: str) -> NicReading:
        carrier = _carrier(f"{base}/carrier")
        operstate = read_small(f"{base}/operstate").strip()
        if operstate not in OPERSTATES:
            raise NicError(f"operstate holds {operstate[:20]!r}")
        changes = counter(f"{base}/carrier_changes")
        stats = {c: counter(f"{base}/statistics/{c}") for c in COUNTERS}
        return NicReading(
            carrier=carrier,
            operstate=operstate,
            carrier_changes=changes,
            physical=os.path.exists(f"{base}/device"),  # noqa: PTH110
            **stats,
        )


def _carrier(path: str) -> int:
    try:
        text = read_small(path).strip()
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return 0  # the interface is down: the kernel refuses to say, which means none
        raise
    if text not in ("0", "1"):
        raise NicError(f"carrier holds {text[:20]!r}, expected 0 or 1")
    return int(text)


def counter(path: str) -> int:
    """A cumulative counter file: one non-negative integer."""
    text = read_small(path).strip()
    if not text.isdigit():
        raise NicError(f"{path.rpartition('/')[2]} holds {text[:20]!r}, expected a count")
    return int(text)


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return str(exc)


def default_route_interface(procfs: Path) -> str:
    """The interface of the IPv4 default route with the lowest metric in
    ``<procfs>/net/route`` (hex fields, as the kernel writes them); "" when there is none or
    the file cannot be read."""
    try:
        lines = (procfs / "net" / "route").read_text().splitlines()[1:]
    except OSError:
        return ""
    best: tuple[int, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 8:
            continue
        iface, dest, flags, metric, mask = fields[0], fields[1], fields[3], fields[6], fields[7]
        try:
            up = int(flags, 16) & RTF_UP
            default = int(dest, 16) == 0 and int(mask, 16) == 0
            rank = int(metric)
        except ValueError:
            continue
        if up and default and (best is None or rank < best[0]):
            best = (rank, iface)
    return best[1] if best else ""
