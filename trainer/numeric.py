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

Which ranks saw it: the loss every rank judges is the sum over the ranks, non-finite on
all of them when one rank's own loss was. At a fault (never in a step that trains) every
rank adds its own flag to one more all-reduce, so the report names the ranks whose own
loss was not finite: the coordinator tells one node computing wrong numbers from a model
or data that fail everywhere.

The coordinator judges a fault that keeps coming back (:mod:`proto.recurrence`): past
``policy.max_rewinds`` rewinds of the same fault it fails the job, or holds the one node
it comes back on. The rank's own bound is a backstop for a report nobody acted on (no
leader at that moment): the same run of recurrences one longer than the coordinator's
ends the process with the evidence (exit 1). Faults far apart are each rewound afresh.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from proto.progress import RANKS_SAID, Rewound
from proto.recurrence import NumericFault as Seen
from proto.recurrence import recurring

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

    def message(self, ranks: list[int]) -> Rewound:
        """The report, naming the lowest :data:`proto.progress.RANKS_SAID` of ``ranks``
        (a diverging model makes every rank's loss non-finite, and a report must stay a
        small message however large the job)."""
        return Rewound(
            step=self.step,
            from_step=self.from_step,
            skip_from=self.skip_from,
            skip_to=self.skip_to,
            reason=self.reason,
            ranks=ranks[:RANKS_SAID],
            nonfinite=len(ranks),
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
    """The rank's backstop on a numeric fault that keeps coming back: the run of
    recurrences (:func:`proto.recurrence.recurring`) may be one longer than
    ``policy.max_rewinds`` allows the coordinator's (which acts on the report of each
    rewind), then the rank gives up. ``count``: every rewind of this process."""

    def __init__(self, max_rewinds: int, margin: int) -> None:
        self.max_rewinds, self.margin = max_rewinds, margin
        self.run: list[Seen] = []  # the current run of recurrences, oldest first
        self.count = 0

    def admit(self, from_step: int, position: int, reason: str) -> None:
        """Count one more rewind of the fault in step ``from_step`` (trained on data
        ``position``), or raise :class:`NumericFault` once its run is past the backstop."""
        run = recurring([*self.run, Seen(step=from_step, position=position)], self.margin)
        if len(run) > self.max_rewinds + 1:
            steps = ", ".join(str(f.step) for f in run)
            raise NumericFault(
                f"numeric fault at step {from_step} ({reason}): {len(run)} times in a row "
                f"within {self.margin} steps of each other or on the same data (steps "
                f"{steps}) in this process (policy.max_rewinds={self.max_rewinds}); giving up"
            )
        self.run = run
        self.count += 1


def nonfinite_ranks(bad: bool, rank: int, world_size: int, device: torch.device) -> list[int]:
    """The ranks whose own loss was not finite (``bad`` is this rank's): one all-reduce of
    a flag per rank. Every rank calls it at the same step, the fault being judged on values
    every rank shares; a lone process has nobody to ask."""
    if not dist.is_initialized():
        return [rank] if bad else []
    flags = torch.zeros(world_size, dtype=torch.float32, device=device)
    flags[rank] = float(bad)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    return [r for r, flag in enumerate(flags.tolist()) if flag > 0]


def no_checkpoint(from_step: int, reason: str) -> NumericFault:
    return NumericFault(
        f"numeric fault at step {from_step} ({reason}) and no durable checkpoint to rewind to"
    )
