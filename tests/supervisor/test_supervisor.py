"""The rank supervisor with real processes: launch, control relay over the Unix socket,
exit reports, and stops that leave no process of the rank's group behind."""

from __future__ import annotations

import asyncio
import os
import textwrap
from pathlib import Path

import pytest

from nodeagent.supervisor import Supervisor, socket_path
from proto.commands import Launch, RankSpec
from proto.events import EventBase, WorkerExited
from proto.job import JobSection, JobSpec
from proto.progress import Progress, StepDone

pytestmark = pytest.mark.anyio

# A stand-in rank: reports a step over the control socket, echoes control words back as
# steps, spawns a grandchild (to prove the whole process group is stopped), and ignores
# SIGTERM when asked to, so the SIGKILL escalation is exercised too.
RANK = textwrap.dedent(
    """
    import json, os, signal, socket, subprocess, sys, time
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["CHILD_PID_FILE"] + os.environ["RANK"], "w").write(str(child.pid))
    if os.environ["RANK"] == "0":
        s = socket.socket(socket.AF_UNIX)
        s.connect(os.environ["RINGMASTER_CONTROL_SOCKET"])
        s.sendall(b'{"type": "step", "step": 1, "loss": 2.5}\\n')
        f = s.makefile("r")
        for line in f:
            word = json.loads(line)
            if word["action"] == "stop":
                sys.exit(0)
            s.sendall(json.dumps({"type": "step", "step": 100 + word["seq"]}).encode() + b"\\n")
    time.sleep(600)
    """
)


def launch_cmd(tmp_path: Path, ranks: int = 2) -> Launch:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return Launch(
        job="j1",
        attempt=1,
        ranks=[RankSpec(rank=r, local_rank=r) for r in range(ranks)],
        spec=JobSpec(job=JobSection(name="j")),
        argv=[str(script)],
        env={"CHILD_PID_FILE": str(tmp_path / "child-")},
        workdir=str(tmp_path),
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def until(pred, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


class Sink:
    def __init__(self) -> None:
        self.events: list[EventBase] = []
        self.progress: list[Progress] = []

    async def event(self, e: EventBase) -> None:
        self.events.append(e)

    async def prog(self, job: str, p: Progress) -> None:
        self.progress.append(p)


async def test_progress_and_control_flow_through_the_socket(tmp_path: Path) -> None:
    sink = Sink()
    sup = Supervisor("n", tmp_path / "run", sink.event, sink.prog)
    pids = await sup.launch(launch_cmd(tmp_path))
    assert len(pids) == 2 and sup.jobs() == ["j1"]
    await until(lambda: any(isinstance(p, StepDone) and p.step == 1 for p in sink.progress))
    await sup.control("j1", "pause")
    await sup.control("j1", "resume")
    await until(lambda: [p.step for p in sink.progress] == [1, 101, 102])
    await sup.stop("j1", force=False, grace_s=1)
    exits = {e.rank: e for e in sink.events if isinstance(e, WorkerExited)}
    assert exits[0].exit_code == 0  # rank 0 obeyed the stop word
    assert exits[1].signal is not None  # rank 1 was terminated after the grace period
    children = [int((tmp_path / f"child-{r}").read_text()) for r in (0, 1)]
    await until(lambda: not [p for p in [*pids, *children] if alive(p)], timeout=5)


async def test_forced_stop_escalates_to_sigkill_and_kills_the_group(tmp_path: Path) -> None:
    sink = Sink()
    sup = Supervisor("n", tmp_path / "run", sink.event, sink.prog)
    sup.shm = tmp_path / "shm"
    staged = sup.shm / "ringmaster-j1" / "rank-0"
    staged.mkdir(parents=True)
    cmd = launch_cmd(tmp_path, ranks=1)
    cmd.env["IGNORE_TERM"] = "1"
    [pid] = await sup.launch(cmd)
    await until(lambda: (tmp_path / "child-0").exists())
    child = int((tmp_path / "child-0").read_text())
    await sup.stop("j1", force=True, grace_s=0)
    await until(lambda: not alive(pid) and not alive(child), timeout=5)
    [exit_] = [e for e in sink.events if isinstance(e, WorkerExited)]
    assert exit_.signal == 9 and exit_.attempt == 1
    assert not staged.parent.exists(), "RAM staging of dead ranks must be removed"


async def test_a_second_launch_of_a_live_job_is_refused(tmp_path: Path) -> None:
    sink = Sink()
    sup = Supervisor("n", tmp_path / "run", sink.event, sink.prog)
    await sup.launch(launch_cmd(tmp_path, ranks=1))
    with pytest.raises(Exception, match="already has live ranks"):
        await sup.launch(launch_cmd(tmp_path, ranks=1))
    await sup.stop("j1", force=True, grace_s=0)


def test_long_job_directories_get_a_short_socket_path(tmp_path: Path) -> None:
    short = socket_path(tmp_path / "j")
    assert short == tmp_path / "j" / "control.sock"
    deep = tmp_path / ("x" * 120) / "jobs" / "j1"
    path = socket_path(deep)
    assert len(os.fsencode(path)) < 100 and path != socket_path(deep.parent / "j2")
