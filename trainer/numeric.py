"""Numeric faults: when a step's loss or gradients blow up, go back to the newest durable
checkpoint and skip the data that led there.

A non-finite loss, a non-finite global gradient norm, or a norm above
``policy.grad_norm_spike`` × the median of the recent finite norms means the weights can
no longer be trusted, and training on from them wastes every GPU-second after. Restarting
the job would reload the same checkpoint and replay the same batches, so the fault would
likely recur: instead every rank rewinds in-process and moves past the offending window of
data.

Every rank decides the same way at the same step without a collective of its own: the
loss and the gradient norm it judges are the values all-reduced with the step's control
word (:meth:`ringmaster.rank.control.StepControl.reduce_step`), identical on every rank, and the
detector's history is built from them alone.

Data skipping: the data of step ``s`` is ``Batches.batch(s + offset)``. A rewind from the
step at 0-based index ``bad`` to the checkpoint of step ``c`` raises ``offset`` by
``bad − c + 1``, so the data positions ``[c + offset, bad + offset]`` (everything trained
since that checkpoint, the bad step included) are never trained on again. The offset is
saved with every checkpoint (the trainer state), so a restart from a later checkpoint
keeps skipping; one from the same checkpoint before a newer is sealed replays the window,
and rewinds again if it faults again.

The loop is bounded: past ``policy.max_rewinds`` rewinds in one process the rank exits 1
with the evidence (the coordinator counts rewinds across restarts as well).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from proto.progress import Rewound

HISTORY = 50  # finite gradient norms the spike median is taken over
WARMUP = 10  # norms needed before a spike can be judged (early training is erratic)


class NumericFault(Exception):
    """The rank cannot (or may no longer) rewind: one line of evidence for the operator."""


class NumericGuard:
    """Judges each step's all-reduced loss and global gradient norm."""

    def __init__(self, spike: float, history: int = HISTORY, warmup: int = WARMUP) -> None:
        self.spike = spike
        self.warmup = warmup
        self.norms: deque[float] = deque(maxlen=history)

    def check(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is a numeric fault, or None. A negative ``grad_norm`` is unknown
        (not judged). A faulty step's norm stays out of the history."""
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if grad_norm < 0:
            return None
        if not math.isfinite(grad_norm):
            return f"non-finite gradient norm {grad_norm}"
        if len(self.norms) >= self.warmup:
            median = statistics.median(self.norms)
            if grad_norm > self.spike * median:
                return (
                    f"gradient norm {grad_norm:.4g} > {self.spike:g} x median {median:.4g} "
                    f"of the last {len(self.norms)} steps"
                )
        self.norms.append(grad_norm)
        return None


@dataclass(frozen=True)
class Rewind:
    """One rewind's bookkeeping: back to ``step`` from ``from_step`` (the step the fault
    would have completed), data positions ``[skip_from, skip_to)`` skipped, the new data
    offset, and why."""

    step: int
    from_step: int
    skip_from: int
    skip_to: int
    offset: int
    reason: str

    def message(self) -> Rewound:
        return Rewound(
            step=self.step,
            from_step=self.from_step,
            skip_from=self.skip_from,
            skip_to=self.skip_to,
            reason=self.reason,
        )


def plan(checkpoint_step: int, bad_step: int, offset: int, reason: str) -> Rewind:
    """The rewind from the step at 0-based index ``bad_step`` (trained on data position
    ``bad_step + offset``) to the checkpoint of ``checkpoint_step``."""
    if checkpoint_step > bad_step:
        raise ValueError(f"checkpoint step {checkpoint_step} is after the fault at {bad_step}")
    return Rewind(
        step=checkpoint_step,
        from_step=bad_step + 1,
        skip_from=checkpoint_step + offset,
        skip_to=bad_step + offset + 1,
        offset=offset + bad_step - checkpoint_step + 1,
        reason=reason,
    )


class Rewinds:
    """The per-process budget of rewinds (``policy.max_rewinds``)."""

    def __init__(self, max_rewinds: int) -> None:
        self.max_rewinds = max_rewinds
        self.count = 0

    def admit(self, from_step: int, reason: str) -> None:
        """Count one more rewind, or raise :class:`NumericFault` once the budget is spent."""
        if self.count >= self.max_rewinds:
            raise NumericFault(
                f"numeric fault at step {from_step} ({reason}) after {self.count} rewinds "
                f"in this process (policy.max_rewinds={self.max_rewinds}); giving up"
            )
        self.count += 1


def no_checkpoint(from_step: int, reason: str) -> NumericFault:
    return NumericFault(
        f"numeric fault at step {from_step} ({reason}) and no durable checkpoint to rewind to"
    )
