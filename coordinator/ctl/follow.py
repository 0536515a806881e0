"""``start --wait``: follow a job to its end and exit with its outcome; inside a Slurm
allocation, also stand for the job in front of Slurm.

Inside an allocation (``sbatch`` running ``exec coordinatorctl start --wait``), Slurm's
warning that the allocation ends — the ``--signal=B:USR1@SECS`` before the time limit or a
preemption, or the SIGTERM of ``GraceTime``/``KillWait`` — is the job's notice: the job
is stopped at a step every rank agrees on, with a checkpoint first, and once it stopped
the Slurm job is requeued (``scontrol requeue``) and this exits with
:data:`ringmaster.slurm.REQUEUE_EXIT`. The same happens when the coordinator stops the
job because the allocation has too few nodes left to continue it. The requeued batch
script starts the job again, and it resumes from that checkpoint.

A SIGTERM is told apart by Slurm's own record of the job at that moment
(:func:`ringmaster.slurm.ending`): the scheduler's cancel (``scancel``) stops the job the
same way, with its checkpoint, but asks for no requeue and exits 1; a time limit or a
preemption goes the requeue way.

Exit: 0 completed, 1 failed (or stopped, or cancelled), :data:`~ringmaster.slurm.REQUEUE_EXIT`
requeue.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from nats.errors import Error as NatsError

from coordinator.ctl.bus import Session
from coordinator.ctl.errors import CtlError
from proto.api import JobControl
from proto.job import Allocation, JobRecord, JobSpec, JobState
from ringmaster import slurm
from ringmaster.procs import wait_until_async

NOTICES = (signal.SIGUSR1, signal.SIGTERM)
RECONNECT_S = 1.0


def inside_allocation(spec: JobSpec) -> Allocation | None:
    """The Slurm allocation ``start`` runs in (None outside one), checked against the
    job: it must hold the job's ``min_nodes`` at least."""
    try:
        found = slurm.allocation()
    except slurm.SlurmError as exc:
        raise CtlError(f"inside Slurm job, but its nodes are unknown: {exc}") from None
    if found is None:
        return None
    need = spec.job.min_nodes or spec.job.nodes
    if len(found.hosts) < need:
        raise CtlError(
            f"Slurm job {found.job_id} has {len(found.hosts)} nodes ({', '.join(found.hosts)}); "
            f"the job needs {need} (job.nodes = {spec.job.nodes})",
            code=2,
        )
    return Allocation(job_id=found.job_id, hosts=found.hosts, restarts=found.restarts)


async def follow(
    s: Session,
    job_id: str,
    allocation: Allocation | None,
    reconnect: Callable[[], AbstractAsyncContextManager[Session]],
) -> int:
    """Follow ``job_id`` until it ends; state changes and progress go to stderr. The bus
    going away (a server restarting, frozen) is waited out, reconnecting with
    ``reconnect()``: following must not end, or fail the Slurm job, while the job trains."""
    noticed: list[int] = []
    loop = asyncio.get_running_loop()
    if allocation is not None:
        for sig in NOTICES:
            loop.add_signal_handler(sig, noticed.append, sig)
    asked, cancelled = False, False
    last: tuple[str, int] | None = None
    shown = 0.0

    async def ended() -> JobRecord | None:
        nonlocal last, shown, asked, cancelled
        if noticed and not asked and allocation is not None:
            try:
                cancelled = await _stop(s, job_id, noticed[0], allocation)
                asked = True
            except CtlError as exc:  # no leader this moment (a takeover): ask again
                print(f"{job_id}: the stop is not delivered yet: {exc}", file=sys.stderr)
        job = await s.record("jobs", job_id, JobRecord)
        if job is None:
            return None
        now = time.monotonic()
        if last is None or job.state.value != last[0] or now - shown > 5:
            print(
                f"{job_id}: {job.state.value} step {job.step}/{job.target_steps}"
                + (f" loss {job.loss:.3f}" if job.loss is not None else "")
                + (f" ({job.reason})" if job.reason else ""),
                file=sys.stderr,
            )
            last, shown = (job.state.value, job.step), now
        return job if job.state.terminal else None

    try:
        async with contextlib.AsyncExitStack() as sessions:
            while True:
                try:
                    job = await wait_until_async(ended, timeout=None, interval=0.5)
                    break
                except (NatsError, TimeoutError, OSError) as exc:
                    print(
                        f"{job_id}: bus away ({exc or type(exc).__name__}); waiting",
                        file=sys.stderr,
                    )
                    s = await _again(sessions, reconnect)
        if allocation is not None and job.requeue and not cancelled:
            # the requeue makes Slurm signal this step again: still handled, not fatal
            return await asyncio.to_thread(_requeue, allocation)
        if allocation is not None and cancelled:
            print(
                f"Slurm job {allocation.job_id} cancelled: {job_id} {job.state.value} at step "
                f"{job.step}, not requeued; exit 1",
                file=sys.stderr,
            )
        return 0 if job.state is JobState.COMPLETED else 1
    finally:
        for sig in NOTICES if allocation is not None else ():
            loop.remove_signal_handler(sig)


async def _again(
    sessions: contextlib.AsyncExitStack,
    reconnect: Callable[[], AbstractAsyncContextManager[Session]],
) -> Session:
    """A new session once the bus answers again (tried every :data:`RECONNECT_S`)."""
    while True:
        await asyncio.sleep(RECONNECT_S)
        try:
            return await sessions.enter_async_context(reconnect())
        except CtlError:
            continue


async def _stop(s: Session, job_id: str, signum: int, allocation: Allocation) -> bool:
    """Stop the job for Slurm's signal, to be requeued unless Slurm cancelled it; True
    for a cancel."""
    kind, why = await asyncio.to_thread(_why, signal.Signals(signum).name, allocation)
    cancel = kind == slurm.CANCEL
    stop = JobControl(job=job_id, action="stop", reason=why, requeue=not cancel)
    reply = await s.ask("control", stop)
    then = "not to be requeued" if cancel else "to be requeued"
    if not reply.ok:
        print(f"{job_id}: {why}; the stop was refused: {reply.error}", file=sys.stderr)
    else:  # a loop that cannot checkpoint is stopped without one, and the reply says so
        how = reply.note or "at a checkpoint"
        print(f"{job_id}: {why}; stopping ({how}) {then}", file=sys.stderr)
    return cancel


def _why(name: str, allocation: Allocation) -> tuple[str, str]:
    """What Slurm's signal means (:func:`ringmaster.slurm.ending`); Slurm not answering
    leaves it a notice that the allocation ends, as before the record could be read."""
    fields: dict[str, str] = {}
    if name == "SIGTERM":
        try:
            fields = slurm.job_fields(allocation.job_id)
        except slurm.SlurmError as exc:
            print(f"warning: Slurm job {allocation.job_id} not read: {exc}", file=sys.stderr)
    return slurm.ending(name, fields, allocation.restarts)


def _requeue(allocation: Allocation) -> int:
    """``scontrol requeue`` unless Slurm requeued this run already (a preemption with
    ``PreemptMode=REQUEUE`` does before the job has stopped, and refuses a second one)."""
    job_id = allocation.job_id
    said = f"Slurm job {job_id} already requeued by Slurm"
    if not _requeued_since(allocation):
        try:
            slurm.requeue(job_id)
            said = f"requeued Slurm job {job_id}"
        except slurm.SlurmError as exc:  # --no-requeue, or Slurm away: the exit code says it
            if not _requeued_since(allocation):  # nor by Slurm meanwhile
                said = f"warning: Slurm job {job_id} not requeued: {exc}"
    print(f"{said}; exit {slurm.REQUEUE_EXIT} (requeue me)", file=sys.stderr)
    return slurm.REQUEUE_EXIT


def _requeued_since(allocation: Allocation) -> bool:
    """Slurm has requeued the job since this run began (its count is past this run's)."""
    try:
        return slurm.restarts(allocation.job_id) > allocation.restarts
    except slurm.SlurmError:
        return False  # Slurm away: the requeue's own answer is the one to show
