"""Training ranks this node runs: start, relay control, stop, and report every exit.

Each rank runs in its own session (process group), so a stop reaches every process a rank
spawned, and an agent restart does not take the ranks with it. What the agent keeps per job
on disk (spec, PID and log files, control socket) is laid out by ``ringmaster.rundir``.

The built-in trainer's ranks, and a user's Python entry script's, start in a spare
interpreter that has already imported the training stack when one is ready
(``nodeagent.warm_pool``), else cold (an entry that is not a ``.py`` script always does);
either way the rank is a process in its own session whose PID is its process group's id,
watched, stopped and recorded the same way.

An agent started under running ranks (a restart) adopts them first (:meth:`Supervisor.adopt`,
``nodeagent.adoption``): their control channel reopens on the same socket, and their exits
are reported as a child's are. Every rank of each job's latest attempt, alive or exited, is
in the heartbeat's rank reports (``nodeagent.rank_reports``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from nodeagent.adoption import AdoptedRank, RankProcess, adoptable
from nodeagent.control_channel import ControlChannel
from nodeagent.rank_reports import RankExit, launched, rank_reports
from nodeagent.rank_start import rank_argv, rank_cpus, start_cold
from nodeagent.warm_pool import SPARE, WarmPool
from proto.codec import encode
from proto.commands import Launch
from proto.events import EventBase, Severity, WorkerExited
from proto.job import shm_staging_name
from proto.node import RankReport
from proto.progress import Progress
from proto.warm import WarmLaunch
from ringmaster import rank_env
from ringmaster.rundir import (
    JOB_ENV,
    JobDir,
    compile_cache,
    sim_knobs,
)

log = structlog.get_logger()
EventSink = Callable[[EventBase], Awaitable[None]]
ProgressSink = Callable[[str, Progress], Awaitable[None]]


class SupervisorError(RuntimeError):
    pass


@dataclass
class JobRun:
    job: str
    attempt: int
    channel: ControlChannel
    procs: dict[int, RankProcess] = field(default_factory=dict)
    waiters: dict[int, asyncio.Task[None]] = field(default_factory=dict)  # by rank
    exits: dict[int, RankExit] = field(default_factory=dict)  # ranks whose exit was seen
    peers: dict[str, str] = field(default_factory=dict)  # the job's other nodes' probe addrs
    launched: bool = False  # every rank of the attempt started (or adopted): all in procs

    def alive(self) -> list[int]:
        return [r for r, p in self.procs.items() if r not in self.exits and p.returncode is None]


class Supervisor:
    def __init__(
        self,
        node: str,
        run_dir: Path,
        on_event: EventSink,
        on_progress: ProgressSink,
        *,
        simulated: bool = False,
        warm_refill_delay_s: float = 0.0,
        warm_command: Sequence[str] = SPARE,
        warm_template: Path | None = None,
        rank_defaults: Mapping[str, str] | None = None,
    ) -> None:
        self.node = node
        # the node's own settings for its ranks (the data interface their collectives bind
        # to): over the agent's environment, under the job's
        self.rank_defaults = dict(rank_defaults or {})
        self.simulated = simulated  # ranks are told, for rehearsal-only knobs
        self.run_dir = run_dir
        self._on_event = on_event
        self._on_progress = on_progress
        self.runs: dict[str, JobRun] = {}
        self.shm = Path("/dev/shm")
        # spare interpreters for the built-in trainer (nodeagent.warm_pool); none until
        # warm_ranks() asks for some; forked from the machine's shared template, if given
        self.warm = WarmPool(
            0,
            run_dir,
            command=warm_command,
            refill_delay_s=warm_refill_delay_s,
            template_socket=warm_template,
        )

    def warm_ranks(self, spares: int) -> None:
        """Keep ``spares`` interpreters ready (0: none; started in the background, and
        launches never wait for them). Cheap to call again with the same number."""
        self.warm.resize(spares)

    def jobs(self) -> list[str]:
        return [job for job, run in self.runs.items() if run.alive()]

    def peers(self) -> dict[str, str]:
        """The other nodes of the jobs with live ranks here (node → probe host:port)."""
        return {n: a for run in self.runs.values() if run.alive() for n, a in run.peers.items()}

    def rank_reports(self) -> list[RankReport]:
        """Every rank of each job's latest attempt, for the heartbeat."""
        return rank_reports(self.runs, self.run_dir, time.monotonic())

    def launched(self) -> dict[str, int]:
        """Per job in the reports, the attempt whose launch is complete (for the heartbeat,
        read with :meth:`rank_reports` with nothing in between)."""
        return launched(self.runs, time.monotonic())

    async def adopt(self) -> list[str]:
        """Take over the ranks an earlier agent process started (``nodeagent.adoption``):
        each job with a live rank gets its control channel back on the same socket (rank 0
        reconnects) and every rank's exit is reported as a child's is, at once for a rank
        that died while no agent was there. Called once, as the agent starts, before any
        launch; the jobs adopted."""
        adopted = []
        for found in adoptable(self.run_dir):
            if found.job in self.runs:
                continue
            jobdir = JobDir(self.run_dir, found.job)
            channel = self._channel(jobdir, found.job, found.attempt)
            try:
                await channel.start()
            except OSError as exc:  # the ranks are still watched; rank 0 stays unreachable
                log.warning(
                    "cannot reopen the control socket", path=str(channel.path), error=str(exc)
                )
            run = JobRun(
                found.job, found.attempt, channel, peers=jobdir.read_peers(), launched=True
            )
            self.runs[found.job] = run
            for rank, (pid, started) in sorted(found.ranks.items()):
                proc = AdoptedRank(found.job, pid, started, jobdir.rank_exit(rank))
                run.procs[rank] = proc
                run.waiters[rank] = asyncio.create_task(self._watch(run, rank, proc))
            log.info(
                "ranks adopted", job=found.job, attempt=found.attempt, ranks=sorted(found.ranks)
            )
            adopted.append(found.job)
        return adopted

    def _channel(self, jobdir: JobDir, job: str, attempt: int) -> ControlChannel:
        async def progress(message: Progress) -> None:
            message.attempt = attempt  # stamped here: the rank need not know it
            await self._on_progress(job, message)

        return ControlChannel(jobdir.control_socket, progress)

    async def launch(self, cmd: Launch) -> list[int]:
        old = self.runs.get(cmd.job)
        if old is not None:
            if old.alive():
                raise SupervisorError(f"job {cmd.job} already has live ranks {old.alive()}")
            await old.channel.close()
        jobdir = JobDir(self.run_dir, cmd.job)
        jobdir.path.mkdir(parents=True, exist_ok=True)
        jobdir.spec.write_bytes(encode(cmd.spec))
        jobdir.clear_ranks()  # the previous attempt's ranks are gone
        jobdir.write_attempt(cmd.attempt)  # what a restarted agent adopts them as
        channel = self._channel(jobdir, cmd.job, cmd.attempt)
        try:
            await channel.start()
        except OSError as exc:
            raise SupervisorError(f"cannot open the control socket {channel.path}: {exc}") from exc
        jobdir.write_peers(cmd.peers)  # for an agent that adopts the ranks
        run = JobRun(cmd.job, cmd.attempt, channel, peers=dict(cmd.peers))
        self.runs[cmd.job] = run
        workdir = Path(cmd.workdir or jobdir.path)
        if cmd.pre_start:
            await self._pre_start(cmd, workdir, jobdir)
        argv = rank_argv(cmd.argv)
        for spec in cmd.ranks:
            env = {
                rank_env.COMPILE_CACHE: str(compile_cache(self.run_dir)),
                **os.environ,
                **self.rank_defaults,
                **cmd.env,
                "RANK": str(spec.rank),
                "LOCAL_RANK": str(spec.local_rank),
                rank_env.JOB_ID: cmd.job,
                rank_env.JOB_SPEC: str(jobdir.spec),
                rank_env.WORKDIR: str(workdir),
                rank_env.CONTROL_SOCKET: str(channel.path),
                rank_env.ATTEMPT: str(cmd.attempt),
                rank_env.NODE: self.node,
                rank_env.SIMULATED: "1" if self.simulated else "0",
            }
            if self.simulated:
                env[rank_env.SIM_KNOBS] = str(sim_knobs(self.run_dir))
            logpath = jobdir.rank_log(spec.rank)
            proc = None
            script = cmd.argv[0] if cmd.argv and cmd.argv[0].endswith(".py") else ""
            if script or not cmd.argv:  # the built-in trainer, or a user's Python script
                cpus = sorted(rank_cpus(spec.cpus) or [])
                launch = WarmLaunch(
                    env=env,
                    cwd=str(workdir),
                    log=str(logpath),
                    cpus=cpus,
                    argv=cmd.argv[1:],
                    script=script,
                )
                if script:
                    self.warm.preload = script  # the next spares import its libraries too
                proc = await self.warm.take(
                    launch, job=cmd.job, exit_record=jobdir.rank_exit(spec.rank)
                )
            warm = proc is not None
            if proc is None:
                try:
                    proc = await start_cold(argv, env, workdir, logpath, spec.cpus)
                except OSError as exc:
                    await self.stop(cmd.job, force=True, grace_s=0)
                    raise SupervisorError(f"cannot start rank {spec.rank}: {exc}") from exc
            run.procs[spec.rank] = proc
            jobdir.record_rank(spec.rank, proc.pid)
            run.waiters[spec.rank] = asyncio.create_task(self._watch(run, spec.rank, proc))
            log.info("rank started", job=cmd.job, rank=spec.rank, pid=proc.pid, warm=warm)
        run.launched = True  # from the next beat on, a rank of it not reported is not here
        return [p.pid for p in run.procs.values()]

    async def _pre_start(self, cmd: Launch, workdir: Path, jobdir: JobDir) -> None:
        """The job's pre-start hook, with the job's environment; its output goes to
        ``pre-start.log``. A failure or a timeout fails this launch."""
        assert cmd.pre_start is not None
        env = {**os.environ, **cmd.env, JOB_ENV: cmd.job, rank_env.NODE: self.node}
        logpath = jobdir.pre_start_log
        with logpath.open("ab") as logf:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh",
                cmd.pre_start,
                env=env,
                cwd=workdir,
                stdout=logf,
                stderr=logf,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        timeout = cmd.spec.job.pre_start_timeout_s
        try:
            code = await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise SupervisorError(f"pre-start hook ran past {timeout:.0f} s") from None
        if code != 0:
            tail = logpath.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            raise SupervisorError(f"pre-start hook exited {code}: {tail[0][:200]}")
        log.info("pre-start hook done", job=cmd.job)

    async def _watch(self, run: JobRun, rank: int, proc: RankProcess) -> None:
        code = await proc.wait()
        # Whatever the rank left behind in its group (data-loader workers, helpers) is an
        # orphan now: it goes too. The group id cannot be reused while members remain.
        if not isinstance(proc, AdoptedRank) or proc.ran:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        sig = -code if code is not None and code < 0 else None
        exit_code = code if code is not None and code >= 0 else None
        run.exits[rank] = RankExit(exit_code, sig, time.monotonic())
        if not run.alive():
            # A rank killed by a signal cannot clean its RAM staging; nobody else uses it.
            shutil.rmtree(self.shm / shm_staging_name(run.job), ignore_errors=True)
        if code is None:
            said = "an unknown status (not this agent's child, it left no exit record)"
        else:
            said = f"code {code}" if sig is None else f"signal {sig}"
        log.info("rank exited", job=run.job, rank=rank, code=code)
        await self._on_event(
            WorkerExited(
                node=self.node,
                job=run.job,
                rank=rank,
                pid=proc.pid,
                attempt=run.attempt,
                exit_code=exit_code,
                signal=sig,
                severity=Severity.INFO if code == 0 else Severity.CRITICAL,
                message=f"rank {rank} exited with {said}",
            )
        )

    async def control(self, job: str, action: str) -> None:
        run = self.runs.get(job)
        if run is None or not run.alive():
            raise SupervisorError(f"job {job} has no live ranks on this node")
        await run.channel.send(action)

    async def stop(self, job: str, *, force: bool, grace_s: float, attempt: int = 0) -> None:
        """Graceful: ask rank 0 to stop at the next step boundary, wait ``grace_s``; then
        SIGTERM every rank's process group, then SIGKILL. ``attempt`` (0: any): only a run
        of that attempt or an earlier one is stopped, never the one launched after it."""
        run = self.runs.get(job)
        if run is None:
            return
        if attempt and run.attempt > attempt:
            log.info(
                "stop of an earlier attempt ignored", job=job, attempt=attempt, runs=run.attempt
            )
            return
        if not force and run.alive():
            with contextlib.suppress(SupervisorError):
                await self.control(job, "stop")
            await _wait_all(run, grace_s)
        if run.alive():  # our SIGTERM means "exit now", not a notice to checkpoint for
            with contextlib.suppress(OSError):
                JobDir(self.run_dir, job).stopping.touch()
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if not run.alive():
                break
            for rank in run.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.procs[rank].pid, sig)
                    # a stopped rank (a hang) acts on SIGTERM only once continued
                    os.killpg(run.procs[rank].pid, signal.SIGCONT)
            await _wait_all(run, wait)
        await asyncio.gather(*run.waiters.values(), return_exceptions=True)

    async def close(self) -> None:
        """Agent shutdown: ranks keep running (they outlive an agent restart); spare
        interpreters do not."""
        await self.warm.close()
        for run in self.runs.values():
            await run.channel.close()
            for waiter in run.waiters.values():
                waiter.cancel()


async def _wait_all(run: JobRun, timeout: float) -> None:
    """Until every rank's exit is seen (its watcher is done), for at most ``timeout`` s."""
    pending = [run.waiters[r] for r in run.alive() if r in run.waiters]
    if pending:
        await asyncio.wait(pending, timeout=timeout)
