"""A notice or a checkpoint asked for while every rank is inside a phase (an evaluation,
the framework's own save, a long data load: no step boundary for a while) is honoured
there, before its deadline, not when the phase ends or the notice's grace runs out.

Inside a phase the training state is still the one of the last step boundary (a phase
trains nothing), so it can be saved then as at that boundary, by every rank together.
Each rank runs a watch thread while its loop is inside a phase: every :data:`ROUND_S` the
watches sum, on a gloo group of their own, whether their rank is inside a phase, has a
notice (SIGTERM, Slurm's USR1), or (rank 0) holds a checkpoint or stop word not yet
carried out, and at which step. When one asks and all are inside at one step, the next
round also *holds* each loop inside its phase (its exit waits); when every rank holds, all
save together — the durable checkpoint the session writes, or a memory-tier snapshot when
the framework writes the durable ones — and after a notice leave, as at a boundary. Once
any rank has left its phase, the watches stop and the next boundary decides as usual.

A loop's exit from a phase never waits on a round that is still gathering: it waits only
while its rank holds, which it does only in a round right after every rank was inside.
Phases that not every rank enters (an evaluation on the main process only, a common
accelerate pattern) are not watched: that rank's watch waits in its round until the others
enter a phase, nothing else waits on it but the loop's end (at most :data:`CLOSE_S`), and
a notice during such a phase keeps the grace.
"""

from __future__ import annotations

import enum
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringmaster.rank.control import same_on_every_rank

ROUND_S = 0.5  # how often the watches of ranks inside a phase compare what they hold
CLOSE_S = 10.0  # the most the loop's end waits for the watches' last round


@dataclass(frozen=True)
class Mine:
    """What one rank brings to a round."""

    inside: bool  # its loop is inside a phase
    asks: bool  # a notice, or a checkpoint or stop word not yet carried out
    notice: bool
    held: bool  # its loop's exit from the phase waits on this round
    step: int
    seq: int = 0  # rank 0: the newest checkpoint or stop word's seq (0: none)


@dataclass(frozen=True)
class Asked:
    """What a rank asks of the watch: a save (``notice``: and to leave after it), for the
    words up to ``seq`` (rank 0's)."""

    asks: bool = False
    notice: bool = False
    seq: int = 0


NOTHING = Asked()


class Next(enum.Enum):
    WAIT = "wait"  # nothing asked: the next round in ROUND_S
    HOLD = "hold"  # asked, every rank inside at one step: the next round at once, holding
    SAVE = "save"  # every rank holds at one step: save together now
    END = "end"  # some rank left its phase (or the steps differ): the boundary decides


@dataclass(frozen=True)
class Totals:
    ranks: int
    inside: int
    asks: int
    notice: int
    held: int
    steps: int
    squares: int
    seq: int

    @classmethod
    def of(cls, values: list[float]) -> Totals:
        return cls(*(round(v) for v in values))


def vector(mine: Mine) -> list[float]:
    """A rank's part of a round's sum (:class:`Totals` in the same order)."""
    flags = (mine.inside, mine.asks, mine.notice, mine.held)
    return [1.0, *map(float, flags), float(mine.step), float(mine.step) ** 2, float(mine.seq)]


def decide(totals: Totals) -> Next:
    """What every rank does after a round, alike on all of them (they read one sum)."""
    same_step = same_on_every_rank(totals.ranks, totals.steps, totals.squares)
    if totals.inside < totals.ranks or not same_step:
        return Next.END
    if totals.held == totals.ranks:
        return Next.SAVE
    return Next.HOLD if totals.asks else Next.WAIT


class PhaseWatch:
    """One rank's watch. ``asks()``: what this rank brings now (its ``step`` is ignored:
    ``step()`` gives the last boundary's); ``save(notice, seq)``: save as at that boundary
    for the words up to ``seq``, and leave after a notice."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        asks: Callable[[], Asked],
        step: Callable[[], int],
        save: Callable[[bool, int], None],
    ) -> None:
        self._group = group
        self._asks = asks
        self._step = step
        self._save = save
        self._cond = threading.Condition()
        self._depth = 0  # phases the loop is inside (they nest)
        self._held = False
        self._busy = False  # in rounds
        self._closed = False
        self._thread: threading.Thread | None = None

    def enter(self) -> None:
        with self._cond:
            self._depth += 1
            self._cond.notify_all()
            if self._thread is None and dist.is_initialized():
                self._thread = threading.Thread(target=self._run, name="phase-watch", daemon=True)
                self._thread.start()

    def leave(self) -> None:
        """The loop leaves a phase: at once, unless its rank holds in a round now."""
        with self._cond:
            while self._held:
                self._cond.wait()
            self._depth -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """The loop ended (every rank, outside any phase): wait for the last round, which
        every watch ends alike, so that no collective of it outlives the process group."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._busy, timeout=CLOSE_S)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._depth == 0 and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._busy = True
            try:
                self._watch()
            except Exception as exc:  # a peer gone, the group torn down: watch no more
                print(f"phase-watch: stopped: {exc}", file=sys.stderr, flush=True)
                return
            finally:
                with self._cond:
                    self._busy = False
                    self._held = False
                    self._cond.notify_all()

    def _watch(self) -> None:
        """Rounds from a phase's entry until one ends them (then this rank's loop leaves
        its phase before the next entry starts the next rounds: every rank's watch does
        the same rounds, by count)."""
        hold = False
        while True:
            totals = self._round(hold)
            after = decide(totals)
            if after is Next.SAVE:
                self._save(totals.notice > 0, totals.seq)  # no return after a notice
            hold = after is Next.HOLD
            self._release()
            if after is Next.END:
                with self._cond:
                    while self._depth > 0:
                        self._cond.wait()
                return
            if after is Next.WAIT:
                time.sleep(ROUND_S)

    def _round(self, hold: bool) -> Totals:
        with self._cond:
            inside = self._depth > 0
            asked = self._asks() if inside else NOTHING
            self._held = hold and inside
            mine = Mine(inside, asked.asks, asked.notice, self._held, self._step(), asked.seq)
        summed = torch.tensor(vector(mine), dtype=torch.float64)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self._group)
        return Totals.of(summed.tolist())

    def _release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()
