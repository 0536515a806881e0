"""When a fault is the same fault coming back: "the same place" in training, and a numeric
fault's run of recurrences. One rule, shared by the rank (its own backstop on rewinds,
``trainer.numeric``) and the coordinator (the restart and rewind budgets,
``coordinator.job_machine`` and ``coordinator.numeric_policy``).

A rewind or a restart goes back to the newest checkpoint, at most a checkpoint interval
before the fault. A fault that comes again before the job has trained
:func:`same_place_steps` past the last one (before a checkpoint beyond that fault can have
sealed, so the next recovery goes back over the same ground), or on the same data, is that
fault coming back. One further on starts afresh: a job that runs for weeks meets unrelated
faults, and each of them gets the whole budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

MIN_SAME_PLACE_STEPS = 10  # the margin for jobs that checkpoint very often


def same_place_steps(every_steps: int) -> int:
    """How many steps apart two faults still count as the same place: a checkpoint
    interval (``checkpoint.every_steps``), at least :data:`MIN_SAME_PLACE_STEPS`."""
    return max(MIN_SAME_PLACE_STEPS, every_steps)


class NumericFault(msgspec.Struct, kw_only=True):
    """A numeric fault (a non-finite loss or gradient norm, a gradient-norm explosion) as
    the budgets compare them: the step it happened in, the data position that step trained
    on (None: unknown), the one node whose ranks alone computed non-finite values ("": none
    such, as when every rank did, or none did in a norm explosion, or a one-node job),
    why, and when the coordinator took it (wall seconds; 0 in the rank's own count)."""

    step: int
    position: int | None = None
    node: str = ""
    reason: str = ""
    at: float = 0.0


def recurs(new: NumericFault, old: NumericFault, margin: int) -> bool:
    """Whether ``new`` is ``old`` coming back: within ``margin`` steps after it (or before
    it, a restart having gone further back), or on the same data position."""
    same_data = new.position is not None and new.position == old.position
    return new.step <= old.step + margin or same_data


def recurring(faults: Sequence[NumericFault], margin: int) -> list[NumericFault]:
    """The newest fault of ``faults`` and the run it closes, oldest first: each fault of
    the run is the one before it coming back (:func:`recurs`)."""
    if not faults:
        return []
    run = [faults[-1]]
    for old in reversed(faults[:-1]):
        if not recurs(run[-1], old, margin):
            break
        run.append(old)
    return run[::-1]
