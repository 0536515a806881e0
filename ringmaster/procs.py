"""Process helpers the CLI, the agent's run-dir layout and the tests share: is a PID
running, when it started, the environment it started with, the PID in a PID file, and
polling until a condition holds.

Polling comes in two colours, :func:`wait_until` for blocking callers and
:func:`wait_until_async` for coroutines, with the same contract: call the predicate, return
its first truthy result, and raise ``TimeoutError`` once ``timeout`` seconds have passed
(``None``: wait for ever). The predicate is always called at least once, and once more at
the deadline, so a condition that holds by then is never reported as a timeout. Callers
turn the ``TimeoutError`` into their own message. The deadline is read from a clock
(``ringmaster.clock``): the system's, or for a test of the waiting itself a manual one that
the wait's own ``sleep`` moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from ringmaster.clock import SYSTEM, Clock

T = TypeVar("T")


def pid_alive(pid: int) -> bool:
    """Running, and not a zombie: a child that exited but was not reaped yet still has a
    PID, yet it is not running anything."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    with contextlib.suppress(OSError, IndexError):
        # the state follows the parenthesised command name, which may itself hold ')'
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True


def read_pid(path: Path) -> int | None:
    """The PID written first in ``path`` (a rank's PID file adds its start time); None if
    the file is missing or holds no number."""
    with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
        return int(path.read_text().split()[0])
    return None


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22);
    None if there is no such process. A PID and its start time name one process for the
    life of the machine: a PID reused later has a later start."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # fields 3 and on follow the parenthesised command name, which may itself hold ')'
    with contextlib.suppress(IndexError, ValueError):
        return int(stat.rsplit(")", 1)[1].split()[19])
    return None


class _Deadline:
    def __init__(self, timeout: float | None, clock: Clock = SYSTEM) -> None:
        self._clock = clock
        self._at = None if timeout is None else clock.monotonic() + timeout

    def pause(self, interval: float) -> float:
        """How long to sleep before the next try; TimeoutError once the deadline passed."""
        if self._at is None:
            return interval
        left = self._at - self._clock.monotonic()
        if left <= 0:
            raise TimeoutError
        return min(interval, left)


def environment(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with, from ``/proc`` (empty if unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {os.fsdecode(k): os.fsdecode(v) for k, _, v in pairs}


def wait_until(
    predicate: Callable[[], T | None],
    timeout: float | None,
    interval: float = 0.05,
    *,
    clock: Clock = SYSTEM,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy; return it.
    ``clock`` and ``sleep``: where the deadline is read, and how to wait between tries."""
    deadline = _Deadline(timeout, clock)
    while not (result := predicate()):
        sleep(deadline.pause(interval))
    return result


async def wait_until_async(
    predicate: Callable[[], Awaitable[T | None]], timeout: float | None, interval: float = 0.05
) -> T:
    """:func:`wait_until` for an async predicate, sleeping without blocking the loop."""
    deadline = _Deadline(timeout)
    while not (result := await predicate()):
        await asyncio.sleep(deadline.pause(interval))
    return result
