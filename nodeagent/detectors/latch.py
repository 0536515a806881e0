"""The hysteresis every two-state detector shares: confirm before raising, hold before
clearing, so a signal hovering at a threshold produces one event, not a stream of them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Change(enum.Enum):
    RAISED = "raised"
    CLEARED = "cleared"


@dataclass
class Latch:
    """Raised after ``confirm`` consecutive bad samples; cleared once samples have been good
    for ``hold_s`` of sample time (a bad sample restarts the hold). A sample with no evidence
    either way (``None``) changes nothing and breaks no run."""

    confirm: int = 1
    hold_s: float = 0.0
    raised: bool = False
    held_s: float = field(default=0.0, init=False)  # how long it had been good when it cleared
    _bad_run: int = field(default=0, init=False, repr=False)
    _good_since: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.confirm < 1 or self.hold_s < 0:
            raise ValueError("need confirm >= 1 and hold_s >= 0")

    def update(self, bad: bool | None, t: float) -> Change | None:
        if bad is None:
            return None
        if not self.raised:
            self._bad_run = self._bad_run + 1 if bad else 0
            if self._bad_run < self.confirm:
                return None
            self.raised, self._bad_run, self._good_since = True, 0, None
            return Change.RAISED
        if bad:
            self._good_since = None
            return None
        if self._good_since is None:
            self._good_since = t
        if t - self._good_since < self.hold_s:
            return None
        self.raised, self.held_s, self._good_since = False, t - self._good_since, None
        return Change.CLEARED
