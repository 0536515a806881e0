"""One rank's side of a Ringmaster job: the state it checkpoints and restores, the beat its
agent judges hangs by, and the control every rank carries out at the same step boundary.

The built-in trainer (:mod:`trainer.loop`) and every user loop (through the facade
:mod:`ringmaster.rank`) act on the coordinator's decisions through this class alone: one
path from agent to loop. What differs is only how the decision reaches every rank — the
built-in trainer folds it into the all-reduce of its step's loss, a user loop's
:meth:`ringmaster.rank.step` takes one small all-reduce of its own — and who writes a
durable checkpoint: this session, from the registered state, or the loop's framework
itself (``loop_saves``: a Hugging Face or Lightning save, reported back through
:meth:`Session.saved`).

Restore takes the newest state every rank of the new world can load: the memory tier's
(own node, else the buddy's copy) when it is newer than the durable one, else the durable
checkpoint, else nothing (a fresh start).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from proto.progress import (
    Checkpointed,
    ControlAction,
    Finished,
    LoopReady,
    Paused,
    Progress,
    Reaction,
    Resumed,
)
from ringmaster.rank import durable, termination
from ringmaster.rank.agent_link import AgentLink
from ringmaster.rank.beat import Beat
from ringmaster.rank.checkpoint import Checkpointer
from ringmaster.rank.control import PAUSE_POLL_S, Action, Decision, StepControl
from ringmaster.rank.coordination import find_resumable, load_file
from ringmaster.rank.log import Log
from ringmaster.rank.state import Position, State, capture_rng, restore_rng
from ringmaster.rankbeat import CHECKPOINT, DONE, PAUSED

Outcome = Literal["completed", "stopped"]
COMPLETED: Outcome = "completed"
STOPPED: Literal["stopped"] = "stopped"
Ending = Literal["stopped", "noticed"]  # what a boundary can end in
NOTICED: Ending = "noticed"  # a notice (SIGTERM): checkpointed, the rank leaves
Tier = Literal["memory", "durable", "loop", "fresh"]


class ResumeError(Exception):
    """Checkpoints exist but none can be resumed (one line, for the operator)."""


@dataclass(frozen=True)
class Restored:
    step: int
    tier: Tier


class Session:
    def __init__(
        self,
        rank: int,
        world_size: int,
        control: StepControl,
        link: AgentLink | None,
        beat: Beat,
        log: Log,
        *,
        framework: str,
        checkpoint_every: int,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.control = control
        self.link = link
        self.beat = beat
        self.log = log
        self.framework = framework
        self.checkpoint_every = checkpoint_every
        self.step = 0
        self.checkpointer: Checkpointer | None = None
        self.state: State | None = None
        self.position: Position | None = None
        self.loop_saves = False  # the framework writes durable checkpoints itself
        self.recent_steps: deque[float] = deque(maxlen=20)  # the memory tier's cadence reads them
        self.restored: Restored | None = None
        self._announced = False
        self.paused = False
        self.saved_in_phase: int | None = None  # the step saved inside a phase, if any
        self._served_seq: int | None = None  # that save carried out the words up to it
        termination.honour_notices()  # a SIGTERM notice is now checkpointed at a boundary

    # -- state ------------------------------------------------------------------------------

    def attach(self, checkpointer: Checkpointer, state: State, position: Position) -> None:
        """What this rank checkpoints: ``state`` (an engine, or what the loop registered)
        plus ``position`` and the RNG in the rank's own file."""
        self.checkpointer, self.state, self.position = checkpointer, state, position
        checkpointer.on_durable = self._durable

    @property
    def reactions(self) -> list[Reaction]:
        said = [Reaction.PAUSE]
        if self.checkpointer is not None or self.loop_saves:
            said.append(Reaction.CHECKPOINT)
        if self.checkpointer is not None and self.checkpointer.memory is not None:
            said.append(Reaction.MEMORY_TIER)
        if self.beat.path is not None:
            said.append(Reaction.HANG_BY_BEAT)
        return said

    def announce(self) -> None:
        """Rank 0 tells the agent, once per process, what this loop supports and where it
        resumed (the coordinator's refusals and ``status`` read it)."""
        if self._announced:
            return
        self._announced = True
        restored = self.restored or Restored(0, "fresh")
        self.send(
            LoopReady(
                step=restored.step,
                framework=self.framework,
                reactions=self.reactions,
                resumed_from=restored.tier,
            )
        )

    def restore(self, loop_step: int | None = None) -> Restored:
        """Load the newest state every rank can use, in place: the memory tier's when it
        is newer than the durable checkpoint (the framework's own at ``loop_step``, when
        the loop saves durably itself), else the durable one, else none."""
        assert self.checkpointer is not None
        began = time.perf_counter()
        checkpointer, coord = self.checkpointer, self.checkpointer.coord
        found = None if self.loop_saves else find_resumable(checkpointer.root, coord, self._files)
        durable_step = loop_step if self.loop_saves else (found[0].step if found else None)
        tier = checkpointer.memory
        if tier is not None:
            restored = tier.restore(
                self._memory_needs, -1 if durable_step is None else durable_step
            )
            if restored is not None:
                self._load(*restored)
                tier.discard_restore()
                checkpointer.last_step = checkpointer.durable_step = durable_step
                checkpointer.memory_last = checkpointer.memory_sealed = self.step
                took = {**tier.restore_parts, "took_s": _since(began)}
                self.log(
                    "resumed_from", step=self.step, tier="memory", durable=durable_step, **took
                )
                return self._restored("memory")
        if self.loop_saves:
            self.step = loop_step or 0
            checkpointer.last_step = checkpointer.durable_step = loop_step
            return self._restored("loop" if loop_step else "fresh")
        if found is None:
            why = coord.broadcast(self._unusable() if self.rank == 0 else None)
            if why is not None:
                raise ResumeError(why)
            self.log("fresh_start", took_s=_since(began))
            return self._restored("fresh")
        manifest, step_dir = found
        self._load(manifest, step_dir)
        job = manifest.job or "unrecorded"
        self.log(
            "resumed_from",
            step=self.step,
            tier="durable",
            job=job,
            path=step_dir,
            took_s=_since(began),
        )
        return self._restored("durable")

    def _restored(self, tier: Tier) -> Restored:
        self.restored = Restored(self.step, tier)
        return self.restored

    def reload_durable(self) -> bool:
        """Back to the newest durable checkpoint every rank can use (a numeric rewind);
        False when there is none."""
        assert self.checkpointer is not None
        found = find_resumable(self.checkpointer.root, self.checkpointer.coord, self._files)
        if found is None:
            return False
        self._load(*found)
        return True

    def _memory_needs(self, manifest: durable.Manifest, rank: int) -> list[str] | None:
        assert self.state is not None
        files = self.state.memory_files(manifest, rank)
        same_world = manifest.world_size == self.world_size
        own = durable.trainer_file(rank if same_world else 0)
        return None if files is None else [*files, own]

    def _load(self, manifest: durable.Manifest, step_dir: Path) -> None:
        """Restore a verified checkpoint: the state, then step, position and RNG."""
        assert self.state is not None and self.position is not None
        assert self.checkpointer is not None
        self.state.load(step_dir, manifest)
        own = load_file(step_dir / self._own_file(manifest))
        restore_rng(own["rng"])
        self.position.load_state_dict(own)
        self.step = own["step"]
        self.checkpointer.last_step = self.checkpointer.durable_step = self.step

    def _unusable(self) -> str | None:
        """Why sealed checkpoints exist that this run cannot load, if they do: starting
        from step 0 next to them would silently throw their training away."""
        assert self.checkpointer is not None and self.state is not None
        root = self.checkpointer.root
        for name in durable.candidates(root):
            manifest = durable.read_manifest(root / name)
            if manifest is not None:
                why = self.state.refusal(manifest) or "its files fail their checksums"
                return (
                    f"{root} holds checkpoints (newest {name}: {manifest.engine}, "
                    f"world size {manifest.world_size}) that this run ({self.state.name}, "
                    f"world size {self.world_size}) cannot load: {why}; "
                    "move them away to start fresh"
                )
        return None

    def _files(self, manifest: durable.Manifest) -> list[str] | None:
        """What this rank verifies and loads: the state's files plus its own file."""
        assert self.state is not None
        files = self.state.files_for(manifest)
        return None if files is None else [*files, self._own_file(manifest)]

    def _own_file(self, manifest: durable.Manifest) -> str:
        """This rank's step and RNG; rank 0's if the world size changed (the step is the
        same on every rank)."""
        same_world = manifest.world_size == self.world_size
        return durable.trainer_file(self.rank if same_world else 0)

    # -- the step boundary ------------------------------------------------------------------

    def stepped(self, step: int, seconds: float) -> None:
        """Every rank completed ``step`` in ``seconds``."""
        self.step = step
        self.recent_steps.append(seconds)
        self.beat.step_done(step, seconds)

    def periodic(self) -> None:
        """After a step: a durable checkpoint when one is due, else a memory snapshot
        when the tier's cadence says so (every rank decides alike)."""
        if self.checkpointer is None:
            return
        every = self.checkpoint_every
        due = not self.loop_saves and self.step % every == 0
        if due and self.checkpointer.last_step != self.step:
            self.checkpoint()
        elif self.checkpointer.memory_due(self.step):
            self.memory_snapshot()

    def boundary(self, decision: Decision) -> Ending | None:
        """Act on this boundary's decision; while paused, keep polling for the next one.
        Returns STOPPED when the job must stop here, NOTICED when a rank got a notice and
        must leave (the checkpoint taken either way, or left to the framework when it
        saves itself)."""
        before = self.beat.current.phase
        while True:
            ending = decision.action == Action.STOP or decision.notice
            served = self._served_seq
            if decision.checkpoint:
                self._served_seq = None  # once: every rank alike, as the decision is
            if decision.checkpoint and not ending and served is not None and decision.seq <= served:
                # carried out inside a phase since the word came (every rank knows alike)
                self.log("checkpoint_served", step=self.step, seq=decision.seq)
            elif (decision.checkpoint or ending) and not self.loop_saves:
                self.checkpoint()
            if decision.notice:
                self.log("notice", step=self.step, seq=decision.seq)
                return NOTICED
            if decision.action == Action.STOP:
                return STOPPED
            if decision.action == Action.PAUSE and not self.paused:
                self.paused = True
                before = self.beat.set_phase(PAUSED)
                self.log("paused", step=self.step, seq=decision.seq)
                self.send(Paused(step=self.step))
            elif decision.action == Action.RESUME and self.paused:
                self.paused = False
                self.beat.set_phase(before)
                self.log("resumed", step=self.step, seq=decision.seq)
                self.send(Resumed(step=self.step))
                return None
            if not self.paused:
                return None
            decision = self.control.exchange(wait_s=PAUSE_POLL_S)

    @property
    def can_save_in_phase(self) -> bool:
        """Whether the state of the last boundary can be saved inside a phase: as a durable
        checkpoint this session writes, or a memory-tier snapshot."""
        checkpointer = self.checkpointer
        if checkpointer is None:
            return False
        return not self.loop_saves or checkpointer.memory is not None

    def save_in_phase(self, notice: bool, seq: int) -> None:
        """Every rank together, inside a phase (:mod:`ringmaster.rank.phase_watch`): save
        the state of the last boundary as that boundary would have (a durable checkpoint,
        or a memory-tier snapshot where the framework writes the durable ones); after a
        notice, leave as there. ``seq``: the newest word it carries out (0: none)."""
        checkpointer = self.checkpointer
        if checkpointer is not None and self.saved_in_phase != self.step:
            if not self.loop_saves:
                self.checkpoint()
            elif checkpointer.memory is not None and checkpointer.memory_last != self.step:
                self.memory_snapshot()
            self.saved_in_phase = self.step
            # a durable checkpoint carries out the words; the framework's save is still due
            self._served_seq = None if self.loop_saves else seq or None
            tier = "durable" if not self.loop_saves else "memory"
            self.log("saved_in_phase", step=self.step, tier=tier, notice=notice)
        if notice:
            self.log("notice", step=self.step, seq=0)
            self.leave_for_notice()

    def checkpoint(self) -> None:
        """A durable checkpoint of the current step, asynchronous past its snapshot."""
        assert self.checkpointer is not None
        if self.link is not None:
            self.link.acted(ControlAction.CHECKPOINT)
        with self.beat.during(CHECKPOINT):
            stall = self.checkpointer.save(self.step, self._snapshot)
        in_memory = len(self.checkpointer.last_in_memory)  # serialised in the background
        self.log("checkpoint_staged", step=self.step, stall_s=stall, in_memory=in_memory)

    def memory_snapshot(self) -> None:
        """A snapshot into the memory tier, at the cadence every rank agrees on."""
        assert self.checkpointer is not None
        step_s = statistics.median(self.recent_steps) if self.recent_steps else 0.0
        waited = 0.0
        if self.checkpointer.busy():  # a long wait for a persist is no hang
            with self.beat.during(CHECKPOINT):
                waited = self.checkpointer.settle()
        # the snapshot itself is brief: a hang in it is one
        change = self.checkpointer.save_to_memory(self.step, self._snapshot, step_s, waited)
        if change is not None:
            self.log("memory_tier", step=self.step, **change)

    def saved(self, step: int, path: Path, stall_s: float) -> None:
        """The loop's framework wrote a durable checkpoint of ``step`` at ``path``."""
        if self.checkpointer is not None:
            self.checkpointer.last_step = self.checkpointer.durable_step = step
        self.log("checkpoint_staged", step=step, stall_s=stall_s, in_memory=0)
        self.log("checkpoint_durable", step=step, path=path)
        self.send(Checkpointed(step=step, path=str(path), stall_s=stall_s))

    def _snapshot(self, staging: Path, target: Path) -> dict[str, Any]:
        """The state's snapshot plus this rank's step, position and RNG (fresh copies)."""
        assert self.state is not None and self.position is not None
        objects = self.state.snapshot(staging, target)
        own = {**self.position.state_dict(), "step": self.step, "rng": capture_rng()}
        objects[durable.trainer_file(self.rank)] = own
        return objects

    def _durable(self, step: int, path: Path, stall_s: float) -> None:
        """Called (rank 0, persist thread) once step ``step`` is committed."""
        self.log("checkpoint_durable", step=step, path=path)
        self.send(Checkpointed(step=step, path=str(path), stall_s=stall_s))

    # -- the end ----------------------------------------------------------------------------

    def finish(self, outcome: Outcome, *, final_checkpoint: bool = True) -> None:
        """Training ended: the final checkpoint durable (when this session writes them),
        the memory tier's RAM given back, and rank 0's last word said."""
        self.beat.set_phase(DONE)  # the final checkpoint makes no steps either
        checkpointer = self.checkpointer
        if checkpointer is not None:
            if final_checkpoint and not self.loop_saves and checkpointer.last_step != self.step:
                self.checkpoint()
            checkpointer.wait()
            if final_checkpoint and not self.loop_saves and checkpointer.durable_step != self.step:
                raise RuntimeError(
                    f"the final checkpoint (step {self.step}) did not become durable"
                )
            checkpointer.forget_memory_together()  # the durable tier holds this step
            memory = checkpointer.memory_totals
        else:
            memory = {}
        self.log("finished", step=self.step, outcome=outcome, **memory)
        self.send(Finished(step=self.step, outcome=outcome))

    def leave_for_notice(self) -> None:
        """After a notice: once the checkpoint of this step is durable (the framework's
        own, when it saves itself), flush what rank 0 has to say and exit as SIGTERM
        does (:func:`ringmaster.rank.termination.leave`)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.log("leaving", step=self.step, reason="notice", durable=self._durable_step)
        if self.link is not None:
            self.link.close(flush_timeout_s=2.0)
        self.beat.stop()
        termination.leave()

    @property
    def _durable_step(self) -> int | None:
        return None if self.checkpointer is None else self.checkpointer.durable_step

    def send(self, message: Progress) -> None:
        if self.link is not None:
            self.link.send(message)


def _since(began: float) -> float:
    return round(time.perf_counter() - began, 3)
