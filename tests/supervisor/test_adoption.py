"""An agent restarted under running ranks adopts them, with real processes: the control
channel reopens, exits are reported (status from the exit record, unknown without one),
and the heartbeat's rank reports follow attempts; a stop of an older attempt is ignored."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from supervisor_waits import until

from nodeagent import adoption
from nodeagent.adoption import AdoptedRank
from nodeagent.commands import CommandHandler
from nodeagent.rank_reports import launched, rank_reports
from nodeagent.supervisor import Supervisor
from proto.codec import encode
from proto.commands import Launch, RankSpec, Stop
from proto.events import EventBase, Severity, WorkerExited
from proto.job import JobSection, JobSpec
from proto.node import RANK_MEMORY_S, RankReport
from proto.progress import Progress, StepDone
from ringmaster import rankbeat
from ringmaster.procs import pid_alive, start_time
from ringmaster.rundir import JobDir, write_exit

pytestmark = pytest.mark.anyio

# A stand-in rank. It exits when told to by a file ORDERS/exit-<rank> ("<code>", or
# "<code> norecord" to leave no exit record), as the trainer does: the record first.
# Rank 0 talks to the agent like trainer.agent_link: progress out, control words echoed
# back as steps 100+seq, reconnecting while the agent is away.
RANK = textwrap.dedent(
    """
    import json, os, socket, threading, time
    from pathlib import Path
    from ringmaster.rundir import exit_beside, write_exit
    rank = int(os.environ["RANK"])
    order = Path(os.environ["ORDERS"]) / f"exit-{rank}"
    def orders():
        while not order.exists():
            time.sleep(0.02)
        code, _, how = order.read_text().partition(" ")
        if how != "norecord":
            spec = Path(os.environ["RINGMASTER_JOB_SPEC"])
            write_exit(exit_beside(spec, rank), os.getpid(), int(code))
        os._exit(int(code))
    threading.Thread(target=orders, daemon=True).start()
    step = 0
    while rank == 0:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(os.environ["RINGMASTER_CONTROL_SOCKET"])
            step += 1
            s.sendall(json.dumps({"type": "step", "step": step}).encode() + b"\\n")
            for line in s.makefile("r"):
                seq = json.loads(line)["seq"]
                s.sendall(json.dumps({"type": "step", "step": 100 + seq}).encode() + b"\\n")
        except OSError:
            time.sleep(0.05)
        s.close()
    time.sleep(600)
    """
)


class Sink:
    def __init__(self) -> None:
        self.events: list[EventBase] = []
        self.progress: list[Progress] = []

    async def event(self, e: EventBase) -> None:
        self.events.append(e)

    async def prog(self, job: str, p: Progress) -> None:
        self.progress.append(p)

    def exits(self) -> dict[int, WorkerExited]:
        return {e.rank: e for e in self.events if isinstance(e, WorkerExited)}


def launch_cmd(tmp_path: Path, attempt: int, ranks: int = 2) -> Launch:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    (tmp_path / "orders").mkdir(exist_ok=True)
    return Launch(
        job="j1",
        attempt=attempt,
        ranks=[RankSpec(rank=r, local_rank=r) for r in range(ranks)],
        spec=JobSpec(job=JobSection(name="j")),
        argv=[str(script)],
        env={"ORDERS": str(tmp_path / "orders")},
        workdir=str(tmp_path),
    )


def order_exit(tmp_path: Path, rank: int, order: str) -> None:
    tmp = tmp_path / "orders" / f".exit-{rank}"
    tmp.write_text(order)
    tmp.replace(tmp_path / "orders" / f"exit-{rank}")


def report(sup: Supervisor, rank: int) -> RankReport:
    [found] = [r for r in sup.rank_reports() if r.rank == rank]
    return found


class Agents:
    """Supervisors over one run directory, as successive agent processes; whatever ranks
    are left are killed at the end."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.made: list[tuple[Supervisor, Sink]] = []

    def start(self) -> tuple[Supervisor, Sink]:
        sink = Sink()
        sup = Supervisor("n", self.run_dir, sink.event, sink.prog)
        self.made.append((sup, sink))
        return sup, sink

    async def close(self) -> None:
        for sup, _ in reversed(self.made):
            for job in list(sup.runs):
                await sup.stop(job, force=True, grace_s=0)
            await sup.close()


@pytest.fixture
async def agents(tmp_path: Path) -> AsyncIterator[Agents]:
    made = Agents(tmp_path / "run")
    try:
        yield made
    finally:
        await made.close()


async def test_adopted_ranks_talk_again_and_report_their_exits(
    agents: Agents, tmp_path: Path
) -> None:
    first, _ = agents.start()
    pids = await first.launch(launch_cmd(tmp_path, attempt=3))
    await first.close()  # the agent goes; its ranks live on
    second, sink = agents.start()
    assert await second.adopt() == ["j1"]
    assert second.jobs() == ["j1"] and second.runs["j1"].attempt == 3
    assert second.launched() == {"j1": 3}  # its beats speak for the adopted attempt
    assert [(r.rank, r.pid, r.alive, r.attempt) for r in second.rank_reports()] == [
        (0, pids[0], True, 3),
        (1, pids[1], True, 3),
    ]
    # rank 0 reconnects to the reopened socket: progress comes in, control words go out
    await second.control("j1", "checkpoint")
    await until(lambda: any(isinstance(p, StepDone) and p.step == 101 for p in sink.progress))
    assert {p.attempt for p in sink.progress} == {3}

    order_exit(tmp_path, 1, "7")
    await until(lambda: 1 in sink.exits())
    exited = sink.exits()[1]
    assert (exited.exit_code, exited.signal, exited.attempt, exited.pid) == (7, None, 3, pids[1])
    assert (report(second, 1).alive, report(second, 1).exit_code) == (False, 7)

    os.kill(pids[0], signal.SIGKILL)  # no exit record: the status is unknown
    await until(lambda: 0 in sink.exits())
    killed = sink.exits()[0]
    assert (killed.exit_code, killed.signal) == (None, None)
    assert "unknown" in killed.message and killed.severity is Severity.CRITICAL
    assert not report(second, 0).alive and second.jobs() == []


async def test_a_rank_that_died_while_no_agent_was_there_is_reported_on_adoption(
    agents: Agents, tmp_path: Path
) -> None:
    first, _ = agents.start()
    pids = await first.launch(launch_cmd(tmp_path, attempt=2))
    await first.close()
    order_exit(tmp_path, 1, "0 norecord")
    await until(lambda: not pid_alive(pids[1]))
    second, sink = agents.start()
    assert await second.adopt() == ["j1"]
    await until(lambda: 1 in sink.exits())
    assert (sink.exits()[1].exit_code, sink.exits()[1].signal) == (None, None)
    assert report(second, 0).alive and not report(second, 1).alive
    assert second.jobs() == ["j1"]


async def test_a_job_without_a_live_rank_is_not_adopted(agents: Agents, tmp_path: Path) -> None:
    first, _ = agents.start()
    [pid] = await first.launch(launch_cmd(tmp_path, attempt=1, ranks=1))
    await first.close()
    order_exit(tmp_path, 0, "0")
    await until(lambda: not pid_alive(pid))
    second, sink = agents.start()
    assert await second.adopt() == []
    assert second.rank_reports() == [] and sink.events == []


async def test_a_new_launch_replaces_the_old_attempts_reports(
    agents: Agents, tmp_path: Path
) -> None:
    sup, sink = agents.start()
    await sup.launch(launch_cmd(tmp_path, attempt=1))
    job = JobDir(sup.run_dir, "j1")
    rankbeat.write(job.rank_beat(1), rankbeat.RankBeat(pid=1, step=42))
    assert report(sup, 1).last_step == 42 and report(sup, 0).last_step == 0
    order_exit(tmp_path, 1, "5")
    await until(lambda: 1 in sink.exits())
    await sup.stop("j1", force=True, grace_s=0)
    # the exited attempt stays reported, with its statuses, until the next launch
    reports = sup.rank_reports()
    assert [(r.attempt, r.alive, r.exit_code, r.signal) for r in reports] == [
        (1, False, None, signal.SIGTERM),
        (1, False, 5, None),
    ]
    last_exit = max(e.at for e in sup.runs["j1"].exits.values())
    assert len(rank_reports(sup.runs, sup.run_dir, last_exit + RANK_MEMORY_S - 1)) == 2
    assert rank_reports(sup.runs, sup.run_dir, last_exit + RANK_MEMORY_S + 1) == []
    assert launched(sup.runs, last_exit + RANK_MEMORY_S + 1) == {}  # forgotten with them

    (tmp_path / "orders" / "exit-1").unlink()
    [pid] = await sup.launch(launch_cmd(tmp_path, attempt=2, ranks=1))
    assert [(r.rank, r.attempt, r.pid, r.alive) for r in sup.rank_reports()] == [(0, 2, pid, True)]
    # the old attempt's files are gone, so an agent restarted now finds attempt 2 alone
    assert not job.rank_pid(1).exists() and not job.rank_exit(1).exists()
    assert not job.rank_beat(1).exists() and job.read_attempt() == 2


async def test_a_beat_names_an_attempt_only_once_its_launch_has_started_every_rank(
    agents: Agents, tmp_path: Path
) -> None:
    """While a launch is under way (here its pre-start hook runs) the reports lack some
    of its ranks, so the attempt is not named as launched: a beat built then cannot say
    a rank is missing. Once the launch is answered, the reports list every rank and the
    attempt is named; the answer says which agent process gave it."""
    sup, sink = agents.start()
    handler = CommandHandler("n", sup.run_dir, sup, "127.0.0.1", sink.event, started_at=5.0)
    await sup.launch(launch_cmd(tmp_path, attempt=1, ranks=1))
    assert sup.launched() == {"j1": 1}
    await sup.stop("j1", force=True, grace_s=0)
    hook = tmp_path / "pre-start.sh"
    hook.write_text(
        f"touch {tmp_path}/hook-started\nwhile [ ! -e {tmp_path}/go ]; do sleep 0.05; done\n"
    )
    cmd = launch_cmd(tmp_path, attempt=2)
    cmd.pre_start = str(hook)
    answer = asyncio.create_task(handler.handle(encode(cmd)))
    await until(lambda: (tmp_path / "hook-started").exists())
    assert sup.launched() == {} and sup.rank_reports() == []  # attempt 2 under way
    (tmp_path / "go").touch()
    reply = await answer
    assert reply.ok and reply.started_at == 5.0
    assert sup.launched() == {"j1": 2}
    assert [(r.rank, r.attempt) for r in sup.rank_reports()] == [(0, 2), (1, 2)]


async def test_a_stop_of_an_older_attempt_leaves_the_newer_run_alone(
    agents: Agents, tmp_path: Path
) -> None:
    sup, sink = agents.start()
    handler = CommandHandler("n", sup.run_dir, sup, "127.0.0.1", sink.event)
    [pid] = await sup.launch(launch_cmd(tmp_path, attempt=4, ranks=1))
    reply = await handler.handle(encode(Stop(job="j1", attempt=3, force=True, grace_s=0)))
    assert reply.ok and pid_alive(pid) and sup.jobs() == ["j1"] and sink.exits() == {}
    reply = await handler.handle(encode(Stop(job="j1", attempt=4, force=True, grace_s=0)))
    assert reply.ok and not pid_alive(pid) and sink.exits()[0].attempt == 4


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
async def test_an_adopted_rank_is_seen_to_exit_with_or_without_a_pidfd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfd: bool
) -> None:
    if not pidfd:

        def unavailable(pid: int) -> int:
            raise OSError("pidfd_open: not here")

        monkeypatch.setattr(adoption.os, "pidfd_open", unavailable)
    proc = sleeper()
    try:
        record = tmp_path / "rank-0.exit"
        write_exit(record, proc.pid + 1, 3)  # another process's record: not this rank's
        rank = AdoptedRank("j", proc.pid, start_time(proc.pid), record)
        waiting = asyncio.create_task(rank.wait())
        await until(lambda: rank.ran)
        assert not waiting.done()
        proc.terminate()
        await until(lambda: not pid_alive(proc.pid))  # exited, not reaped yet
        # its parent leaves the status it reaps, as a template does for a rank it forked
        write_exit(record, proc.pid, -signal.SIGTERM)
        await asyncio.to_thread(proc.wait)
        assert await asyncio.wait_for(waiting, 20) == -signal.SIGTERM == rank.returncode
    finally:
        proc.kill()
        proc.wait()


async def test_a_reused_pid_is_not_taken_for_the_rank(tmp_path: Path) -> None:
    proc = sleeper()
    try:
        started = start_time(proc.pid)
        assert started is not None
        rank = AdoptedRank("j", proc.pid, started - 1, tmp_path / "rank-0.exit")
        assert await rank.wait() is None and not rank.ran
    finally:
        proc.kill()
        proc.wait()
