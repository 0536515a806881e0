"""A user loop's rank in a Ringmaster job: the :class:`ringmaster.rank.session.Session`
built from the environment the node agent gave the rank, and the per-step agreement a
loop whose collectives are its own needs (one small all-reduce on a gloo group of the
API's own, :meth:`ringmaster.rank.control.StepControl.agree`)."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from proto.progress import ControlAction, PhaseChanged, StepDone
from ringmaster import rank_env
from ringmaster.rank import stacks, termination, tiers
from ringmaster.rank.agent_link import AgentLink
from ringmaster.rank.beat import Beat
from ringmaster.rank.control import NOTHING, Agreed, StepControl, StepDisagreement
from ringmaster.rank.control import Decision as ControlDecision
from ringmaster.rank.coordination import Coordination
from ringmaster.rank.launch import Launch, SpecError, exit_record, read_launch
from ringmaster.rank.log import Log
from ringmaster.rank.phase_watch import NOTHING as ASKS_NOTHING
from ringmaster.rank.phase_watch import Asked, PhaseWatch
from ringmaster.rank.session import NOTICED, STOPPED, Outcome, Session
from ringmaster.rank.state import Objects, Registered, Stateful
from ringmaster.rundir import STACKS_SIGNAL

# s: a user loop's ranks start their agreement on the step's decision at most this often
# (every step when steps take longer). Each one is an all-reduce whose threads take the
# cores from the step beside it: on two saturated cores about 2 ms, a tenth of a 20 ms
# step. So a decision reaches such a loop within this long, not within its next step.
AGREE_EVERY_S = 0.25
# the memory tier's sparsest cadence, in steps, where the loop's framework writes the
# durable checkpoints: the tier's own measured cost spaces the snapshots until then
LOOP_SAVES_CAP = 1000
# the phase name of a loop's own checkpoint writing (the integrations name it so)
SAVING_PHASE = "save"


class RankApiError(RuntimeError):
    """The rank API used wrongly (one line naming what and how to fix it)."""


@dataclass(frozen=True)
class Decision:
    """What every rank must do at this step, the same on all of them.

    ``stop``: leave the training loop now (the checkpoint for it is taken, or ``save``
    asks the loop's framework to write it first). ``save``: only for a loop whose
    framework writes the durable checkpoints (``init(loop_saves=True)``): write one at
    this step, then report it with :func:`ringmaster.rank.saved`. ``notice``: a
    preemption notice (SIGTERM) caused it; the process exits once the checkpoint is durable.
    """

    stop: bool = False
    save: bool = False
    notice: bool = False


CONTINUE = Decision()


class Driver:
    def __init__(self, launch: Launch, env: Mapping[str, str], framework: str, loop_saves: bool):
        self.launch = launch
        self.env = env
        self.framework = framework
        self.loop_saves = loop_saves
        self.log = Log(launch.rank, launch.attempt)
        termination.record_exit_in(exit_record(env))
        termination.install(env)
        # stacks on demand for the hang watch (a thread; faulthandler as the fallback)
        faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=True)
        stacks.serve_from_env(env, launch.rank)
        self.beat = Beat.from_env(env, launch.rank).start()
        self.link: AgentLink | None = None
        if launch.rank == 0 and launch.control_socket is not None:
            self.link = AgentLink(launch.control_socket, launch.job_id).start()
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.objects: dict[str, Stateful] = {}
        self.session: Session | None = None
        self.watch: PhaseWatch | None = None  # honours a notice inside a phase
        self.steps_run = 0
        self.last_step: int | None = None
        self.last_at = time.perf_counter()
        self.target: int | None = None
        self.ended = False
        self.stopped = False  # a stop was decided: the loop's end is "stopped"
        self.noticed = False  # a notice was decided: the loop's end is leaving
        self._agreeing: Callable[[], Agreed] | None = None  # the boundary's, running
        self._agree_from = 0  # the step whose boundary started the last agreement
        self._agree_every = 1  # steps from it to the next one, as it agreed
        self.log("started", pid=os.getpid(), framework=framework, loop_saves=loop_saves)

    # -- state ------------------------------------------------------------------------------

    def register(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        objects: Mapping[str, Any],
    ) -> None:
        if self.session is not None:
            raise RankApiError(
                "register() after restore() or step(): register the training state first, "
                "then restore it"
            )
        if optimizer is not None and model is None:
            raise RankApiError("register(optimizer=...) needs the model it optimizes too")
        for name, obj in objects.items():
            if not isinstance(obj, Stateful):
                raise RankApiError(
                    f"register({name}=...): a {type(obj).__name__} has no state_dict() and "
                    "load_state_dict(); register what does"
                )
        self.model = model if model is not None else self.model
        self.optimizer = optimizer if optimizer is not None else self.optimizer
        self.objects.update(objects)

    def _open(self) -> Session:
        """The session, once: its gloo group, checkpointer and memory tier (every rank at
        the same call, as they are collectives)."""
        if self.session is not None:
            return self.session
        launch = self.launch
        # three gloo groups: checkpoints gather in a persist thread while the loop agrees on
        # its next step and the phase watch compares notes, and one group's collectives
        # must never interleave from two threads
        coord, control_group, watch_group = _coordination(launch), _gloo_group(), _gloo_group()
        control = StepControl(
            launch.rank,
            torch.device("cpu"),
            self.link,
            group=control_group,
            notice=termination.noticed,
        )
        ckpt = launch.spec.checkpoint
        session = Session(
            launch.rank,
            launch.world_size,
            control,
            self.link,
            self.beat,
            self.log,
            framework=self.framework,
            checkpoint_every=ckpt.every_steps,
        )
        session.loop_saves = self.loop_saves
        if self.model is not None or self.objects:
            checkpointer = tiers.checkpointer(
                launch,
                coord,
                Registered.name,
                torch.device("cpu"),
                self.env,
                self.log,
                # never sparser than the durable checkpoints this session writes; the
                # framework's own saves have a cadence of their own, unknown here
                memory_cap=LOOP_SAVES_CAP if self.loop_saves else None,
            )
            state = Registered(self.model, self.optimizer, coord.group)
            session.attach(checkpointer, state, Objects(self.objects))
            save = session.save_in_phase
            self.watch = PhaseWatch(watch_group, self._asks, lambda: session.step, save)
        self.session = session
        return session

    def _asks(self) -> Asked:
        """What this rank asks of the phase watch now: a notice's save, when the state can
        be saved inside a phase; a checkpoint or stop word not yet carried out, unless
        saved inside this phase already."""
        session = self.session
        if session is None or not session.can_save_in_phase:
            return ASKS_NOTHING
        words = self.link.asked() if self.link is not None else {}
        # where the framework writes the durable checkpoints, a checkpoint word is its
        # save at the next boundary; a stop's still gets the memory tier's snapshot here
        kinds = (
            (ControlAction.STOP,)
            if self.loop_saves
            else (ControlAction.CHECKPOINT, ControlAction.STOP)
        )
        wanted = [words[a] for a in kinds if a in words]
        seq = max(wanted, default=0)
        if termination.noticed():
            return Asked(True, True, seq)
        if session.saved_in_phase == session.step or not wanted:
            return ASKS_NOTHING
        return Asked(True, False, seq)

    def restore(self, loop_step: int | None) -> int:
        if self.session is not None:
            raise RankApiError("restore() called twice, or after step(): call it once, first")
        session = self._open()
        if session.checkpointer is not None:
            session.restore(loop_step)
        else:
            session.step = loop_step or 0
        session.announce()
        self.last_step, self.last_at = session.step, time.perf_counter()
        self.log("start", step=session.step, target=self.target or 0)
        return session.step

    # -- the step boundary ------------------------------------------------------------------

    def step(
        self, step: int, loss: float | None, tokens: int | None, target: int | None
    ) -> Decision:
        if self.session is None:  # the loop restores nothing: what it trains is a fresh start
            self._open().announce()
            self.log("start", step=0, target=target or 0)
        session = self._open()
        if self.last_step is not None and step <= self.last_step:
            raise RankApiError(
                f"step({step}) after step({self.last_step}): steps must increase by one or "
                "more per call (pass the loop's global step)"
            )
        now = time.perf_counter()
        elapsed, self.last_at, self.last_step = now - self.last_at, now, step
        self.target = target if target is not None else self.target
        # the previous boundary's agreement, which ran beside this step, decides this one
        decision = self._agreed()
        session.stepped(step, elapsed)
        said = {} if loss is None else {"loss": loss}
        self.log("step", step=step, step_s=round(elapsed, 6), **said)
        self.steps_run += 1
        if self.steps_run == 1 and session.state is not None:
            session.state.prepare_snapshot()
        if session.link is not None:
            checkpointer = session.checkpointer
            session.send(
                StepDone(
                    step=step,
                    loss=float(loss) if loss is not None else 0.0,
                    step_time_s=elapsed,
                    tokens_per_s=(tokens or 0) / elapsed if elapsed > 0 else 0.0,
                    target_steps=self.target or 0,
                    memory_step=checkpointer.memory_sealed if checkpointer else None,
                    durable_step=checkpointer.durable_step if checkpointer else None,
                )
            )
        session.periodic()
        ending = session.boundary(decision)
        if ending is None and step >= self._agree_from + self._agree_every:
            # the next boundary's, folding the words that came until now; rank 0 says
            # how many steps of its median step time fit in AGREE_EVERY_S
            every = agreement_every(self.beat.current.step_s)
            self._agreeing = session.control.agree(step, every)
            self._agree_from = step
        if ending == NOTICED:
            if not self.loop_saves:
                session.leave_for_notice()  # does not return
            self.noticed = True  # every rank agreed: finish() leaves once it is saved
            return Decision(stop=True, save=True, notice=True)
        if ending == STOPPED:
            self.stopped = True
            return Decision(stop=True, save=self.loop_saves)
        if decision.checkpoint and self.loop_saves:
            return Decision(save=True)
        return CONTINUE

    def _agreed(self) -> ControlDecision:
        """The result of the agreement a previous boundary started (nothing when none
        runs); a stall in it waits for a peer."""
        agreeing, self._agreeing = self._agreeing, None
        if agreeing is None:
            return NOTHING
        with self.beat.in_collective():
            try:
                decision, every = agreeing()
            except StepDisagreement as exc:
                raise RankApiError(str(exc)) from None
        if every != self._agree_every:
            self._agree_every = every
            self.log("agree_every", step=self._agree_from, steps=every)
        return decision

    @contextlib.contextmanager
    def phase(self, name: str, bound_s: float | None) -> Iterator[None]:
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise RankApiError(f"phase({name!r}): name it with letters, digits, '_' or '-'")
        if bound_s is not None and not bound_s > 0:
            raise RankApiError(f"phase({name!r}, bound_s={bound_s}): a bound is seconds > 0")
        step = self.last_step or 0
        self._send_phase(PhaseChanged(step=step, name=name, entered=True, bound_s=bound_s))
        began = time.perf_counter()
        # the loop's own checkpoint writing is never cut short: its files would be half
        # written, and a notice during it is honoured where it ends
        watch = self.watch if name != SAVING_PHASE else None
        if watch is not None:
            watch.enter()
        try:
            with self.beat.named(name, bound_s):
                yield
        finally:
            if watch is not None:
                watch.leave()  # waits while every rank saves inside the phase
            seconds = time.perf_counter() - began
            self._send_phase(PhaseChanged(step=step, name=name, entered=False, seconds=seconds))
            # a step's time is the loop's own, not the phase's
            self.last_at += seconds

    def _send_phase(self, message: PhaseChanged) -> None:
        if self.link is not None:
            self.link.send(message)

    def saved(self, step: int, path: Path, stall_s: float) -> None:
        """Every rank reports its part of the framework's checkpoint written; once all have
        (a barrier on the API's group), rank 0 reports the checkpoint."""
        session = self._open()
        if dist.is_initialized():
            dist.barrier(group=session.control.group)
        session.saved(step, path, stall_s)

    def finish(self, outcome: Outcome | None) -> None:
        """Training ended (every rank): what :meth:`Session.finish` does, the link flushed
        and the beat saying done. The outcome is ``stopped`` after a stop decision unless
        the loop says otherwise. After a notice every rank agreed on, the framework has
        saved for it: the process leaves as SIGTERM does, with no last word (the job goes
        on elsewhere from that checkpoint)."""
        if self.ended:
            return
        self.ended = True
        session = self._open()
        self._agreed()  # no collective is left running: what it decided comes too late
        if self.watch is not None:
            self.watch.close()
        if self.noticed:
            session.leave_for_notice()  # does not return
        session.finish(outcome or ("stopped" if self.stopped else "completed"))
        if self.link is not None:
            self.link.close()
        self.beat.stop()


def agreement_every(step_s: float) -> int:
    """Steps from one agreement to the next at a median step of ``step_s``: as many as fit
    in ``AGREE_EVERY_S``, at least one (every step until a step time is known)."""
    return max(1, int(AGREE_EVERY_S / step_s)) if step_s > 0 else 1


def _coordination(launch: Launch) -> Coordination:
    if launch.world_size == 1 and not dist.is_initialized():
        return Coordination()
    if not dist.is_initialized():
        raise RankApiError(
            "call torch.distributed.init_process_group() before the rank API's restore() "
            "or step(): it agrees with the other ranks over it"
        )
    return Coordination.over_gloo()


def _gloo_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank (None for a lone process without a process group)."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def from_env(env: Mapping[str, str], framework: str, loop_saves: bool) -> Driver | None:
    """The driver of a rank the agent started; None outside a Ringmaster job."""
    if rank_env.JOB_SPEC not in env:
        return None
    try:
        launch = read_launch(env, [])
    except SpecError as exc:
        raise RankApiError(f"ringmaster.rank: {exc}") from None
    return Driver(launch, env, framework, loop_saves)
