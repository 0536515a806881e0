"""What the node agent can learn of a rank's process from outside: its state and process
group (``/proc/<pid>/stat``), whether it catches a signal (``SigCgt``), and its Python
stacks.

Stacks are asked of the rank's stacks thread first (:mod:`ringmaster.rank.stacks`: a byte on the
FIFO beside its beat; it writes them to stderr, that is to the rank's log, holding the
GIL), and of its ``faulthandler`` (on ``STACKS_SIGNAL``, SIGUSR2, registered by the rank)
only when that thread does not answer, as in a rank wedged in C code holding the GIL. The
probe notes the log's size, asks, and takes what was appended. The signal is sent only to
a process that catches it, since its default action would kill the rank. A stopped process
runs no thread: it is continued for the dump and stopped again as soon as the dump is
written (tens of milliseconds), so that the fault stays what it was."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ringmaster.rundir import STACKS_SIGNAL

STACKS_WAIT_S = 1.0
THREAD_WAIT_S = 0.5  # the stacks thread's answer, before falling back to the signal
_SETTLE_S = 0.01  # the dump is complete once the log stops growing this long
_POLL_S = 0.002
_READ_MAX = 256 * 1024


STOPPED = ("T", "t")  # the state letters of a stopped process (by a signal, by a tracer)


@dataclass(frozen=True)
class ProcStat:
    state: str
    pgrp: int

    @property
    def stopped(self) -> bool:
        return self.state in STOPPED


def proc_stat(pid: int) -> ProcStat | None:
    """State letter and process group of ``pid``; None when it is gone or unreadable."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        # the fields follow the parenthesised command name, which may itself hold ')'
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return ProcStat(fields[0], int(fields[2]))
    return None


def catches(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler for ``signum`` (``SigCgt``)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


async def capture_stacks(pid: int, log_path: Path, fifo: Path, *, stopped: bool) -> str:
    """The dump ``pid`` appends to ``log_path`` when asked through ``fifo``, else on
    ``STACKS_SIGNAL`` ("" if none)."""
    start = _size(log_path)
    asked = _request(fifo)  # a stopped rank's open FIFO takes the byte all the same
    faulthandler = catches(pid, STACKS_SIGNAL)
    if not (asked or faulthandler):
        return ""  # nothing to ask: a stopped rank is left exactly as it is
    try:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        if not (asked and await _appended(log_path, start, THREAD_WAIT_S)):
            if not faulthandler:
                return ""
            os.kill(pid, STACKS_SIGNAL)
            await _appended(log_path, start, STACKS_WAIT_S)
    except ProcessLookupError:
        return ""
    finally:
        if stopped:
            await _stop_again(pid)
    with contextlib.suppress(OSError), log_path.open("rb") as f:
        f.seek(start)
        return f.read(_READ_MAX).decode(errors="replace")
    return ""


async def _stop_again(pid: int) -> None:
    """SIGSTOP, and wait (briefly) until the process is seen stopped: the signal takes
    effect when the process next runs, not when ``kill`` returns."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + STACKS_WAIT_S
    while time.monotonic() < deadline:
        stat = proc_stat(pid)
        if stat is None or stat.stopped:
            return
        await asyncio.sleep(_POLL_S)


def _request(fifo: Path) -> bool:
    """One byte on the rank's stacks FIFO; False when no process reads it."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader; ENOENT: a rank without the thread
        return False
    try:
        os.write(fd, b"s")
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


async def _appended(log_path: Path, start: int, wait_s: float) -> bool:
    """Whether ``log_path`` grew past ``start`` within ``wait_s``, waiting for it to
    stop growing (the dump complete) once it has."""
    deadline = time.monotonic() + wait_s
    size, since = start, time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
        now_size = _size(log_path)
        if now_size != size:
            size, since = now_size, time.monotonic()
        elif size > start and time.monotonic() - since >= _SETTLE_S:
            return True
    return size > start


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0
