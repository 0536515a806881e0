"""The hysteresis every two-state detector shares: confirm before raising, hold before
clearing, so a signal hovering at a threshold produces one event, not a stream of them.

:class:`ConditionLatch` is what detectors use: a :class:`Latch` that holds the
:class:`Condition` it opened, so every fault the agent reports, whichever detector saw it,
is one condition with one key, opened once and closed once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from proto.conditions import Condition, ConditionKind, Severity, condition_key


class Change(enum.Enum):
    RAISED = "raised"
    CLEARED = "cleared"


@dataclass
class Latch:
    """Raised after ``confirm`` consecutive bad samples; cleared once samples have been good
    for ``hold_s`` of sample time (a bad sample restarts the hold). A sample with no evidence
    either way (``None``) changes nothing: it breaks no run, and the time up to the next
    good sample is not counted as held (nothing was seen to be good then)."""

    confirm: int
    hold_s: float
    raised: bool = False
    held_s: float = 0.0  # good time so far while raised; when cleared, what it held for
    _bad_run: int = field(default=0, init=False, repr=False)
    _last_good: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.confirm < 1 or self.hold_s < 0:
            raise ValueError("need confirm >= 1 and hold_s >= 0")

    def update(self, bad: bool | None, t: float) -> Change | None:
        if bad is None:
            self._last_good = None
            return None
        if not self.raised:
            self._bad_run = self._bad_run + 1 if bad else 0
            if self._bad_run < self.confirm:
                return None
            self.raised, self._bad_run, self.held_s, self._last_good = True, 0, 0.0, None
            return Change.RAISED
        if bad:
            self.held_s, self._last_good = 0.0, None
            return None
        if self._last_good is not None:
            self.held_s += max(0.0, t - self._last_good)
        self._last_good = t
        if self.held_s < self.hold_s:
            return None
        self.raised, self._last_good = False, None
        return Change.CLEARED


class ConditionLatch:
    """One subject's condition (a device, a GPU, a pair, or the node): the latch decides
    when it opens and closes, the detector says why (``reason``, ``value``,
    ``threshold``) and builds the contract event that carries it."""

    def __init__(
        self,
        kind: ConditionKind,
        node: str,
        subject: str,
        *,
        severity: Severity,
        confirm: int,
        hold_s: float,
    ) -> None:
        self.kind, self.node, self.subject, self.severity = kind, node, subject, severity
        self.latch = Latch(confirm, hold_s)
        self.condition: Condition | None = None  # while open

    @property
    def open(self) -> bool:
        return self.latch.raised

    @property
    def held_s(self) -> float:
        """How long the subject has been good while open; once closed, for how long."""
        return self.latch.held_s

    def update(self, bad: bool | None, t: float) -> Change | None:
        return self.latch.update(bad, t)

    def record(
        self,
        change: Change,
        t: float,
        *,
        reason: str,
        value: float | None = None,
        threshold: float | None = None,
        severity: Severity | None = None,
    ) -> Condition:
        """The condition ``change`` opened (held from now on) or closed (a copy, inactive,
        ``since`` now): what the detector's event carries. ``severity`` defaults to the
        latch's, or on closing to the severity it was open with."""
        if change is Change.CLEARED:
            was = self.condition.severity if self.condition else self.severity
            self.condition = None
            return self._make(False, t, reason, value, threshold, severity or was)
        return self.restate(t, reason=reason, value=value, threshold=threshold, severity=severity)

    def restate(
        self,
        t: float,
        *,
        reason: str,
        value: float | None = None,
        threshold: float | None = None,
        severity: Severity | None = None,
    ) -> Condition:
        """The open condition's evidence changed (a GPU from warning to critical, one more
        failed check): it is replaced, same key, ``since`` now."""
        if not self.open:
            raise RuntimeError(f"{condition_key(self.kind, self.node, self.subject)} is not open")
        self.condition = self._make(True, t, reason, value, threshold, severity or self.severity)
        return self.condition

    def _make(
        self,
        active: bool,
        t: float,
        reason: str,
        value: float | None,
        threshold: float | None,
        severity: Severity,
    ) -> Condition:
        return Condition(
            kind=self.kind,
            node=self.node,
            subject=self.subject,
            active=active,
            since=t,
            severity=severity,
            reason=reason,
            value=value,
            threshold=threshold,
        )


class ConditionLatches:
    """One :class:`ConditionLatch` per subject, made with the same settings on first sight
    of the subject."""

    def __init__(
        self, kind: ConditionKind, node: str, *, severity: Severity, confirm: int, hold_s: float
    ) -> None:
        self._settings = (kind, node, severity, confirm, hold_s)
        self._latches: dict[str, ConditionLatch] = {}

    def __getitem__(self, subject: str) -> ConditionLatch:
        latch = self._latches.get(subject)
        if latch is None:
            kind, node, severity, confirm, hold_s = self._settings
            latch = ConditionLatch(
                kind, node, subject, severity=severity, confirm=confirm, hold_s=hold_s
            )
            self._latches[subject] = latch
        return latch
