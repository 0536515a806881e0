"""The shared hysteresis: the latch, and the condition a latch holds while open."""

from __future__ import annotations

import pytest

from nodeagent.detectors.latch import Change, ConditionLatch, ConditionLatches, Latch
from proto.conditions import ConditionKind, Severity, condition_key


def test_latch_confirms_and_holds() -> None:
    latch = Latch(confirm=2, hold_s=2.0)
    trace = [(True, 0), (False, 1), (True, 2), (True, 3), (None, 4), (False, 5), (True, 6)]
    trace += [(False, 7), (False, 8), (False, 9), (None, 10), (False, 11)]
    changes = [(t, latch.update(bad, t)) for bad, t in trace]
    assert [(t, c) for t, c in changes if c] == [(3, Change.RAISED), (9, Change.CLEARED)]
    assert latch.held_s == 2.0
    with pytest.raises(ValueError):
        Latch(confirm=0, hold_s=0.0)


def test_no_evidence_adds_no_held_time() -> None:
    """Between two good samples a stretch with no evidence counts for nothing: the hold
    is made of time seen to be good."""
    latch = Latch(confirm=1, hold_s=2.0)
    latch.update(True, 0)
    trace = [(False, 1), (False, 2), (None, 3), (None, 50), (False, 60), (False, 61)]
    assert [latch.update(bad, t) for bad, t in trace] == [None] * 5 + [Change.CLEARED]
    assert latch.held_s == 2.0


def test_condition_latch_opens_holds_and_closes_one_condition() -> None:
    kind, warning = ConditionKind.NVME_LATENCY, Severity.WARNING
    latch = ConditionLatch(kind, "node-1", "nvme0n1", severity=warning, confirm=1, hold_s=0.0)
    change = latch.update(True, 10.0)
    assert change is Change.RAISED and latch.open
    opened = latch.record(change, 10.0, reason="slow", value=400.0, threshold=100.0)
    assert latch.condition is opened
    assert opened.key == condition_key(ConditionKind.NVME_LATENCY, "node-1", "nvme0n1")
    assert (opened.active, opened.since, opened.severity) == (True, 10.0, "warning")
    assert (opened.reason, opened.value, opened.threshold) == ("slow", 400.0, 100.0)
    hotter = latch.restate(11.0, reason="slower", value=900.0, severity=Severity.CRITICAL)
    assert latch.condition is hotter and hotter.key == opened.key and hotter.since == 11.0
    change = latch.update(False, 12.0)
    assert change is Change.CLEARED and not latch.open
    closed = latch.record(change, 12.0, reason="fine", value=20.0)
    assert closed.key == opened.key and latch.condition is None
    assert (closed.active, closed.since, closed.severity) == (False, 12.0, "critical")
    with pytest.raises(RuntimeError):
        latch.restate(13.0, reason="not open")


def test_one_latch_per_subject() -> None:
    latches = ConditionLatches(
        ConditionKind.PCIE, "n", severity=Severity.WARNING, confirm=2, hold_s=1.0
    )
    assert latches["0"] is latches["0"] and latches["0"] is not latches["1"]
    assert (latches["1"].subject, latches["1"].latch.confirm) == ("1", 2)
