"""Time as an input: the one clock object the decisions read.

The coordinator's decisions (job records, the ledger, the policy, the registry,
exclusions, waits) and the agent's detectors read the time from a :class:`Clock` they are
given. Production passes :data:`SYSTEM`, the real clocks; unit tests pass a
:class:`ManualClock` and move it themselves, so a test never depends on how long the
machine took between two reads of the wall clock.

Two readings, as the kernel has them: ``time()`` is the wall clock (Unix seconds: what is
stamped on records and compared with other machines' stamps), ``monotonic()`` the
process's own (intervals, deadlines; never steps). A manual clock moves both together.
"""

from __future__ import annotations

import time as _time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """The wall clock, Unix seconds."""
        ...

    def monotonic(self) -> float:
        """A clock that never steps, for intervals."""
        ...


class SystemClock:
    """The machine's own clocks."""

    def time(self) -> float:
        return _time.time()

    def monotonic(self) -> float:
        return _time.monotonic()


SYSTEM: Clock = SystemClock()

# A fixed, recognisable start for manual clocks: 2026-01-01T00:00:00Z.
EPOCH = 1_767_225_600.0


class ManualClock:
    """A clock that moves only when told to: ``advance`` moves both readings by the same
    amount, ``set_wall`` steps the wall clock alone (as a clock resync would)."""

    def __init__(self, wall: float = EPOCH, mono: float = 1_000.0) -> None:
        self._wall, self._mono = wall, mono

    def time(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back: advance({seconds})")
        self._wall += seconds
        self._mono += seconds

    def set_wall(self, wall: float) -> None:
        self._wall = wall
