"""The node's clock: the kernel's sync state (``adjtimex``), chrony's view (``chronyc -c
tracking``) and the offset to the coordinator measured over NATS (:mod:`clock_peer`).

Training needs the nodes' clocks to agree: checkpoint deadlines, lease expiry and event
order all compare timestamps taken on different machines. ``offset_ms`` is this node's
clock minus the reference (positive: ahead), from the best source present: the coordinator
when a recent measurement exists, else chrony. ``bound_ms`` is its uncertainty: half the
round trip to the coordinator, or chrony's root delay/2 + root dispersion.

``adjtimex(modes=0)`` only reads, so it needs no privilege. Running ``chronyc`` costs a
process, so its answer is reused for ``chrony_interval_s``.

A simulated node's clock cannot be moved, so ``skew_file`` holds an extra offset in ms that
is added to every reading (and, with no other source, is the offset itself); the
simulator's ``clock-offset`` fault writes it and its resync command removes it.

The node's time is read from the clock the peer measurement is given (``peer.clock``):
the wall time measured against the coordinator's, and how long chrony's answer is reused.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import subprocess
from pathlib import Path

import msgspec
from nats.aio.client import Client

from nodeagent.collectors.base import Sample
from nodeagent.collectors.clock_peer import PeerClock
from proto.events import ClockResynced, ClockResyncFailed, Severity

STA_UNSYNC, STA_NANO = 0x40, 0x2000
STATES = ("TIME_OK", "TIME_INS", "TIME_DEL", "TIME_OOP", "TIME_WAIT", "TIME_ERROR")


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class Timex(ctypes.Structure):
    """``struct timex`` of <sys/timex.h> (Linux); ctypes lays out the padding."""

    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time", _Timeval),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_reserved", ctypes.c_int * 11),
    ]


_libc = ctypes.CDLL(None, use_errno=True)


class KernelClock(msgspec.Struct, kw_only=True):
    """``adjtimex``'s answer: the kernel clock's discipline state."""

    state: str  # TIME_OK ... TIME_ERROR
    synced: bool
    status: int  # STA_* bits
    max_error_ms: float
    est_error_ms: float
    offset_ms: float


class ChronyTracking(msgspec.Struct, kw_only=True):
    reference: str
    stratum: int
    offset_ms: float  # the clock minus true time
    bound_ms: float  # root delay/2 + root dispersion
    leap: str
    synced: bool


class PeerOffset(msgspec.Struct, kw_only=True):
    """The last offset to the coordinator (:class:`PeerClock`'s measurement)."""

    offset_ms: float
    bound_ms: float  # half the round trip
    rtt_ms: float
    age_s: float


class ClockSample(Sample, kw_only=True):
    """Every source as read, and the best offset of them: ``source`` names it (``peer``,
    ``chrony``, ``skew_file``, or ``none`` with no offset)."""

    adjtimex: KernelClock | None = None  # None: not read (simulated nodes)
    chrony: ChronyTracking | None = None
    chrony_error: str = ""  # why there is no chrony reading
    peer: PeerOffset | None = None
    offset_ms: float | None = None
    bound_ms: float | None = None
    source: str = "none"
    synced: bool = True  # neither the kernel nor chrony says unsynchronised
    skew_ms: float = 0.0  # a simulated node's extra offset


def read_adjtimex() -> KernelClock:
    """The kernel clock's discipline state; nothing is changed (modes = 0)."""
    tx = Timex()
    state = _libc.adjtimex(ctypes.byref(tx))
    if state < 0:
        raise OSError(ctypes.get_errno(), "adjtimex failed")
    scale = 1e6 if tx.status & STA_NANO else 1e3  # offset in ns or µs → ms
    return KernelClock(
        state=STATES[state] if state < len(STATES) else str(state),
        synced=state != 5 and not tx.status & STA_UNSYNC,
        status=tx.status,
        max_error_ms=tx.maxerror / 1000,
        est_error_ms=tx.esterror / 1000,
        offset_ms=tx.offset / scale,
    )


def parse_tracking(line: str) -> ChronyTracking:
    """One line of ``chronyc -c tracking``. Its system-time field is chrony's correction
    (positive: the clock is slow), so the clock's offset is its negative."""
    fields = line.strip().split(",")
    if len(fields) < 14:
        raise ValueError(f"chronyc -c tracking: expected 14 fields, got {len(fields)}")
    correction, root_delay, root_dispersion = float(fields[4]), float(fields[10]), float(fields[11])
    if not all(map(math.isfinite, (correction, root_delay, root_dispersion))):
        raise ValueError(
            f"chronyc -c tracking: non-finite offset or bound in {line.strip()[:80]!r}"
        )
    return ChronyTracking(
        reference=fields[1] or fields[0],
        stratum=int(fields[2]),
        offset_ms=-correction * 1000,
        bound_ms=(root_delay / 2 + root_dispersion) * 1000,
        leap=fields[13],
        synced=fields[13] != "Not synchronised",
    )


class ClockCollector:
    name = "clock"

    def __init__(
        self,
        *,
        peer: PeerClock,
        interval_s: float = 5.0,
        use_adjtimex: bool = True,
        chronyc: list[str] | None = None,
        chrony_interval_s: float = 16.0,
        skew_file: Path | None = None,
        step_command: list[str] | None = None,
        step_timeout_s: float = 10.0,
        max_offset_ms: float,
    ) -> None:
        self.interval_s = interval_s
        self.peer = peer
        self._adjtimex = use_adjtimex
        self._chronyc = chronyc or []
        self._chrony_interval_s = chrony_interval_s
        # (monotonic time, reading or why not)
        self._chrony: tuple[float, ChronyTracking | str] | None = None
        self._skew_file = skew_file
        self._step = step_command or []
        self._step_timeout_s = step_timeout_s
        self._max_offset_ms = max_offset_ms
        self.last_offset_ms: float | None = None
        peer.local_clock = self.local_time

    async def attach(self, nc: Client, cluster: str) -> None:
        """Measure the offset to the coordinator for as long as the agent runs."""
        await self.peer.run(nc, cluster)

    def skew_ms(self) -> float:
        if self._skew_file is None:
            return 0.0
        try:
            return float(self._skew_file.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0.0

    def local_time(self) -> float:
        return self.peer.clock.time() + self.skew_ms() / 1000

    def collect(self, now: float) -> ClockSample:
        kernel = read_adjtimex() if self._adjtimex else None
        chrony = self._read_chrony(self.peer.clock.monotonic())
        tracking = chrony if isinstance(chrony, ChronyTracking) else None
        latest = self.peer.latest()
        peer = msgspec.convert(latest, PeerOffset) if latest is not None else None
        skew = self.skew_ms()
        offset, bound, source = self._best(tracking, peer, skew)
        self.last_offset_ms = offset
        return ClockSample(
            time=now,
            adjtimex=kernel,
            chrony=tracking,
            chrony_error=chrony if isinstance(chrony, str) else "",
            peer=peer,
            offset_ms=offset,
            bound_ms=bound,
            source=source,
            synced=(kernel is None or kernel.synced) and (tracking is None or tracking.synced),
            skew_ms=skew,
        )

    def _read_chrony(self, mono: float) -> ChronyTracking | str:
        """chrony's tracking, reused for ``chrony_interval_s``; or why there is none."""
        if not self._chronyc:
            return "not configured"
        if self._chrony is None or mono - self._chrony[0] >= self._chrony_interval_s:
            self._chrony = (mono, self._run_chronyc())
        return self._chrony[1]

    def _run_chronyc(self) -> ChronyTracking | str:
        try:
            result = subprocess.run(
                self._chronyc, capture_output=True, text=True, timeout=5, check=False
            )
            if result.returncode != 0:
                return (result.stderr or result.stdout).strip()[:200]
            return parse_tracking(result.stdout)
        except FileNotFoundError:
            return f"no {self._chronyc[0]}"
        except (subprocess.SubprocessError, ValueError) as exc:
            return str(exc)

    def _best(
        self, chrony: ChronyTracking | None, peer: PeerOffset | None, skew: float
    ) -> tuple[float | None, float | None, str]:
        """(offset, bound, source) from the best source present: the coordinator (measured
        with the skewed clock already), else chrony, else a simulated node's skew alone."""
        if peer is not None:
            return peer.offset_ms, peer.bound_ms, "peer"
        if chrony is not None:
            return chrony.offset_ms + skew, chrony.bound_ms, "chrony"
        if self._skew_file is not None:
            return skew, 0.0, "skew_file"
        return None, None, "none"

    async def resync(self) -> ClockResynced | ClockResyncFailed:
        """Run the step command, then measure again: the ``resync_clock`` command."""
        before = self.last_offset_ms
        ok, why = await asyncio.to_thread(self._run_step)
        self.peer.forget()
        if self.peer.attached:
            await self.peer.measure()
        sample = await asyncio.to_thread(self._fresh_sample)
        after = sample.offset_ms
        text = "n/a" if after is None else f"{after:+.2f} ms"
        was = "n/a" if before is None else f"{before:+.2f} ms"
        if ok and not sample.synced:
            why = "still unsynchronised after the step"
        elif ok and after is not None and abs(after) > self._max_offset_ms:
            why = f"still beyond {self._max_offset_ms:g} ms after the step"
        before_ms, after_ms, measured = before or 0.0, after or 0.0, after is not None
        if not why:
            return ClockResynced(
                offset_before_ms=before_ms,
                offset_after_ms=after_ms,
                offset_measured=measured,
                message=f"clock resync done: {was} → {text}",
            )
        return ClockResyncFailed(
            severity=Severity.WARNING,
            offset_before_ms=before_ms,
            offset_after_ms=after_ms,
            offset_measured=measured,
            reason=why,
            message=f"clock resync failed: {was} → {text} ({why})",
        )

    def _run_step(self) -> tuple[bool, str]:
        if not self._step:
            return False, "no step command configured"
        try:
            result = subprocess.run(
                self._step, capture_output=True, text=True, timeout=self._step_timeout_s
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return False, f"{self._step[0]}: {exc}"
        if result.returncode != 0:
            why = (result.stderr or result.stdout).strip()[:200]
            return False, f"{self._step[0]} exited with {result.returncode}: {why}"
        return True, ""

    def _fresh_sample(self) -> ClockSample:
        self._chrony = None
        return self.collect(self.peer.clock.time())
