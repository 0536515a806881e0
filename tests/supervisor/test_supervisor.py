"""The rank supervisor with real processes: launch, control relay over the Unix socket,
exit reports, and stops that leave no process of the rank's group behind."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from supervisor_waits import until

from nodeagent.supervisor import Supervisor, SupervisorError
from proto.commands import Launch, RankSpec
from proto.events import EventBase, WorkerExited
from proto.job import JobSection, JobSpec
from proto.progress import Progress, StepDone
from ringmaster.procs import pid_alive, read_pid
from ringmaster.rundir import JobDir, LiveRank, compile_cache, live_ranks

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


class Sink:
    def __init__(self) -> None:
        self.events: list[EventBase] = []
        self.progress: list[Progress] = []

    async def event(self, e: EventBase) -> None:
        self.events.append(e)

    async def prog(self, job: str, p: Progress) -> None:
        self.progress.append(p)


def environment_of(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
async def sup(tmp_path: Path, sink: Sink) -> AsyncIterator[Supervisor]:
    """A supervisor whose ranks (and their process groups) are killed at the end, whatever
    the test's outcome."""
    supervisor = Supervisor("n", tmp_path / "run", sink.event, sink.prog)
    try:
        yield supervisor
    finally:
        for job in list(supervisor.runs):
            await supervisor.stop(job, force=True, grace_s=0)
        await supervisor.close()


async def test_progress_and_control_flow_through_the_socket(
    sup: Supervisor, sink: Sink, tmp_path: Path
) -> None:
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
    assert sup.jobs() == []
    children = [int((tmp_path / f"child-{r}").read_text()) for r in (0, 1)]
    await until(lambda: not [p for p in [*pids, *children] if pid_alive(p)], timeout=5)


async def test_ranks_get_the_run_dir_layout_and_the_rank_marker(
    sup: Supervisor, tmp_path: Path
) -> None:
    pids = await sup.launch(launch_cmd(tmp_path))
    job = JobDir(sup.run_dir, "j1")
    assert job.spec.exists() and job.rank_log(0).exists()
    assert [read_pid(job.rank_pid(r)) for r in (0, 1)] == pids
    assert live_ranks(sup.run_dir) == [LiveRank("j1", r, pid) for r, pid in enumerate(pids)]
    cache = f"RINGMASTER_COMPILE_CACHE={compile_cache(sup.run_dir)}".encode()
    # The parent learns of a successful exec before the kernel has laid out the new
    # image's environment: /proc/<pid>/environ reads empty for a moment.
    await until(lambda: environment_of(pids[1]) != [b""], timeout=5)
    assert cache in environment_of(pids[1])  # the node's compile cache outlives the rank


async def test_forced_stop_escalates_to_sigkill_and_kills_the_group(
    sup: Supervisor, sink: Sink, tmp_path: Path
) -> None:
    sup.shm = tmp_path / "shm"
    staged = sup.shm / "ringmaster-j1" / "rank-0"
    staged.mkdir(parents=True)
    cmd = launch_cmd(tmp_path, ranks=1)
    cmd.env["IGNORE_TERM"] = "1"
    [pid] = await sup.launch(cmd)
    await until(lambda: (tmp_path / "child-0").exists())
    child = int((tmp_path / "child-0").read_text())
    await sup.stop("j1", force=True, grace_s=0)
    await until(lambda: not pid_alive(pid) and not pid_alive(child), timeout=5)
    [exit_] = [e for e in sink.events if isinstance(e, WorkerExited)]
    assert exit_.signal == 9 and exit_.attempt == 1
    assert not staged.parent.exists(), "RAM staging of dead ranks must be removed"


async def test_a_second_launch_of_a_live_job_is_refused(sup: Supervisor, tmp_path: Path) -> None:
    [pid] = await sup.launch(launch_cmd(tmp_path, ranks=1))
    with pytest.raises(SupervisorError, match=r"job j1 already has live ranks \[0\]"):
        await sup.launch(launch_cmd(tmp_path, ranks=1))
    assert pid_alive(pid), "the refused launch must leave the running rank alone"


async def test_node_defaults_reach_ranks_and_the_job_env_overrides_them(
    tmp_path: Path, sink: Sink
) -> None:
    defaults = {"GLOO_SOCKET_IFNAME": "data0", "NCCL_SOCKET_IFNAME": "data0"}
    supervisor = Supervisor("n", tmp_path / "run", sink.event, sink.prog, rank_defaults=defaults)
    cmd = launch_cmd(tmp_path, ranks=1)
    cmd.env["NCCL_SOCKET_IFNAME"] = "ib0"  # the job's own choice wins
    try:
        [pid] = await supervisor.launch(cmd)
        environ = environment_of(pid)
        assert b"GLOO_SOCKET_IFNAME=data0" in environ and b"NCCL_SOCKET_IFNAME=ib0" in environ
    finally:
        await supervisor.stop("j1", force=True, grace_s=0)
        await supervisor.close()
