"""The training loop: steps, step-boundary control, checkpoints and progress reports.

``step`` counts completed optimizer steps and is global: a resumed job continues from the
checkpoint's step to the same ``train.steps``, and the data for each step is a pure
function of it (:mod:`trainer.data`), so a resumed run trains on exactly the samples an
uninterrupted one would.

After the first step of the process, when every engine's optimizer state exists, the
engine starts allocating the next checkpoint's host buffers in the background
(:meth:`trainer.engine.Engine.prepare_snapshot`), so the first checkpoint stalls no longer
than later ones.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from proto.job import JobSpec
from proto.progress import Checkpointed, Paused, Progress, Resumed, StepDone
from trainer import durable
from trainer.agent_link import AgentLink
from trainer.checkpoint import Checkpointer, find_resumable, load_file
from trainer.compile import CompileClock
from trainer.control import PAUSE_POLL_S, Action, Decision, StepControl
from trainer.data import Batches
from trainer.engine import Engine
from trainer.flops import Mfu
from trainer.log import Log

Outcome = Literal["completed", "stopped"]
COMPLETED: Outcome = "completed"
STOPPED: Outcome = "stopped"


@dataclass(frozen=True)
class Hooks:
    """Test and benchmark hooks (environment variables, see :mod:`trainer.worker`)."""

    persist_delay_s: float = 0.0
    persist_gate: Path | None = None  # persists wait for this file before serialising
    trace_dir: Path | None = None  # per-rank JSON lines: step, sample ids, loss
    control_word: bool = True
    ddp_share: bool = True  # False: each DDP rank stages the whole state (baseline)


class ResumeError(Exception):
    """Checkpoints exist but none can be resumed (one line, for the operator)."""


class Trainer:
    def __init__(
        self,
        spec: JobSpec,
        engine: Engine,
        batches: Batches,
        checkpointer: Checkpointer,
        control: StepControl,
        link: AgentLink | None,
        log: Log,
        hooks: Hooks,
        *,
        mfu: Mfu,
        compiled: bool,
    ) -> None:
        self.spec = spec
        self.engine = engine
        self.batches = batches
        self.checkpointer = checkpointer
        self.control = control
        self.link = link
        self.log = log
        self.hooks = hooks
        self.step = 0
        self.target = spec.train.steps
        self.rank = batches.rank
        self.tokens_per_step = (
            spec.train.micro_batch_size * spec.train.seq_len * batches.layout.world_size
        )
        self.mfu = mfu
        self.compile_clock = CompileClock(compiled)
        self.steps_run = 0  # by this process
        checkpointer.on_durable = self._durable

    def resume(self) -> None:
        """Load the newest checkpoint every rank can verify, if there is one."""
        root, coord = self.checkpointer.root, self.checkpointer.coord
        found = find_resumable(root, coord, self._files_for)
        if found is None:
            why = coord.broadcast(self._unusable() if self.rank == 0 else None)
            if why is not None:
                raise ResumeError(why)
            self.log("fresh_start")
            return
        manifest, step_dir = found
        self.engine.load(step_dir, manifest)
        state = load_file(step_dir / self._trainer_file(manifest))
        torch.set_rng_state(state["rng"]["cpu"])
        if torch.cuda.is_available() and "cuda" in state["rng"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.step = state["step"]
        self.checkpointer.last_step = self.checkpointer.durable_step = self.step
        self.log("resumed_from", step=self.step, path=step_dir)

    def _unusable(self) -> str | None:
        """Why sealed checkpoints exist that this run cannot load, if they do: starting
        from step 0 next to them would silently throw their training away."""
        root = self.checkpointer.root
        for name in durable.candidates(root):
            manifest = durable.read_manifest(root / name)
            if manifest is not None:
                return (
                    f"{root} holds checkpoints (newest {name}: {manifest.engine}, "
                    f"world size {manifest.world_size}) that this run ({self.engine.name}, "
                    f"world size {self.batches.layout.world_size}) cannot load or verify; "
                    "resume with their engine and world size, or move them away to start fresh"
                )
        return None

    def _files_for(self, manifest: durable.Manifest) -> list[str] | None:
        """What this rank verifies and loads: the engine's files plus its trainer state."""
        engine_files = self.engine.files_for(manifest)
        return None if engine_files is None else [*engine_files, self._trainer_file(manifest)]

    def _trainer_file(self, manifest: durable.Manifest) -> str:
        """This rank's step and RNG; rank 0's if the world size changed (the step is the
        same on every rank)."""
        same_world = manifest.world_size == self.batches.layout.world_size
        return durable.trainer_file(self.rank if same_world else 0)

    def run(self) -> Outcome:
        """Train to the target step or until stopped; the outcome, once its final
        checkpoint is durable."""
        self.log("start", step=self.step, target=self.target)
        outcome: Outcome = COMPLETED
        decision = self.control.exchange()  # the first boundary: no step to carry it
        while True:
            if self._boundary(decision) == STOPPED:
                outcome = STOPPED
                break
            if self.step >= self.target:
                break
            decision = self._train_step()
            if self.step % self.spec.checkpoint.every_steps == 0:
                self._checkpoint()
        if self.checkpointer.last_step != self.step:
            self._checkpoint()
        self.checkpointer.wait()
        if self.checkpointer.durable_step != self.step:
            raise RuntimeError(f"the final checkpoint (step {self.step}) did not become durable")
        self.log("finished", step=self.step, outcome=outcome)
        return outcome

    def _boundary(self, decision: Decision) -> Outcome | None:
        """Act on this boundary's control decision; while paused, keep polling for the
        next one. Returns STOPPED when the job must stop here."""
        paused = False
        while True:
            if decision.checkpoint or decision.action == Action.STOP:
                self._checkpoint()
            if decision.action == Action.STOP:
                return STOPPED
            if decision.action == Action.PAUSE and not paused:
                paused = True
                self.log("paused", step=self.step, seq=decision.seq)
                self._send(Paused(step=self.step))
            elif decision.action == Action.RESUME and paused:
                self.log("resumed", step=self.step, seq=decision.seq)
                self._send(Resumed(step=self.step))
                return None
            if not paused:
                return None
            decision = self.control.exchange(wait_s=PAUSE_POLL_S)

    def _train_step(self) -> Decision:
        """One optimizer step; returns the control decision for the boundary after it."""
        start = time.perf_counter()
        inputs, targets = self.batches.batch(self.step)
        local_loss = self.engine.step(inputs, targets)
        loss, decision = self.control.reduce_step(local_loss, self.batches.layout.world_size)
        elapsed = time.perf_counter() - start
        if self.hooks.trace_dir is not None:
            self._trace(loss)
        self.step += 1
        self.steps_run += 1
        if self.steps_run == 1:
            self.engine.prepare_snapshot()
        tokens_per_s = self.tokens_per_step / elapsed
        mfu = self.mfu.of(tokens_per_s)
        compile_s = self.compile_clock.record(elapsed)
        if compile_s is not None:
            self.log("compiled", step=self.step, compile_s=compile_s)
        if self.step % self.spec.train.log_every == 0 or self.step == self.target:
            extra = {} if mfu is None else {"mfu": round(mfu, 4)}
            self.log(
                "step",
                step=self.step,
                loss=loss,
                step_s=elapsed,
                tok_s=round(tokens_per_s),
                **extra,
            )
        self._send(
            StepDone(
                step=self.step,
                loss=loss,
                step_time_s=elapsed,
                tokens_per_s=tokens_per_s,
                target_steps=self.target,
                model_flops_per_token=self.mfu.flops_per_token,
                mfu=mfu,
                compile_s=compile_s,
            )
        )
        return decision

    def _checkpoint(self) -> None:
        stall = self.checkpointer.save(self.step, self._snapshot)
        in_memory = len(self.checkpointer.last_in_memory)  # files serialised in the background
        self.log("checkpoint_staged", step=self.step, stall_s=stall, in_memory=in_memory)

    def _snapshot(self, staging: Path, target: Path) -> dict[str, Any]:
        """The engine's snapshot plus this rank's step and RNG (fresh tensors already);
        the data position is a pure function of the step."""
        objects = self.engine.snapshot(staging, target)
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        objects[durable.trainer_file(self.rank)] = {"step": self.step, "rng": rng}
        return objects

    def _durable(self, step: int, path: Path, stall_s: float) -> None:
        """Called (rank 0, persist thread) once step ``step`` is committed."""
        self.log("checkpoint_durable", step=step, path=path)
        self._send(Checkpointed(step=step, path=str(path), stall_s=stall_s))

    def _send(self, message: Progress) -> None:
        if self.link is not None:
            self.link.send(message)

    def _trace(self, loss: float) -> None:
        assert self.hooks.trace_dir is not None
        record = {"step": self.step, "ids": self.batches.ids(self.step), "loss": loss}
        with (self.hooks.trace_dir / f"trace-rank-{self.rank}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
