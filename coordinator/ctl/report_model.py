"""What ``coordinatorctl report`` computes, from a job record and its event history alone
(no I/O, so it works after the job has ended and is tested from a list of events).

Measured: the ledger (the record's goodput buckets), each pause's and restart's cost.
Estimated, and labelled so: what a reaction saved. A pause is weighed against the crash
and restart it avoided (the restart's recovery time plus the work since the last
checkpoint at the pause, times the GPUs); an on-demand checkpoint (a preemption notice's,
an operator's) against the work since the last periodic one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator import loop_support
from proto.events import (
    EventBase,
    JobCheckpointed,
    JobLoop,
    JobPaused,
    JobRecovering,
    JobRestarted,
    JobResumed,
    JobStarted,
    kind_of,
)
from proto.job import GOODPUT_BUCKETS, JobRecord

ESTIMATES = (
    "Estimates: a pause is weighed against the crash and restart it avoided, i.e. one "
    "restart's recovery time (this job's own restarts on average, else its start-up time) "
    "plus the work since the last checkpoint at the pause, times the GPUs; an on-demand "
    "checkpoint against the work since the last periodic checkpoint. Work is steps times "
    "the job's average productive step time."
)
# Events drawn on the timeline besides every condition's opening and closing.
MARKED = {
    "job.started",
    "job.paused",
    "job.resumed",
    "job.checkpointed",
    "job.recovering",
    "job.restarted",
    "job.completed",
    "job.failed",
    "job.stopped",
    "node.lost",
    "gpu.xid",
}


@dataclass
class Marker:
    t: float
    kind: str
    label: str


@dataclass
class Fault:
    """One fault (a condition, or a restart's reason) and what it cost."""

    key: str
    what: str
    opened: float
    closed: float | None = None
    reaction: str = "none"
    cost_gpu_s: float = 0.0  # measured: time paused or recovering, plus work redone
    saved_gpu_s: float | None = None  # estimated: what the reaction avoided


@dataclass
class Report:
    job: str  # the job's id
    state: str
    world_size: int
    step: int
    target_steps: int
    step_time_s: float
    ledger: dict[str, float]  # GPU-seconds per bucket
    steps: list[tuple[float, int]] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    pauses: list[tuple[float, float]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    name: str = ""  # the job's name, as its job file gives it
    # False: the job's loop reports no steps, so the step, the productive/lost split and
    # the step time are unknown (the running time is in the ledger's ``unknown``)
    reports_steps: bool = True
    phases: dict[str, float] = field(default_factory=dict)  # GPU-s per named loop phase


def build(record: JobRecord, events: list[EventBase], steps: list[tuple[float, int]]) -> Report:
    """The report; ``steps``: (wall time, step) from the progress stream, may be empty."""
    events = sorted(events, key=lambda e: e.time)
    world = record.world_size or max(
        (len(e.nodes) for e in events if isinstance(e, JobStarted)), default=1
    )
    done = max(record.step, 1)
    step_time = record.goodput.get("productive", 0.0) / max(world, 1) / done
    report = Report(
        job=record.id,
        name=record.name,
        state=record.state.value,
        world_size=world,
        step=record.step,
        target_steps=record.target_steps,
        step_time_s=step_time,
        ledger={b: record.goodput.get(b, 0.0) for b in GOODPUT_BUCKETS},
        steps=sorted(steps) or _interpolated(events),
        reports_steps=loop_support.reports_steps(record),
        phases=dict(record.phases),
    )
    _Walk(report, record, events).run()
    return report


def _interpolated(events: list[EventBase]) -> list[tuple[float, int]]:
    """Without retained progress: the steps the job's own events name, joined by lines."""
    points = [(e.time.timestamp(), 0) for e in events if isinstance(e, JobStarted)][:1]
    for e in events:
        step = getattr(e, "step", None)
        if e.job and isinstance(step, int) and step > 0:
            points.append((e.time.timestamp(), step))
    return points


class _Walk:
    """One pass over the history in time order, pairing openings with closings, pauses
    with resumes and restarts with the first step after them."""

    def __init__(self, report: Report, record: JobRecord, events: list[EventBase]) -> None:
        self.r, self.record, self.events = report, record, events
        self.every = record.spec.checkpoint.every_steps
        self.world = report.world_size
        self.open: dict[str, Fault] = {}
        self.ckpt_step = 0  # the last checkpoint's step
        self.periodic_step = 0  # the last periodic checkpoint's step
        self.paused: tuple[JobPaused, int] | None = None  # the pause, checkpoint step then
        self.restarts: list[tuple[Fault, float]] = []  # the fault, when the restart began
        self.recoveries: list[float] = []  # seconds from each restart to its first step

    def run(self) -> None:
        for e in self.events:
            t, kind = e.time.timestamp(), kind_of(e)
            if e.condition is not None or kind in MARKED:
                self.r.markers.append(Marker(t, kind, e.message or kind))
            self._event(e, t)
        self._recovery_times()
        recovery = self._recovery_s()
        for fault in self.r.faults:
            if fault.reaction.startswith("paused") and fault.saved_gpu_s is not None:
                fault.saved_gpu_s += recovery * self.world

    def _event(self, e: EventBase, t: float) -> None:
        cond = e.condition
        if cond is not None and cond.active and cond.key not in self.open:
            self.open[cond.key] = Fault(cond.key, e.message or cond.reason, t)
            self.r.faults.append(self.open[cond.key])
        elif cond is not None and not cond.active and cond.key in self.open:
            self.open.pop(cond.key).closed = t
        match e:
            case JobStarted() | JobRestarted():
                self.world = len(e.nodes) or self.world
            case JobPaused():
                self.paused = (e, self.ckpt_step)
            case JobResumed() if self.paused is not None:
                self._resumed(t)
            case JobCheckpointed(step=step):
                self._checkpointed(e, t, step)
            case JobRecovering(reason=reason):
                fault = self._fault_for(reason, t, newest_open=True)
                fault.reaction = "restarted"
                self.restarts.append((fault, t))

    def _resumed(self, t: float) -> None:
        assert self.paused is not None
        pause, ckpt_step = self.paused
        self.paused = None
        self.r.pauses.append((pause.time.timestamp(), t))
        keys = [k.strip() for k in pause.reason.split(",") if k.strip()]
        fault = self._fault_for(keys[0] if keys else "operator", pause.time.timestamp())
        span = t - pause.time.timestamp()
        fault.reaction = f"paused {span:.1f} s"
        fault.cost_gpu_s += span * self.world
        redo = max(0, pause.step - ckpt_step) * self.r.step_time_s * self.world
        fault.saved_gpu_s = (fault.saved_gpu_s or 0.0) + redo  # + recovery, after the walk
        # Other faults the pause answered: those it names after the first, and those that
        # opened while it lasted (a second device's spike): one pause, counted once.
        began = pause.time.timestamp()
        for other in self.r.faults:
            answered = other.key in keys[1:] or began <= other.opened <= t
            if other is not fault and other.reaction == "none" and answered:
                other.reaction = f"covered by the pause for {fault.key}"

    def _checkpointed(self, e: JobCheckpointed, t: float, step: int) -> None:
        on_demand = step % self.every != 0 and step != self.r.target_steps
        if on_demand:
            opened = [f for f in self.open.values() if f.opened <= t]
            fault = opened[-1] if opened else self._fault_for("operator checkpoint", t)
            fault.reaction = f"checkpointed at step {step}"
            saved = (step - self.periodic_step) * self.r.step_time_s * self.world
            fault.saved_gpu_s = (fault.saved_gpu_s or 0.0) + saved
        else:
            self.periodic_step = step
        self.ckpt_step = step

    def _fault_for(self, key: str, t: float, newest_open: bool = False) -> Fault:
        """The fault a reaction answers: the one under ``key``, else (``newest_open``)
        the newest fault still open at ``t``, else a new entry for a reason in words."""
        found = [f for f in self.r.faults if f.key == key]
        if not found and newest_open:
            found = [f for f in self.r.faults if f.closed is None and f.opened <= t]
        if found:
            return found[-1]
        fault = Fault(key, key, t, closed=t)
        self.r.faults.append(fault)
        return fault

    def _recovery_times(self) -> None:
        """A restart costs the time to its first step after, plus the steps redone."""
        for fault, began in self.restarts:
            reached = max((s for t, s in self.r.steps if t <= began), default=0)
            ended = min((t for t, _ in self.r.steps if t > began), default=began)
            restart = next(
                (
                    e
                    for e in self.events
                    if isinstance(e, JobRestarted) and e.time.timestamp() > began
                ),
                None,
            )
            redo = max(0, reached - self._resumed_at(restart))
            self.recoveries.append(ended - began)
            fault.cost_gpu_s += ((ended - began) + redo * self.r.step_time_s) * self.world

    def _resumed_at(self, restart: JobRestarted | None) -> int:
        """Where the ranks said they resumed after ``restart`` (its loop's first word),
        else where the coordinator expected them to."""
        if restart is None:
            return 0
        for e in self.events:
            if e.time < restart.time or e is restart:
                continue
            if isinstance(e, JobRestarted):
                break  # the next attempt's: this one's loop never spoke
            if isinstance(e, JobLoop) and e.resumed_from:
                return e.step
        return restart.from_step

    def _recovery_s(self) -> float:
        """One restart's recovery: this job's own on average, else its start-up time."""
        if self.recoveries:
            return sum(self.recoveries) / len(self.recoveries)
        if self.record.started_at and self.record.first_step_at:
            return max(0.0, self.record.first_step_at - self.record.started_at)
        return 0.0
