"""The training loop: steps, step-boundary control, checkpoints and progress reports.

``step`` counts completed optimizer steps and is global: a resumed job continues from the
checkpoint's step to the same ``train.steps``, and the data for each step is a pure
function of it and the data offset saved with it (:mod:`trainer.data`, raised only by
numeric-fault rewinds, :mod:`trainer.numeric`), so a resumed run trains on exactly the
samples an uninterrupted one would.

After the first step of the process, when every engine's optimizer state exists, the
engine starts allocating the next checkpoint's host buffers in the background
(:meth:`trainer.engine.Engine.prepare_snapshot`), so the first checkpoint stalls no longer
than later ones.

Restore, checkpoints, the memory tier, pauses, stops and the beat are the rank API's
(:class:`ringmaster.rank.session.Session`), exactly as a user's loop gets them: this loop
registers its engine as the state and its data offset as its position, and carries the
session's control word in its step's loss all-reduce.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from proto.job import JobSpec
from proto.progress import Progress, StepDone
from proto.recurrence import same_place_steps
from ringmaster.rank.control import Decision, StepControl
from ringmaster.rank.log import Log
from ringmaster.rank.session import COMPLETED, NOTICED, STOPPED, Outcome, Session
from ringmaster.rankbeat import CHECKPOINT
from trainer import numeric
from trainer.compile import CompileClock
from trainer.data import Batches
from trainer.engine import Engine
from trainer.flops import Mfu
from trainer.probe import StepProbe, StragglerWindow


@dataclass(frozen=True)
class Hooks:
    """Test and benchmark hooks (environment variables, see :mod:`trainer.worker`)."""

    persist_delay_s: float = 0.0
    persist_gate: Path | None = None  # persists wait for this file before serialising
    trace_dir: Path | None = None  # per-rank JSON lines: step, sample ids, loss
    control_word: bool = True
    ddp_share: bool = True  # False: each DDP rank stages the whole state (baseline)


class DataPosition:
    """The built-in loop's position in its data beside the step: the offset numeric-fault
    rewinds raise (the data of step s is batch(s + offset)), kept in each rank's file."""

    def __init__(self) -> None:
        self.offset = 0

    def state_dict(self) -> dict[str, Any]:
        return {"data_offset": self.offset}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.offset = state.get("data_offset", 0)


class Trainer:
    def __init__(
        self,
        spec: JobSpec,
        engine: Engine,
        batches: Batches,
        session: Session,
        log: Log,
        hooks: Hooks,
        *,
        mfu: Mfu,
        compiled: bool,
        probe: StepProbe | None = None,
    ) -> None:
        self.spec = spec
        self.engine = engine
        self.batches = batches
        self.session = session
        self.control: StepControl = session.control
        self.log = log
        self.hooks = hooks
        self.target = spec.train.steps
        self.rank = batches.rank
        self.tokens_per_step = (
            spec.train.micro_batch_size * spec.train.seq_len * batches.layout.world_size
        )
        self.mfu = mfu
        self.compile_clock = CompileClock(compiled)
        self.steps_run = 0  # by this process
        self.beat = session.beat  # the phase and steps the node agent judges hangs by
        policy = spec.policy  # numeric faults and stragglers (trainer.numeric, trainer.probe)
        self.position = DataPosition()
        self.guard = numeric.NumericGuard(policy.grad_norm_spike)
        margin = same_place_steps(spec.checkpoint.every_steps)
        self.rewinds = numeric.Rewinds(policy.max_rewinds, margin)
        self.probe = probe or StepProbe(engine.module, torch.device("cpu"))
        self.window = StragglerWindow(policy.straggler_window_steps) if self.rank == 0 else None

    @property
    def step(self) -> int:
        return self.session.step

    @property
    def data_offset(self) -> int:
        return self.position.offset

    def resume(self) -> None:
        """Load the newest checkpoint every rank can verify, if there is one: the memory
        tier's when it is newer than the durable one."""
        self.session.restore()
        self.session.announce()

    def _rewind(self, reason: str, local_bad: bool, device: torch.device) -> None:
        """After a numeric fault in the step at ``self.step``, on every rank alike: back to
        the newest durable checkpoint, skipping the data trained on since it. ``local_bad``:
        this rank's own loss was not finite."""
        world = self.batches.layout.world_size
        ranks = numeric.nonfinite_ranks(local_bad, self.rank, world, device)
        # NumericFault once the same fault keeps coming back
        self.rewinds.admit(self.step + 1, self.step + self.data_offset, reason)
        checkpointer = self.session.checkpointer
        assert checkpointer is not None
        # a persist in flight predates the fault: let it seal; then what the memory tier
        # holds past the checkpoint is suspect
        checkpointer.forget_memory_together()
        bad, offset = self.step, self.data_offset
        if not self.session.reload_durable():
            raise numeric.no_checkpoint(self.step + 1, reason)
        rewind = numeric.plan(self.step, bad, offset, reason)
        self.position.offset = rewind.offset
        said = ",".join(map(str, ranks)) or "none"
        self.log("rewound", **dataclasses.asdict(rewind), rewinds=self.rewinds.count, ranks=said)
        self._send(rewind.message(ranks))

    def run(self) -> Outcome:
        """Train to the target step or until stopped; the outcome, once its final
        checkpoint is durable."""
        self.log("start", step=self.step, target=self.target)
        outcome: Outcome = COMPLETED
        decision = self.control.exchange()  # the first boundary: no step to carry it
        while True:
            ending = self.session.boundary(decision)
            if ending == NOTICED:
                self.session.leave_for_notice()
            if ending == STOPPED:
                outcome = STOPPED
                break
            if self.step >= self.target:
                break
            decision = self._train_step()
            self.session.periodic()  # (a rewind lands on a checkpoint)
        self.session.finish(outcome)
        return outcome

    def _train_step(self) -> Decision:
        """One optimizer step; returns the control decision for the boundary after it."""
        start = time.perf_counter()
        inputs, targets = self.batches.batch(self.step + self.data_offset)
        if self.probe.begin():
            self.log("sim_nan_loss", step=self.step + 1)
        local_loss, grad_norm = self.engine.step(inputs, targets)
        compute_s = self.probe.end(time.perf_counter() - start)
        world = self.batches.layout.world_size
        with self.beat.in_collective():  # a stall in here waits for a peer (NCCL syncs here)
            totals = self.control.reduce_step(local_loss, world, grad_norm, compute_s)
        loss, decision = totals.loss, totals.decision
        elapsed = time.perf_counter() - start
        if self.hooks.trace_dir is not None:
            self._trace(loss)
        if (fault := self.guard.check(loss, totals.grad_norm)) is not None:
            local_bad = not bool(torch.isfinite(local_loss.detach()).all())
            with self.beat.during(CHECKPOINT):  # loading a checkpoint makes no steps
                self._rewind(fault, local_bad, local_loss.device)
            return decision
        step = self.step + 1
        if self.window is not None and (report := self.window.add(step, totals.compute_s)):
            self._send(report)
        self.steps_run += 1
        self.session.stepped(step, elapsed)
        if self.steps_run == 1:
            self.engine.prepare_snapshot()
        tokens_per_s = self.tokens_per_step / elapsed
        mfu = self.mfu.of(tokens_per_s)
        compile_s = self.compile_clock.record(elapsed)
        if compile_s is not None:
            self.log("compiled", step=step, compile_s=compile_s)
        if step % self.spec.train.log_every == 0 or step == self.target:
            extra = {} if mfu is None else {"mfu": round(mfu, 4)}
            self.log(
                "step",
                step=step,
                loss=loss,
                step_s=elapsed,
                tok_s=round(tokens_per_s),
                **extra,
            )
        checkpointer = self.session.checkpointer
        self._send(
            StepDone(
                step=step,
                loss=loss,
                step_time_s=elapsed,
                tokens_per_s=tokens_per_s,
                target_steps=self.target,
                model_flops_per_token=self.mfu.flops_per_token,
                mfu=mfu,
                compile_s=compile_s,
                memory_step=checkpointer.memory_sealed if checkpointer is not None else None,
                durable_step=checkpointer.durable_step if checkpointer is not None else None,
            )
        )
        return decision

    def _send(self, message: Progress) -> None:
        self.session.send(message)

    def _trace(self, loss: float) -> None:
        assert self.hooks.trace_dir is not None
        ids = self.batches.ids(self.step + self.data_offset)
        record = {"step": self.step, "ids": ids, "loss": loss}
        with (self.hooks.trace_dir / f"trace-rank-{self.rank}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
