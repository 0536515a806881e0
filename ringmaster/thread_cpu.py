"""CPU time of threads a library started, which ``time.thread_time()`` in our own thread
cannot see: the checkpoint group's gloo workers carry out the buddy copy's sends and
receives while the persist thread only waits for them, so a snapshot's cost counted on
the persist thread alone misses that work. Linux reads each thread's run time from
``/proc/self/task/<tid>/schedstat`` (nanoseconds); where that cannot be read, a thread
counts as 0 and the figure is the persist thread's alone, as before."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
TASKS = Path("/proc/self/task")


def task_ids() -> set[int]:
    """This process's threads (none where ``/proc`` cannot be read)."""
    try:
        return {int(path.name) for path in TASKS.iterdir()}
    except OSError:
        return set()


def started_by(make: Callable[[], T]) -> tuple[T, frozenset[int]]:
    """``make()``'s result and the threads that appeared while it ran (a process group's
    workers and its transport's loop)."""
    before = task_ids()
    made = make()
    return made, frozenset(task_ids() - before)


def cpu_s(tids: frozenset[int]) -> float:
    """The CPU seconds ``tids`` have run in all; a thread gone or unreadable counts 0."""
    total = 0
    for tid in tids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((TASKS / str(tid) / "schedstat").read_text().split()[0])
    return total / 1e9
