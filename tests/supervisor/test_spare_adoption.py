"""The template and its spares outlive an agent that dies: an agent process (a real one,
driving a pool) is killed, and a pool started after it on the same run directory takes
them over, runs a rank in the spare and forks the next from the template (no import),
and leaves alone what it must not adopt."""

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
from warm_stand_in import stand_in, starts

from nodeagent.warm_pool import WarmPool
from proto.warm import WarmLaunch
from ringmaster.procs import pid_alive
from ringmaster.rundir import live_spares, recorded_spares, spare_dir

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]

# An agent: a pool of one spare; prints the spare's and the template's PIDs once the spare
# is ready, then waits to be killed.
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
        print("spare", pool.spares[0].pid, pool.templates.current.pid, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


@pytest.fixture
def spare(tmp_path: Path) -> list[str]:
    return stand_in(tmp_path)


@pytest.fixture
def pids(tmp_path: Path) -> Iterator[list[int]]:
    """Templates, spares and ranks to kill when the test is done (nobody's children); then
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


def agent_dies(
    tmp_path: Path, command: list[str], orphan_s: float | None = None
) -> tuple[int, int]:
    """Run an agent until its spare is ready, ``kill -9`` it; the spare's and the
    template's PIDs."""
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
    return int(said.split()[1]), int(said.split()[2])


def launch_line(tmp_path: Path, **env: str) -> WarmLaunch:
    env = {**os.environ, "RANK": "3", **env}
    return WarmLaunch(env=env, cwd=str(tmp_path), log=str(tmp_path / "r.log"))


async def test_a_restarted_agent_adopts_the_template_and_its_spare_and_runs_a_rank(
    tmp_path: Path, spare: list[str], successor: WarmPool, pids: list[int]
) -> None:
    pid, template = agent_dies(tmp_path, spare)
    pids += [pid, template]
    assert await successor.adopt() == 1
    assert successor.templates.current is not None
    assert successor.templates.current.pid == template
    successor.resize(1)  # the adopted spare stands for the one it would fork
    await until(lambda: successor.ready() == 1)
    assert successor.spares[0].pid == pid and successor.spares[0].child is None
    launch = launch_line(tmp_path, CODE="5")
    rank = await successor.take(launch, job="j", exit_record=tmp_path / "rank-3.exit")
    assert rank is not None and rank.pid == pid
    assert await asyncio.wait_for(rank.wait(), 20) == 5  # the template's exit record
    assert "rank 3" in (tmp_path / "r.log").read_text()
    await until(lambda: successor.ready() == 1)  # and the adopted template forks the next
    fork = successor.spares[0].pid
    pids.append(fork)
    assert starts(tmp_path) == 1
    recorded = {(s.pid, s.template) for s in recorded_spares(tmp_path / "run")[0]}
    assert recorded == {(fork, False), (template, True)}  # named for the agent after this


async def test_an_adopted_template_and_spares_over_the_pools_size_are_killed(
    tmp_path: Path, spare: list[str], successor: WarmPool, pids: list[int]
) -> None:
    pid, template = agent_dies(tmp_path, spare)
    pids += [pid, template]
    assert await successor.adopt() == 1
    successor.resize(0)  # this agent keeps no spares
    await until(lambda: not pid_alive(pid) and not pid_alive(template))
    assert not successor.spares and successor.templates.current is None


async def test_a_template_of_other_code_is_killed_and_a_new_one_started(
    tmp_path: Path, spare: list[str], pids: list[int]
) -> None:
    pid, template = agent_dies(tmp_path, spare)
    pids += [pid, template]
    upgraded = WarmPool(0, tmp_path / "run", command=[*spare, "--upgraded"])
    try:
        assert await upgraded.adopt() == 0 and upgraded.templates.current is None
        await until(lambda: not pid_alive(pid) and not pid_alive(template))
        assert recorded_spares(tmp_path / "run") == ([], [])
        upgraded.resize(1)
        await until(lambda: upgraded.ready() == 1)
        assert starts(tmp_path) == 2  # the new code's template imports
    finally:
        await upgraded.close()


async def test_a_template_and_spare_no_agent_comes_back_for_end_on_their_own(
    tmp_path: Path, spare: list[str], pids: list[int]
) -> None:
    pid, template = agent_dies(tmp_path, spare, orphan_s=0.5)
    pids += [pid, template]
    await until(lambda: not pid_alive(pid) and not pid_alive(template))
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
