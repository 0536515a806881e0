"""Spares outlive an agent that dies: an agent process (a real one, driving a pool) is
killed, and a pool started after it on the same run directory takes its spares over, runs
a rank in one, and leaves alone what it must not adopt."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from supervisor_waits import until

from nodeagent.warm_pool import WarmPool
from proto.warm import WarmLaunch
from ringmaster.procs import pid_alive
from ringmaster.rundir import live_spares, recorded_spares, spare_dir

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]

# A spare: counts its starts, then serves a main that logs its rank, sleeps ($SLEEP) and
# leaves $CODE in the exit record the trainer would leave ($RECORD).
SPARE = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {repo!r})
    with open({counter!r}, "a") as f:
        f.write("x")
    from pathlib import Path
    from ringmaster.rundir import write_exit
    from trainer.warm import serve

    def main(argv):
        print("rank", os.environ.get("RANK"), flush=True)
        time.sleep(float(os.environ.get("SLEEP", "0")))
        code = int(os.environ.get("CODE", "0"))
        write_exit(Path(os.environ["RECORD"]), os.getpid(), code)
        return code

    serve(main)
    """
)
# An agent: a pool of one spare; prints the spare's PID once it is ready, then waits to
# be killed.
AGENT = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    from nodeagent.warm_pool import WarmPool

    async def main():
        pool = WarmPool(0, Path({run!r}), command={command!r}, orphan_s={orphan!r})
        pool.resize(1)
        while pool.ready() < 1:
            await asyncio.sleep(0.02)
        print("spare", pool.spares[0].pid, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


@pytest.fixture
def spare(tmp_path: Path) -> list[str]:
    script = tmp_path / "spare.py"
    script.write_text(SPARE.format(repo=str(REPO), counter=str(tmp_path / "starts")))
    return [sys.executable, str(script)]


@pytest.fixture
def pids(tmp_path: Path) -> Iterator[list[int]]:
    """Spares and ranks to kill when the test is done (they are nobody's children); then
    their socket directory, in the temp dir for a run dir as deep as a test's."""
    left: list[int] = []
    yield left
    for pid in left:
        if pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)
    shutil.rmtree(spare_dir(tmp_path / "run"), ignore_errors=True)


@pytest.fixture
async def successor(tmp_path: Path, spare: list[str]) -> AsyncIterator[WarmPool]:
    pool = WarmPool(0, tmp_path / "run", command=spare)
    try:
        yield pool
    finally:
        await pool.close()


def starts(tmp_path: Path) -> int:
    return len((tmp_path / "starts").read_text())


def agent_dies(tmp_path: Path, command: list[str], orphan_s: float | None = None) -> int:
    """Run an agent until its spare is ready, ``kill -9`` it; the spare's PID."""
    script = tmp_path / "agent.py"
    run = str(tmp_path / "run")
    script.write_text(AGENT.format(repo=str(REPO), run=run, command=command, orphan=orphan_s))
    agent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
    try:
        assert agent.stdout is not None
        said = next((line for line in agent.stdout if line.startswith(b"spare ")), None)
    finally:
        agent.kill()
        agent.wait()
    assert said, "the agent's spare never became ready"
    return int(said.split()[1])


def launch_line(tmp_path: Path, **env: str) -> WarmLaunch:
    record = str(tmp_path / "rank-3.exit")
    env = {**os.environ, "RANK": "3", "RECORD": record, **env}
    return WarmLaunch(env=env, cwd=str(tmp_path), log=str(tmp_path / "r.log"))


async def test_a_restarted_agent_adopts_its_predecessors_spare_and_runs_a_rank_in_it(
    tmp_path: Path, spare: list[str], successor: WarmPool, pids: list[int]
) -> None:
    pid = agent_dies(tmp_path, spare)
    pids.append(pid)
    assert await successor.adopt() == 1
    successor.resize(1)  # the adopted spare stands for the one it would start
    await until(lambda: successor.ready() == 1)
    assert successor.spares[0].pid == pid and successor.spares[0].child is None
    assert starts(tmp_path) == 1
    launch = launch_line(tmp_path, CODE="5")
    rank = await successor.take(launch, job="j", exit_record=tmp_path / "rank-3.exit")
    assert rank is not None and rank.pid == pid
    assert await asyncio.wait_for(rank.wait(), 20) == 5  # from the rank's exit record
    assert "rank 3" in (tmp_path / "r.log").read_text()
    await until(lambda: successor.ready() == 1)  # and a new spare replaces it
    pids.append(successor.spares[0].pid)
    assert starts(tmp_path) == 2


async def test_adopted_spares_over_the_pools_size_are_killed(
    tmp_path: Path, spare: list[str], successor: WarmPool, pids: list[int]
) -> None:
    pid = agent_dies(tmp_path, spare)
    pids.append(pid)
    assert await successor.adopt() == 1
    successor.resize(0)  # this agent keeps no spares
    await until(lambda: not pid_alive(pid))
    assert not successor.spares and starts(tmp_path) == 1


async def test_a_spare_of_other_code_is_killed_not_adopted(
    tmp_path: Path, spare: list[str], pids: list[int]
) -> None:
    pid = agent_dies(tmp_path, spare)
    pids.append(pid)
    upgraded = WarmPool(0, tmp_path / "run", command=[*spare, "--upgraded"])
    try:
        assert await upgraded.adopt() == 0
        await until(lambda: not pid_alive(pid))
        assert recorded_spares(tmp_path / "run") == ([], [])
    finally:
        await upgraded.close()


async def test_a_spare_no_agent_comes_back_for_ends_on_its_own(
    tmp_path: Path, spare: list[str], pids: list[int]
) -> None:
    pid = agent_dies(tmp_path, spare, orphan_s=0.5)
    pids.append(pid)
    await until(lambda: not pid_alive(pid))
    assert live_spares(tmp_path / "run") == []


async def test_a_spare_that_became_a_rank_is_never_adopted_nor_killed(
    tmp_path: Path, spare: list[str], successor: WarmPool, pids: list[int]
) -> None:
    """Its socket is removed when it is handed the launch; were it left behind (the agent
    died in between), the spare no longer listens, and the rank is left to run."""
    first = WarmPool(0, tmp_path / "run", command=spare)
    try:
        first.resize(1)
        await until(lambda: first.ready() == 1)
        [handed] = first.spares
        launch = launch_line(tmp_path, SLEEP="600")
        rank = await first.take(launch, job="j", exit_record=tmp_path / "rank-3.exit")
        assert rank is not None
        pids.append(rank.pid)
        assert not handed.socket.exists()
        handed.socket.write_bytes(b"")  # as if the agent died before removing it
        first.resize(0)
        await until(lambda: [s.pid for s in live_spares(tmp_path / "run")] == [rank.pid])
        assert await successor.adopt() == 0
        assert pid_alive(rank.pid) and not handed.socket.exists()
    finally:
        await first.close()
