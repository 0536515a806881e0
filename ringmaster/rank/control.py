"""Step-boundary control: every rank acts on the same control word at the same step.

Only rank 0 hears the agent. At each step boundary it folds the words that arrived since
the last boundary into one :class:`Decision`, and every rank receives it, so all ranks
pause, checkpoint or stop at the same step and none is left inside a collective the others
never enter.

While training, the decision costs no collective of its own: it rides in the all-reduce
that averages the step's loss (:meth:`StepControl.reduce_step`, a small float64 sum to which
only rank 0 adds the word), so the boundary after a step needs nothing more. The first
boundary, and every boundary while paused, sums it alone (:meth:`StepControl.exchange`).
A user's loop, whose collectives are its own, takes one small all-reduce per step on the
rank API's gloo group (:meth:`StepControl.agree`), which also checks that every rank is at
the same step; it runs in the background during the next step, whose boundary acts on it.
The same sum carries what every rank must judge alike or rank 0 must see from all:
rank 0's global gradient norm and each rank's compute seconds in its own slot (the
built-in trainer judges them: :mod:`trainer.numeric`, :mod:`trainer.probe`). Summed, a
slot only one rank fills arrives intact.

While paused, rank 0 waits up to :data:`PAUSE_POLL_S` for a word and every rank joins a
sum at that cadence. No rank ever sits in a collective for longer than that (well
inside any process-group timeout), and a resume, checkpoint or stop takes effect within
one poll.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from proto.progress import ControlAction, ControlWord
from ringmaster.rank.agent_link import AgentLink

PAUSE_POLL_S = 0.2


def _code(action: ControlAction) -> int:
    return list(ControlAction).index(action) + 1


class Action(enum.IntEnum):
    """A decision's action as it rides in the step's float64 all-reduce: 0 for none, else
    its place in ``proto.progress.ControlAction`` (a checkpoint rides beside it, as it goes
    with any of them). Names and codes come from there."""

    NONE = 0
    PAUSE = _code(ControlAction.PAUSE)
    RESUME = _code(ControlAction.RESUME)
    STOP = _code(ControlAction.STOP)


@dataclass(frozen=True)
class Decision:
    action: Action = Action.NONE
    checkpoint: bool = False
    seq: int = 0  # seq of the newest word folded in (for logs)
    notice: bool = False  # some rank got a notice (SIGTERM, ringmaster.rank.termination)


NOTHING = Decision()
UNKNOWN_NORM = -1.0  # no gradient norm reported (see trainer.numeric)


class StepTotals(NamedTuple):
    """What the step's all-reduce gives every rank alike."""

    loss: float  # averaged over the ranks; non-finite if any rank's was
    decision: Decision
    grad_norm: float  # rank 0's global gradient norm (UNKNOWN_NORM if none)
    compute_s: list[float]  # each rank's compute seconds, by rank


def fold(words: Sequence[ControlWord]) -> Decision:
    """One decision from the words pending at a boundary, oldest first.

    The newest pause/resume wins, a stop wins over both (it is final), and a checkpoint
    request is kept alongside whichever of them wins rather than being overwritten.
    """
    action = Action.NONE
    asked = [ControlAction(w.action) for w in words]  # decoded words are; built ones may not be
    for word in asked:
        if word is not ControlAction.CHECKPOINT and action != Action.STOP:
            action = Action[word.name]
    checkpoint = ControlAction.CHECKPOINT in asked
    return Decision(action, checkpoint, words[-1].seq if words else 0)


class StepDisagreement(RuntimeError):
    """The ranks reached the boundary with different steps: a loop bug, one line."""


class Agreed(NamedTuple):
    """A user loop's agreement: the decision, the same on every rank, and in how many
    steps from this agreement's the next one starts (rank 0's word)."""

    decision: Decision
    every: int


class StepControl:
    """The per-boundary exchange. ``enabled=False`` carries no control word at all (no fold,
    no broadcast): only the benchmark uses it, to measure what the word costs. ``group``:
    the process group the word travels on (None: the default group); ``notice``: whether
    this rank got a notice (:func:`ringmaster.rank.termination.noticed`), carried by every rank."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        link: AgentLink | None,
        *,
        enabled: bool = True,
        group: dist.ProcessGroup | None = None,
        notice: Callable[[], bool] = lambda: False,
    ) -> None:
        self.rank = rank
        self.device = device
        self.link = link
        self.enabled = enabled
        self.group = group
        self.notice = notice

    def exchange(self, wait_s: float = 0.0) -> Decision:
        """The decision for this boundary, identical on every rank. Rank 0 waits up to
        ``wait_s`` for a word when none is pending (the paused cadence)."""
        if not self.enabled:
            return NOTHING
        word = torch.tensor(self._word(wait_s), dtype=torch.float64, device=self.device)
        self._sum(word)
        return _decision(word.tolist())

    def agree(self, step: int, every: int = 1) -> Callable[[], Agreed]:
        """A user loop's boundary after ``step``, on every rank: starts one all-reduce of
        the word, of ``step`` and its square and of rank 0's ``every`` (in how many steps
        the next agreement starts), in the background, and returns what to call for its
        result (the next boundary calls it, so the collective overlaps the next step
        instead of waiting on the slower rank here). Every rank also learns, alike,
        whether all of them reached the same step (:class:`StepDisagreement` on every rank
        if not)."""
        word = self._word(0.0)
        cadence = float(every) if self.rank == 0 else 0.0
        vector = torch.tensor([*word, 1.0, step, step * step, cadence], dtype=torch.float64)
        work = None
        if dist.is_initialized():
            work = dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

        def result() -> Agreed:
            if work is not None:
                work.wait()
            *total, ranks, steps, squares, cadence = vector.tolist()
            if not same_on_every_rank(ranks, steps, squares):
                raise StepDisagreement(
                    f"step {step} on rank {self.rank}, but the ranks' steps average "
                    f"{steps / ranks:g}: every rank must call step() once per step, with "
                    "the same step"
                )
            return Agreed(_decision(total), max(1, int(cadence)))

        return result

    def reduce_step(
        self,
        loss: torch.Tensor,
        world_size: int,
        grad_norm: torch.Tensor | float | None = None,
        compute_s: float = 0.0,
    ) -> StepTotals:
        """End of a step, on every rank: one all-reduce of ``[loss, norm, word…, seconds
        by rank…]`` gives the loss averaged over the ranks, rank 0's decision for the
        boundary that follows and gradient norm, and every rank's compute seconds."""
        word = self._word(0.0)
        vector = torch.zeros(2 + len(word) + world_size, dtype=torch.float64, device=loss.device)
        vector[0] = loss.detach().to(torch.float64)
        if self.rank == 0:
            norm = UNKNOWN_NORM if grad_norm is None else grad_norm
            vector[1] = norm.detach().to(torch.float64) if isinstance(norm, torch.Tensor) else norm
        vector[2 : 2 + len(word)] = torch.tensor(word, dtype=torch.float64)
        vector[2 + len(word) + self.rank] = compute_s
        dist.all_reduce(vector, op=dist.ReduceOp.SUM)
        total, norm_sum, *rest = vector.tolist()
        return StepTotals(
            total / world_size, _decision(rest[: len(word)]), norm_sum, rest[len(word) :]
        )

    def _sum(self, vector: torch.Tensor) -> None:
        """Sum ``vector`` over the ranks in place (a lone process without a process group
        has nobody to sum with)."""
        if dist.is_initialized():
            dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=self.group)

    def _word(self, wait_s: float) -> list[float]:
        """Rank 0: the pending words folded into (action, checkpoint, seq); other ranks
        (and a disabled control) contribute zeros, which is NOTHING. Every rank adds its
        notice flag: summed, any rank's notice is everyone's."""
        notice = float(self.enabled and self.notice())
        if not (self.enabled and self.rank == 0):
            return [0.0, 0.0, 0.0, notice]
        decision = fold(self._pending(wait_s))
        return [float(decision.action), float(decision.checkpoint), float(decision.seq), notice]

    def _pending(self, wait_s: float) -> list[ControlWord]:
        if self.link is None:  # nothing can arrive; keep the cadence anyway
            time.sleep(wait_s)
            return []
        words = self.link.drain()
        if not words and wait_s:
            with contextlib.suppress(queue.Empty):
                words = [self.link.controls.get(timeout=wait_s), *self.link.drain()]
        return words


def same_on_every_rank(ranks: float, total: float, squares: float) -> bool:
    """Whether every rank gave the same value, from one sum of the ranks' count, their
    values and their values' squares (equal only then: no second collective needed)."""
    return total * total == ranks * squares


def _decision(word: list[float]) -> Decision:
    action, checkpoint, seq, notice = word
    return Decision(Action(int(action)), bool(checkpoint), int(seq), notice > 0)
