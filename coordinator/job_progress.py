"""Rank 0's progress reports, as the job manager takes them in: steps, pauses,
checkpoints, the end, preflight figures, rewinds after numeric faults and straggler
windows. A report changes the job's record and books and returns what to say and do
(:data:`coordinator.job_effects.Outcome`), which the manager carries out; the decisions
are the policy's and the state machine's. No I/O, no clock but the one passed in."""

from __future__ import annotations

from coordinator import actions, job_machine, loop_support, numeric_policy, policy, progress_policy
from coordinator.goodput import (
    account,
    began_training,
    charge_lost_work,
    move_stall,
    observe_step_time,
    stamp,
    stepped,
    stepped_while_stopping,
)
from coordinator.job_books import Books
from coordinator.job_effects import Outcome
from proto.events import (
    JobAtRisk,
    JobBandwidth,
    JobCheckpointed,
    JobLoop,
    JobPaused,
    JobResumed,
    JobRewound,
    Severity,
)
from proto.job import JobRecord, JobState, LoopInfo, LoopPhase
from proto.progress import (
    BandwidthChecked,
    Checkpointed,
    Finished,
    LoopReady,
    Paused,
    PhaseChanged,
    Progress,
    Reaction,
    Resumed,
    Rewound,
    StepDone,
    Stragglers,
)
from ringmaster.clock import Clock


def take(job: JobRecord, books: Books, msg: Progress, sender: str, clock: Clock) -> list[Outcome]:
    """Rank 0's word, from ``sender`` (the node its subject names), about a job that has
    not ended: what to say and do, in order. Only the node hosting rank 0 of the job's
    current attempt speaks for its progress; an earlier attempt's late word, or an
    attempt of 0 (unknown), changes nothing."""
    if isinstance(msg, StepDone) and _given_up_speaks(job, msg.attempt, sender):
        assert job.given_up is not None
        now = clock.time()
        at = stamp(msg.time, now)
        stepped_while_stopping(job, msg.step, at, now, job.given_up.world_size)
        books.dirty = True
        return []
    if not job.nodes or sender != job.nodes[0] or not msg.attempt or msg.attempt != job.attempt:
        return []
    books.dirty = True
    match msg:
        case LoopReady():
            return [_loop_ready(job, msg)]
        case PhaseChanged(name=name, entered=entered, bound_s=bound):
            now = clock.time()
            at = stamp(msg.time, now)
            account(job, now)
            if entered:
                job.phase = LoopPhase(name=name, since=at, bound_s=bound)
            elif job.phase is not None and job.phase.name == name:
                job.phase = None
                job.last_step_at = at  # the stall clock starts again where it ended
                books.stamped = None  # the phase is not a step's time
        case StepDone():
            return _step_done(job, books, msg, clock)
        case Paused(step=step):
            books.stamped = None  # the pause is not a step's time
            if job_machine.fire(job, job_machine.Input.PAUSED) is None:
                return []
            job.step = max(job.step, step)
            job.pauses += 1
            why = ", ".join(job.pause_reasons) or "operator"
            return [JobPaused(job=job.id, step=step, reason=why, message=why)]
        case Resumed(step=step):
            if job_machine.fire(job, job_machine.Input.RESUMED) is None:
                return []
            return [JobResumed(job=job.id, step=step, message=f"step {step}")]
        case Checkpointed(step=step, path=path, stall_s=stall):
            said: list[Outcome] = []
            job.last_checkpoint_step = step
            began, books.checkpoint_began = books.checkpoint_began, None
            if began is not None and began[0] == step:
                job.checkpoint_s = clock.monotonic() - began[1]
                if (risk := at_risk_ahead(job, clock.time())) is not None:
                    said.append(risk)
            job_machine.fire(job, job_machine.Input.CHECKPOINTED)
            move_stall(job, stall)
            message = f"step {step} durable at {path} (training blocked {stall:.3f} s)"
            return [
                *said,
                JobCheckpointed(job=job.id, step=step, path=path, stall_s=stall, message=message),
            ]
        case Finished(outcome=outcome, step=step):
            account(job, clock.time())  # what came before the word was training
            job.finished, job.step = outcome, max(job.step, step)
            return list(progress_policy.all_exited(job))
        case BandwidthChecked():
            return _bandwidth(job, msg)
        case Rewound():
            return _rewound(job, msg, clock.time())
        case Stragglers():
            seen = books.attempt(job.attempt)
            before, seen.slow = seen.slow, set(progress_policy.slow_ranks(job, msg))
            return list(progress_policy.on_stragglers(job, msg, seen.straggled, before))
    return []


def at_risk_ahead(job: JobRecord, now: float) -> JobAtRisk | None:
    """The first time a measured checkpoint outlasts the notice the job's nodes may get:
    say so, and from now on checkpoint often enough (the manager's tick asks for them)."""
    every = policy.bounded_cadence(job)
    if every is None or job.bounding_checkpoint_at is not None:
        return None
    job.bounding_checkpoint_at = now
    notice = job.spec.policy.preemption_notice_s or 0.0
    return JobAtRisk(
        job=job.id,
        severity=Severity.WARNING,
        window_s=notice,
        checkpoint_s=job.checkpoint_s or 0.0,
        last_checkpoint_step=job.last_checkpoint_step,
        message=f"a checkpoint takes {job.checkpoint_s:.1f} s, longer than a "
        f"{notice:g} s preemption notice: checkpointing every {every:.0f} s to bound "
        "what a notice can cost",
    )


def _step_done(job: JobRecord, books: Books, msg: StepDone, clock: Clock) -> list[Outcome]:
    """A step reported: the record's progress and ledger, and the job's step time, taken
    between consecutive steps' stamps (their arrivals bunch up after a frozen bus or a
    leader change)."""
    step, now = msg.step, clock.time()
    at, last = stamp(msg.time, now), books.stamped
    between = at - last[1] if last and last[0] == step - 1 else None
    books.stamped = (step, at)
    observe_step_time(job, between or 0.0, first=job.state is JobState.STARTING)
    books.stepped_at = clock.monotonic()
    if step % job.spec.checkpoint.every_steps == 0:
        books.checkpoint_began = (step, clock.monotonic())
    if job.state is JobState.STARTING:
        began_training(job, at, now)
    elif job.last_step_at is None or job.last_step_at < (job.attempt_started_at or 0):
        # a script that opened the rank API only once it ran: its start-up so far was
        # charged as unknown (it had said nothing); it is start-up
        began_training(job, at, now, source="unknown")
        job.first_step_at = job.first_step_at or now
    elif job.state is JobState.RECOVERING:  # this attempt's stop is under way
        stepped_while_stopping(job, step, at, now)
    else:
        stepped(job, at, now, step - job.step)
    if job_machine.fire(job, job_machine.Input.TRAINING) is not None:
        job.given_up = None  # its steps, late now, would be counted as redone
        job.first_step_at = job.first_step_at or now
        if job.restarts:
            charge_lost_work(job, step - 1)
    job.step, job.loss = step, msg.loss
    if job.spec.job.entry and msg.target_steps > 0:
        job.target_steps = msg.target_steps  # the script's own, as its loop says
    job.memory_step = msg.memory_step  # None again after a rewind
    job_machine.trained_to(job, step)
    job.tokens_per_s, job.mfu = msg.tokens_per_s or None, msg.mfu
    if msg.compile_s is not None:
        job.compile_s = msg.compile_s
    if msg.durable_step is None:
        return []
    return _durable_reported(job, msg.durable_step, step)


def _durable_reported(job: JobRecord, durable: int, step: int) -> list[Outcome]:
    """Rank 0's step report names the newest durable step it knows; its own
    ``checkpointed`` report always goes out before it (:mod:`trainer.checkpoint`).
    A newer step than the record holds means that report was lost (a bus outage drops
    what was in flight): the record takes the step report's word and the ledger says
    where it came from. An older one is the step this attempt resumed from."""
    known = job.last_checkpoint_step
    if known is not None and durable <= known:
        return []
    job.last_checkpoint_step = durable
    if durable <= (job.resume_step or 0):
        return []  # a checkpoint written before this job or attempt, not a missed report
    job_machine.fire(job, job_machine.Input.CHECKPOINTED)
    return [
        JobCheckpointed(
            job=job.id,
            step=durable,
            message=f"step {durable} durable, as rank 0 reported at step {step} "
            "(its own checkpoint report never arrived)",
        )
    ]


def _loop_ready(job: JobRecord, msg: LoopReady) -> JobLoop:
    """Rank 0 opened the rank API: what the loop supports is now the job's record."""
    job.loop = LoopInfo(framework=msg.framework, reactions=msg.reactions, attempt=msg.attempt)
    has = loop_support.reactions(job)
    lacks = [r.value for r in Reaction if r not in has]
    where = f"resumed from {msg.resumed_from} step {msg.step}"
    if msg.resumed_from == "fresh":
        where = "a fresh start"
    return JobLoop(
        job=job.id,
        framework=msg.framework,
        reactions=[r.value for r in has],
        lacks=lacks,
        resumed_from=msg.resumed_from,
        step=msg.step,
        message=f"{msg.framework} loop: {loop_support.summary(job)}; {where}",
    )


def _bandwidth(job: JobRecord, msg: BandwidthChecked) -> list[Outcome]:
    """The preflight figures, said, then the policy's refusal of slow nodes."""
    decided = progress_policy.on_bandwidth(job, msg)
    refused = sorted(a.node for a in decided if isinstance(a, actions.RefuseNode))
    figures = ", ".join(f"{node} {gbps:.1f}" for node, gbps in msg.node_gbps.items())
    said = JobBandwidth(
        job=job.id,
        severity=Severity.WARNING if refused else Severity.INFO,
        node_gbps=msg.node_gbps,
        median_gbps=msg.median_gbps,
        slow=refused,
        message=f"bus bandwidth GB/s: {figures} (median {msg.median_gbps:.1f})",
    )
    return [said, *decided]


def _rewound(job: JobRecord, msg: Rewound, now: float) -> list[Outcome]:
    job.rewinds += 1
    job.step = msg.step
    fault = numeric_policy.seen(job, msg, now)
    skipped = f"; data of steps {msg.skip_from}-{msg.skip_to - 1} skipped"
    ranks = ", ".join(map(str, msg.ranks))
    if msg.nonfinite > len(msg.ranks):
        ranks += f" … ({msg.nonfinite} ranks in all)"
    where = f"; non-finite on rank {ranks}" if ranks else ""
    where += f" ({fault.node} alone)" if fault.node else ""
    said = JobRewound(
        job=job.id,
        severity=Severity.WARNING,
        from_step=msg.from_step,
        to_step=msg.step,
        skip_from=msg.skip_from,
        skip_to=msg.skip_to,
        reason=msg.reason,
        rewinds=job.rewinds,
        ranks=list(msg.ranks),
        suspect=fault.node,
        message=f"{msg.reason} at step {msg.from_step}: back to step {msg.step}"
        + (skipped if msg.skip_to > msg.skip_from else "")
        + where,
    )
    return [said, *numeric_policy.judge(job, fault)]


def _given_up_speaks(job: JobRecord, attempt: int, sender: str) -> bool:
    """A step of the attempt a relaunch replaced, from its rank 0's node, while the new
    attempt has not trained: its time was training, not the recovery the ledger charged."""
    given = job.given_up
    return (
        given is not None
        and attempt == given.attempt
        and sender == given.node
        and job.state is JobState.STARTING
    )
