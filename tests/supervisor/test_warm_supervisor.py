"""The supervisor running ranks in spares forked from the node's template, with real
processes: recorded, stopped and reported like any rank (a SIGKILL as signal 9, though the
rank is not the agent's child); a user's entry script run as ``__main__``, its libraries
imported by the template once for every spare after it; a template that gains a thread
doing so leaves the spares to ``exec``."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from supervisor_waits import until
from warm_stand_in import stand_in, starts

from nodeagent.supervisor import Supervisor
from proto.commands import Launch, RankSpec
from proto.events import EventBase, WorkerExited
from proto.job import JobSection, JobSpec
from proto.progress import Progress
from ringmaster.procs import start_time
from ringmaster.rundir import JobDir, LiveRank, live_ranks

pytestmark = pytest.mark.anyio


class Agent:
    def __init__(self, tmp_path: Path) -> None:
        self.events: list[EventBase] = []
        self.sup = Supervisor(
            "n", tmp_path / "run", self.event, self.progress, warm_command=stand_in(tmp_path)
        )

    async def event(self, event: EventBase) -> None:
        self.events.append(event)

    async def progress(self, job: str, message: Progress) -> None:
        pass

    def exits(self) -> list[WorkerExited]:
        return [e for e in self.events if isinstance(e, WorkerExited)]

    def spare(self) -> int:
        return self.sup.warm.spares[0].pid


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    made = Agent(tmp_path)
    try:
        made.sup.warm_ranks(1)
        await until(lambda: made.sup.warm.ready() == 1)
        yield made
    finally:
        for job in list(made.sup.runs):
            await made.sup.stop(job, force=True, grace_s=0)
        await made.sup.close()


def launch(tmp_path: Path, *argv: str, **env: str) -> Launch:
    return Launch(
        job="j1",
        attempt=2,
        ranks=[RankSpec(rank=0, local_rank=0)],
        spec=JobSpec(job=JobSection(name="j")),
        env={"SLEEP": "600", **env},
        argv=list(argv),
        workdir=str(tmp_path),
    )


async def test_the_trainer_runs_in_a_fork_and_stops_like_any_rank(
    agent: Agent, tmp_path: Path
) -> None:
    spare = agent.spare()
    [pid] = await agent.sup.launch(launch(tmp_path))
    assert pid == spare  # the built-in trainer: started warm, in a fork
    job = JobDir(agent.sup.run_dir, "j1")
    assert job.rank_pid(0).read_text() == f"{pid} {start_time(pid)}"
    assert live_ranks(agent.sup.run_dir) == [LiveRank("j1", 0, pid)]
    await until(lambda: "rank 0 in" in job.rank_log(0).read_text())
    await agent.sup.stop("j1", force=True, grace_s=0)  # killpg by the rank's PID
    [exit_] = agent.exits()
    assert exit_.pid == pid and exit_.signal == signal.SIGTERM and exit_.attempt == 2
    assert live_ranks(agent.sup.run_dir) == []


async def test_a_forked_rank_killed_by_sigkill_is_reported_as_signal_9(
    agent: Agent, tmp_path: Path
) -> None:
    [pid] = await agent.sup.launch(launch(tmp_path))
    await until(lambda: "rank 0 in" in JobDir(agent.sup.run_dir, "j1").rank_log(0).read_text())
    os.kill(pid, signal.SIGKILL)
    await until(lambda: agent.exits())
    [exit_] = agent.exits()
    assert (exit_.pid, exit_.exit_code, exit_.signal) == (pid, None, signal.SIGKILL)
    assert "signal 9" in exit_.message


async def test_a_scripts_libraries_are_imported_by_the_template_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "marker_lib.py").write_text(
        f"with open({str(tmp_path / 'imported')!r}, 'a') as f:\n    f.write('x')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(libs))  # the agent's, and so its interpreters'
    entry = tmp_path / "user" / "train.py"
    entry.parent.mkdir()
    said = tmp_path / "said"
    entry.write_text(
        "import sys, time\n"
        "preloaded = 'marker_lib' in sys.modules\n"
        "import marker_lib\n"
        f"open({str(said)!r}, 'a').write(f'{{__name__}} {{sys.argv}} {{preloaded}}\\n')\n"
        "time.sleep(600)\n"
    )
    made = Agent(tmp_path)
    sup = made.sup
    try:
        sup.warm_ranks(1)
        await until(lambda: sup.warm.ready() == 1)
        argv = [str(entry), "--lr", "1e-4"]
        for attempt in (1, 2, 3):
            spare = made.spare()
            cmd = msgspec.structs.replace(launch(tmp_path, *argv), attempt=attempt)
            [pid] = await sup.launch(cmd)
            assert pid == spare and sup.warm.preload == str(entry)
            await until(lambda n=attempt: said.exists() and said.read_text().count("\n") == n)
            await sup.stop("j1", force=True, grace_s=0)
            await until(lambda: sup.warm.ready() == 1)
        # the first ran before the template imported its libraries; the others after
        lines = said.read_text().splitlines()
        assert lines == [f"__main__ {argv} {p}" for p in ("False", "True", "True")]
        assert sup.warm.templates.preloaded == str(entry)
        assert (tmp_path / "imported").read_text() == "xx"  # its rank's own, the template's
        assert starts(tmp_path) == 1
    finally:
        for job in list(sup.runs):
            await sup.stop(job, force=True, grace_s=0)
        await sup.close()


async def test_a_template_that_gains_a_thread_leaves_the_spares_to_exec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script's library starts a thread on import: the template imports it for the
    spares, then forks no more, and the spares are started with exec; ranks start warm."""
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "threaded_lib.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(libs))
    entry = tmp_path / "user" / "train.py"
    entry.parent.mkdir()
    entry.write_text("import threaded_lib\nimport time\ntime.sleep(600)\n")
    made = Agent(tmp_path)
    sup = made.sup
    try:
        sup.warm_ranks(1)
        await until(lambda: sup.warm.ready() == 1)
        forked = made.spare()
        [pid] = await sup.launch(launch(tmp_path, str(entry)))
        assert pid == forked
        await until(lambda: not sup.warm.templates.forks and sup.warm.ready() == 1)
        exec_d = made.spare()
        assert sup.warm.spares[0].child is not None and sup.warm.templates.current is None
        await sup.stop("j1", force=True, grace_s=0)
        [pid] = await sup.launch(msgspec.structs.replace(launch(tmp_path, str(entry)), attempt=3))
        assert pid == exec_d  # warm still
        assert starts(tmp_path) == 2  # the template, then an exec'd spare
    finally:
        for job in list(sup.runs):
            await sup.stop(job, force=True, grace_s=0)
        await sup.close()
