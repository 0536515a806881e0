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
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from proto.job import JobSpec
from proto.progress import Checkpointed, Paused, Progress, Resumed, StepDone
from ringmaster.rankbeat import CHECKPOINT, DONE, PAUSED
from trainer import durable, numeric
from trainer.agent_link import AgentLink
from trainer.beat import Beat
from trainer.checkpoint import Checkpointer
from trainer.compile import CompileClock
from trainer.control import PAUSE_POLL_S, Action, Decision, StepControl
from trainer.coordination import find_resumable, load_file
from trainer.data import Batches
from trainer.engine import Engine
from trainer.flops import Mfu
from trainer.log import Log
from trainer.probe import StepProbe, StragglerWindow

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
        beat: Beat | None = None,
        probe: StepProbe | None = None,
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
        self.beat = beat or Beat(None)  # the phase and steps the node agent judges hangs by
        checkpointer.on_durable = self._durable
        policy = spec.policy  # numeric faults and stragglers (trainer.numeric, trainer.probe)
        self.data_offset = 0  # the data of step s is batch(s + data_offset)
        self.guard = numeric.NumericGuard(policy.grad_norm_spike)
        self.rewinds = numeric.Rewinds(policy.max_rewinds)
        self.probe = probe or StepProbe(engine.module, torch.device("cpu"))
        self.window = StragglerWindow(policy.straggler_window_steps) if self.rank == 0 else None
        self.recent_steps: deque[float] = deque(maxlen=20)  # the memory tier's cadence reads them

    def resume(self) -> None:
        """Load the newest checkpoint every rank can verify, if there is one: the memory
        tier's when it is newer than the durable one."""
        began = time.perf_counter()

        def took_s() -> float:
            return round(time.perf_counter() - began, 3)

        root, coord = self.checkpointer.root, self.checkpointer.coord
        found = find_resumable(root, coord, self._files_for)
        durable_step = found[0].step if found is not None else None
        tier = self.checkpointer.memory
        if tier is not None:
            needs = self._memory_needs
            restored = tier.restore(needs, -1 if durable_step is None else durable_step)
            if restored is not None:
                self._load(*restored)
                tier.discard_restore()
                self.checkpointer.last_step = self.checkpointer.durable_step = durable_step
                self.checkpointer.memory_last = self.checkpointer.memory_sealed = self.step
                took = {**tier.restore_parts, "took_s": took_s()}
                self.log(
                    "resumed_from", step=self.step, tier="memory", durable=durable_step, **took
                )
                return
        if found is None:
            why = coord.broadcast(self._unusable() if self.rank == 0 else None)
            if why is not None:
                raise ResumeError(why)
            self.log("fresh_start", took_s=took_s())
            return
        manifest, step_dir = found
        self._load(manifest, step_dir)
        job = manifest.job or "unrecorded"
        self.log(
            "resumed_from", step=self.step, tier="durable", job=job, path=step_dir, took_s=took_s()
        )

    def _memory_needs(self, manifest: durable.Manifest, rank: int) -> list[str] | None:
        files = self.engine.memory_files(manifest, rank)
        same_world = manifest.world_size == self.batches.layout.world_size
        trainer = durable.trainer_file(rank if same_world else 0)
        return None if files is None else [*files, trainer]

    def _load(self, manifest: durable.Manifest, step_dir: Path) -> None:
        """Restore a verified checkpoint: the engine's state, then step, data offset, RNG."""
        self.engine.load(step_dir, manifest)
        state = load_file(step_dir / self._trainer_file(manifest))
        torch.set_rng_state(state["rng"]["cpu"])
        if torch.cuda.is_available() and "cuda" in state["rng"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.step, self.data_offset = state["step"], state.get("data_offset", 0)
        self.checkpointer.last_step = self.checkpointer.durable_step = self.step

    def _rewind(self, reason: str) -> None:
        """After a numeric fault in the step at ``self.step``, on every rank alike: back to
        the newest durable checkpoint, skipping the data trained on since it."""
        self.rewinds.admit(self.step + 1, reason)  # NumericFault once the budget is spent
        # a persist in flight predates the fault: let it seal; then what the memory tier
        # holds past the checkpoint is suspect
        self.checkpointer.forget_memory_together()
        found = find_resumable(self.checkpointer.root, self.checkpointer.coord, self._files_for)
        if found is None:
            raise numeric.no_checkpoint(self.step + 1, reason)
        bad, offset = self.step, self.data_offset
        self._load(*found)
        rewind = numeric.plan(self.step, bad, offset, reason)
        self.data_offset = rewind.offset
        self.log("rewound", **dataclasses.asdict(rewind), rewinds=self.rewinds.count)
        self._send(rewind.message())

    def _unusable(self) -> str | None:
        """Why sealed checkpoints exist that this run cannot load, if they do: starting
        from step 0 next to them would silently throw their training away."""
        root = self.checkpointer.root
        for name in durable.candidates(root):
            manifest = durable.read_manifest(root / name)
            if manifest is not None:
                why = self.engine.refusal(manifest) or "its files fail their checksums"
                return (
                    f"{root} holds checkpoints (newest {name}: {manifest.engine}, "
                    f"world size {manifest.world_size}) that this run ({self.engine.name}, "
                    f"world size {self.batches.layout.world_size}) cannot load: {why}; "
                    "move them away to start fresh"
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
            every = self.spec.checkpoint.every_steps  # (a rewind lands on a checkpoint)
            if self.step % every == 0 and self.checkpointer.last_step != self.step:
                self._checkpoint()
            elif self.checkpointer.memory_due(self.step):
                self._memory_snapshot()
        self.beat.set_phase(DONE)  # the final checkpoint makes no steps either
        if self.checkpointer.last_step != self.step:
            self._checkpoint()
        self.checkpointer.wait()
        if self.checkpointer.durable_step != self.step:
            raise RuntimeError(f"the final checkpoint (step {self.step}) did not become durable")
        self.checkpointer.forget_memory_together()  # the durable tier holds this step
        memory = self.checkpointer.memory_totals
        self.log("finished", step=self.step, outcome=outcome, **memory)
        return outcome

    def _boundary(self, decision: Decision) -> Outcome | None:
        """Act on this boundary's control decision; while paused, keep polling for the
        next one. Returns STOPPED when the job must stop here."""
        paused = False
        before = self.beat.current.phase
        while True:
            if decision.checkpoint or decision.action == Action.STOP:
                self._checkpoint()
            if decision.action == Action.STOP:
                return STOPPED
            if decision.action == Action.PAUSE and not paused:
                paused = True
                before = self.beat.set_phase(PAUSED)
                self.log("paused", step=self.step, seq=decision.seq)
                self._send(Paused(step=self.step))
            elif decision.action == Action.RESUME and paused:
                self.beat.set_phase(before)
                self.log("resumed", step=self.step, seq=decision.seq)
                self._send(Resumed(step=self.step))
                return None
            if not paused:
                return None
            decision = self.control.exchange(wait_s=PAUSE_POLL_S)

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
            with self.beat.during(CHECKPOINT):  # loading a checkpoint makes no steps
                self._rewind(fault)
            return decision
        self.step += 1
        if self.window is not None and (report := self.window.add(self.step, totals.compute_s)):
            self._send(report)
        self.steps_run += 1
        self.recent_steps.append(elapsed)
        self.beat.step_done(self.step, elapsed)
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
                memory_step=self.checkpointer.memory_sealed,
            )
        )
        return decision

    def _checkpoint(self) -> None:
        with self.beat.during(CHECKPOINT):
            stall = self.checkpointer.save(self.step, self._snapshot)
        in_memory = len(self.checkpointer.last_in_memory)  # files serialised in the background
        self.log("checkpoint_staged", step=self.step, stall_s=stall, in_memory=in_memory)

    def _memory_snapshot(self) -> None:
        """A snapshot into the memory tier, at the cadence every rank agrees on."""
        step_s = statistics.median(self.recent_steps) if self.recent_steps else 0.0
        waited = 0.0
        if self.checkpointer.busy():  # a long wait for a persist is no hang
            with self.beat.during(CHECKPOINT):
                waited = self.checkpointer.settle()
        # the snapshot itself is brief: a hang in it is one
        change = self.checkpointer.save_to_memory(self.step, self._snapshot, step_s, waited)
        if change is not None:
            self.log("memory_tier", step=self.step, **change)

    def _snapshot(self, staging: Path, target: Path) -> dict[str, Any]:
        """The engine's snapshot plus this rank's step, data offset and RNG (fresh
        tensors already)."""
        objects = self.engine.snapshot(staging, target)
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        state = {"step": self.step, "data_offset": self.data_offset, "rng": rng}
        objects[durable.trainer_file(self.rank)] = state
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
        ids = self.batches.ids(self.step + self.data_offset)
        record = {"step": self.step, "ids": ids, "loss": loss}
        with (self.hooks.trace_dir / f"trace-rank-{self.rank}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
