"""NVMe latency from ``<sysfs>/block/<dev>/stat``: mean completion latency per window.

The kernel keeps cumulative counters of completed I/Os and of the time they took (``read
ticks``/``write ticks`` in ms, derived from a nanosecond sum, so no per-I/O rounding); the mean
latency over a window is Δticks ÷ ΔI/Os. Reading two cheap files per device every half second
is enough to see a device slow from ~20 µs to hundreds of µs before a training step notices.

One bad device never hides the others: any problem reading or parsing one device becomes an
entry in ``errors`` and that device is re-baselined on its next good reading. Only the absence
of every NVMe device raises (:class:`CollectorUnavailable`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import msgspec

from nodeagent.collectors.base import CollectorUnavailable, Roots, Sample

# Whole namespaces only: partitions (nvme0n1p1) live below the disk, and the hidden per-path
# devices of native NVMe multipath (nvme0c1n1) would count the same I/O twice.
WHOLE_DISK = re.compile(r"nvme\d+n\d+")

# Field counts of the layouts in Documentation/block/stat.rst: 11 (before 4.18), 15 (with
# discard, 4.18+), 17 (with flush, 5.5+). Longer lines are accepted for later kernels, which
# only ever append; anything else is not a block stat file.
_LAYOUTS = (11, 15, 17)


class StatError(ValueError):
    """A stat or ro file that does not hold what the kernel writes there."""


@dataclass(frozen=True)
class _Reading:
    time: float
    ios: int  # read + write I/Os completed
    ticks_ms: int  # read + write ticks
    in_flight: int


class NvmeDeviceReading(msgspec.Struct, kw_only=True):
    """One namespace over one window (see :class:`NvmeLatencyCollector` for the cases)."""

    readonly: bool  # the kernel's ro flag
    in_flight: int
    latency_us: float | None = None
    iops: float = 0.0
    idle: bool = False
    stalled: bool = False


class NvmeLatencySample(Sample, kw_only=True):
    devices: dict[str, NvmeDeviceReading] = msgspec.field(default_factory=dict)
    errors: dict[str, str] = msgspec.field(default_factory=dict)  # device → what went wrong


def parse_stat(text: str) -> tuple[int, int, int]:
    """(completed read+write I/Os, read+write ticks in ms, I/Os in flight) from one stat
    file's text."""
    fields = text.split()
    if len(fields) not in _LAYOUTS and len(fields) <= _LAYOUTS[-1]:
        raise StatError(f"expected 11, 15 or 17 fields, got {len(fields)}")
    try:
        values = [int(f) for f in fields[:9]]
    except ValueError:
        raise StatError(f"non-integer field in {text.strip()[:60]!r}") from None
    if min(values) < 0:
        raise StatError("negative counter")
    if max(values) >= 2**64:
        raise StatError("counter wider than 64 bits")
    read_ios, _, _, read_ticks, write_ios, _, _, write_ticks, in_flight = values
    return read_ios + write_ios, read_ticks + write_ticks, in_flight


def parse_ro(text: str) -> bool:
    value = text.strip()
    if value not in ("0", "1"):
        raise StatError(f"ro holds {value[:20]!r}, expected 0 or 1")
    return value == "1"


class NvmeLatencyCollector:
    """Mean I/O latency, IOPS and the read-only flag of each NVMe namespace.

    ``latency_us`` is the mean over the window. When no I/O completed in it there is nothing
    to average: if nothing is in flight either the device is ``idle`` (latency None); if I/Os
    were in flight at both ends of the window, at least one of them has waited the whole
    window, so the device is ``stalled`` and ``latency_us`` is the window's length (a lower
    bound). ``latency_us`` is also None on a device's first reading and after its counters
    went backwards (a reset or a wrap); ``iops`` is 0.0 in those windows.
    """

    name = "nvme"

    def __init__(
        self, roots: Roots, devices: list[str] | None = None, interval_s: float = 0.5
    ) -> None:
        self.interval_s = interval_s
        self._block = roots.sysfs / "block"
        self._only = devices
        self._last: dict[str, _Reading] = {}

    def collect(self, now: float) -> NvmeLatencySample:
        present = self._discover()
        wanted = self._only if self._only is not None else present
        devices: dict[str, NvmeDeviceReading] = {}
        errors: dict[str, str] = {}
        for dev in sorted(set(self._last) - set(present)):
            errors[dev] = "device vanished"
            del self._last[dev]
        for dev in wanted:
            if dev not in present:
                errors.setdefault(dev, "device not present")
                continue
            try:
                devices[dev] = self._read(dev, now)
            except (OSError, StatError) as exc:
                self._last.pop(dev, None)
                errors[dev] = _describe(exc)
        return NvmeLatencySample(time=now, devices=devices, errors=errors)

    def _discover(self) -> list[str]:
        try:
            listing = os.listdir(self._block)  # noqa: PTH208 (twice a second: no Path objects)
            names = sorted(n for n in listing if WHOLE_DISK.fullmatch(n))
        except OSError as exc:
            raise CollectorUnavailable(f"cannot list {self._block}: {_describe(exc)}") from exc
        if not names:
            raise CollectorUnavailable(f"no NVMe block devices under {self._block}")
        return names

    def _read(self, dev: str, now: float) -> NvmeDeviceReading:
        base = f"{self._block}/{dev}"
        ios, ticks, in_flight = parse_stat(read_small(f"{base}/stat"))
        readonly = parse_ro(read_small(f"{base}/ro"))
        previous = self._last.get(dev)
        self._last[dev] = _Reading(now, ios, ticks, in_flight)
        if previous is None or ios < previous.ios or ticks < previous.ticks_ms:
            return NvmeDeviceReading(readonly=readonly, in_flight=in_flight)
        d_ios, window = ios - previous.ios, now - previous.time
        if d_ios:
            latency = (ticks - previous.ticks_ms) * 1000.0 / d_ios
            iops = d_ios / window if window > 0 else 0.0
            return NvmeDeviceReading(
                readonly=readonly, in_flight=in_flight, latency_us=latency, iops=iops
            )
        if in_flight and previous.in_flight:
            stalled_us = max(0.0, window) * 1e6  # a lower bound: one I/O waited all along
            return NvmeDeviceReading(
                readonly=readonly, in_flight=in_flight, latency_us=stalled_us, stalled=True
            )
        return NvmeDeviceReading(readonly=readonly, in_flight=in_flight, idle=in_flight == 0)


def read_small(path: str) -> str:
    """A sysfs attribute's text. Plain os calls: this runs for every device twice a second,
    and pathlib's and io's layers cost more than the read itself."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 4096).decode("ascii", errors="replace")
        finally:
            os.close(fd)
    except OSError as exc:  # os.read does not name the file (EISDIR on a directory)
        raise OSError(exc.errno, exc.strerror, path) from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"vanished while reading: {exc.filename}"
    if isinstance(exc, OSError):
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return str(exc)
