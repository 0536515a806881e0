"""What the job manager notes of a job beside its record: in memory only, so a new leader
begins each job's books empty, which every use of them allows for (a straggler seen in
one window waits for another, a step's time for the next pair of stamps).

One :class:`Books` per job, so a job's notes are begun, found and kept together; those that
hold for one attempt only (:class:`AttemptBooks`) are begun anew when the job's attempt
is a later one, not kept for every attempt there was.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class AttemptBooks:
    """One attempt's notes: which of its ranks were slow, and when the first exited."""

    attempt: int
    straggled: set[int] = field(default_factory=set)  # ranks reported as stragglers
    slow: set[int] = field(default_factory=set)  # ranks slow in the newest window
    first_exit_at: float | None = None  # monotonic: a rank's exit, its first


@dataclass
class Books:
    """One job's notes. ``dirty``: the record changed since it was saved (progress is
    saved in batches, each tick). ``tasks``: its stops, launch and kills in flight, by
    kind; a job this leader holds no record of has books only for the kill of its
    orphan ranks."""

    stepped_at: float | None = None  # monotonic: when rank 0's newest step report came
    stamped: tuple[int, float] | None = None  # the newest step and rank 0's stamp of it
    checkpoint_began: tuple[int, float] | None = None  # a periodic one's step, monotonic
    dirty: bool = False
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _attempt: AttemptBooks = field(default_factory=lambda: AttemptBooks(0))

    def attempt(self, attempt: int) -> AttemptBooks:
        """The notes of ``attempt``, begun anew when they were a former attempt's."""
        if self._attempt.attempt != attempt:
            self._attempt = AttemptBooks(attempt)
        return self._attempt
