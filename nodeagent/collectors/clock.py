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
"""

from __future__ import annotations

import asyncio
import ctypes
import subprocess
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from nodeagent.collectors.base import Sample
from nodeagent.collectors.clock_peer import PeerClock
from proto.events import ClockResynced, Severity

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


def read_adjtimex() -> dict[str, Any]:
    """The kernel clock's discipline state; nothing is changed (modes = 0)."""
    tx = Timex()
    state = _libc.adjtimex(ctypes.byref(tx))
    if state < 0:
        raise OSError(ctypes.get_errno(), "adjtimex failed")
    scale = 1e6 if tx.status & STA_NANO else 1e3  # offset in ns or µs → ms
    return {
        "state": STATES[state] if state < len(STATES) else str(state),
        "synced": state != 5 and not tx.status & STA_UNSYNC,
        "status": tx.status,
        "max_error_ms": tx.maxerror / 1000,
        "est_error_ms": tx.esterror / 1000,
        "offset_ms": tx.offset / scale,
    }


def parse_tracking(line: str) -> dict[str, Any]:
    """One line of ``chronyc -c tracking``. Its system-time field is chrony's correction
    (positive: the clock is slow), so the clock's offset is its negative."""
    fields = line.strip().split(",")
    if len(fields) < 14:
        raise ValueError(f"chronyc -c tracking: expected 14 fields, got {len(fields)}")
    correction, root_delay, root_dispersion = float(fields[4]), float(fields[10]), float(fields[11])
    return {
        "reference": fields[1] or fields[0],
        "stratum": int(fields[2]),
        "offset_ms": -correction * 1000,
        "bound_ms": (root_delay / 2 + root_dispersion) * 1000,
        "leap": fields[13],
        "synced": fields[13] != "Not synchronised",
    }


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
        max_offset_ms: float = 5.0,
    ) -> None:
        self.interval_s = interval_s
        self.peer = peer
        self._adjtimex = use_adjtimex
        self._chronyc = chronyc or []
        self._chrony_interval_s = chrony_interval_s
        self._chrony: tuple[float, dict[str, Any]] | None = None  # (monotonic time, reading)
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
        return time.time() + self.skew_ms() / 1000

    def collect(self, now: float) -> Sample:
        values: dict[str, Any] = {"adjtimex": read_adjtimex() if self._adjtimex else None}
        values |= self._read_chrony(time.monotonic())
        values["peer"] = self.peer.latest()
        values |= self._best(values)
        self.last_offset_ms = values["offset_ms"]
        return Sample(collector=self.name, time=now, values=values)

    def _read_chrony(self, mono: float) -> dict[str, Any]:
        if not self._chronyc:
            return {"chrony": None, "chrony_error": "not configured"}
        if self._chrony is None or mono - self._chrony[0] >= self._chrony_interval_s:
            self._chrony = (mono, self._run_chronyc())
        reading = self._chrony[1]
        if "error" in reading:
            return {"chrony": None, "chrony_error": reading["error"]}
        return {"chrony": reading, "chrony_error": ""}

    def _run_chronyc(self) -> dict[str, Any]:
        try:
            result = subprocess.run(
                self._chronyc, capture_output=True, text=True, timeout=5, check=False
            )
            if result.returncode != 0:
                return {"error": (result.stderr or result.stdout).strip()[:200]}
            return parse_tracking(result.stdout)
        except FileNotFoundError:
            return {"error": f"no {self._chronyc[0]}"}
        except (subprocess.SubprocessError, ValueError) as exc:
            return {"error": str(exc)}

    def _best(self, values: dict[str, Any]) -> dict[str, Any]:
        skew = self.skew_ms()
        kernel, chrony, peer = values["adjtimex"], values["chrony"], values["peer"]
        synced = (kernel is None or kernel["synced"]) and (chrony is None or chrony["synced"])
        best: dict[str, Any] = {"offset_ms": None, "bound_ms": None, "source": "none"}
        if peer is not None:  # measured with the skewed clock already
            best = {"offset_ms": peer["offset_ms"], "bound_ms": peer["bound_ms"], "source": "peer"}
        elif chrony is not None:
            offset = chrony["offset_ms"] + skew
            best = {"offset_ms": offset, "bound_ms": chrony["bound_ms"], "source": "chrony"}
        elif self._skew_file is not None:
            best = {"offset_ms": skew, "bound_ms": 0.0, "source": "skew_file"}
        return best | {"synced": synced, "skew_ms": skew}

    async def resync(self) -> ClockResynced:
        """Run the step command, then measure again: the ``resync_clock`` command."""
        before = self.last_offset_ms
        ok, why = await asyncio.to_thread(self._run_step)
        self.peer.forget()
        if self.peer.attached:
            await self.peer.measure()
        sample = await asyncio.to_thread(self._fresh_sample)
        after = sample.values["offset_ms"]
        ok = ok and sample.values["synced"] and (after is None or abs(after) <= self._max_offset_ms)
        text = "n/a" if after is None else f"{after:+.2f} ms"
        was = "n/a" if before is None else f"{before:+.2f} ms"
        return ClockResynced(
            severity=Severity.INFO if ok else Severity.WARNING,
            offset_before_ms=before or 0.0,
            offset_after_ms=after or 0.0,
            ok=ok,
            message=f"clock resync {'done' if ok else 'failed'}: {was} → {text}"
            + (f" ({why})" if why else ""),
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

    def _fresh_sample(self) -> Sample:
        self._chrony = None
        return self.collect(time.time())
