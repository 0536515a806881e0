"""What the node agent can learn of a rank's process from outside: its state and process
group (``/proc/<pid>/stat``), whether it catches a signal (``SigCgt``), and its Python
stacks.

Stacks come from the rank's own ``faulthandler`` (SIGUSR1, registered by the trainer),
which writes them to stderr, that is to the rank's log: the probe notes the log's size,
signals, and takes what was appended. SIGUSR1 is sent only to a process that catches it,
since its default action would kill the rank. A stopped process runs no handler: it is
continued for the dump and stopped again as soon as the dump is written (tens of
milliseconds), so that the fault stays what it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

STACKS_WAIT_S = 1.0
_SETTLE_S = 0.01  # the dump is complete once the log stops growing this long
_POLL_S = 0.002
_READ_MAX = 256 * 1024


@dataclass(frozen=True)
class ProcStat:
    state: str
    pgrp: int


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


async def capture_stacks(pid: int, log_path: Path, *, stopped: bool) -> str:
    """The faulthandler dump ``pid`` appends to ``log_path`` on SIGUSR1 ("" if none)."""
    if not catches(pid, signal.SIGUSR1):
        return ""
    start = _size(log_path)
    try:
        os.kill(pid, signal.SIGUSR1)
        if stopped:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + STACKS_WAIT_S
        size, since = start, time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
            now_size = _size(log_path)
            if now_size != size:
                size, since = now_size, time.monotonic()
            elif size > start and time.monotonic() - since >= _SETTLE_S:
                break
    except ProcessLookupError:
        return ""
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
    with contextlib.suppress(OSError), log_path.open("rb") as f:
        f.seek(start)
        return f.read(_READ_MAX).decode(errors="replace")
    return ""


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0
