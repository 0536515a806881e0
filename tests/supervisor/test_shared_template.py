"""Agents of one machine sharing one template (``nodeagent.shared_template``), with real
processes: two pools (two agents' run directories) fork their spares from it and run
ranks in them, the template importing once; one agent's shutdown leaves the template and
the other's spares alone, and its successor joins the template again rather than adopt
it; it is never handed a launch, even while it imports; a rank whose environment differs
from the template's in what is read at import time starts cold; and with nothing
listening at the socket, a pool starts its own template, saying so once.

The template is ``trainer.warm.serve`` around a stand-in ``main`` (``warm_stand_in``),
started here as ``coordinatorctl up`` starts the local cluster's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import structlog
from supervisor_waits import until
from warm_stand_in import stand_in, starts

from nodeagent import warm_template
from nodeagent.warm_pool import WarmPool
from proto.warm import LISTEN_FD_ENV, WarmLaunch
from ringmaster.procs import pid_alive

pytestmark = pytest.mark.anyio

Shared = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def command(tmp_path: Path) -> list[str]:
    return stand_in(tmp_path)


@pytest.fixture
def shared(tmp_path: Path, command: list[str]) -> Iterator[Shared]:
    """Start the machine's template (``env``: over ours) on ``tmp_path/template.sock``;
    killed when the test is done."""
    started: list[subprocess.Popen[bytes]] = []

    def start(**env: str) -> subprocess.Popen[bytes]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(tmp_path / "template.sock"))
            listener.listen(socket.SOMAXCONN)
            fd = listener.fileno()
            started.append(
                subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **env, LISTEN_FD_ENV: str(fd)},
                    pass_fds=(fd,),
                    start_new_session=True,
                )
            )
        return started[-1]

    yield start
    for proc in started:  # (the pools, closed first, killed its forks)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
async def pools(tmp_path: Path, command: list[str]) -> AsyncIterator[list[WarmPool]]:
    """Two agents' pools, each with its own run directory, both given the socket."""
    made = [
        WarmPool(
            0, tmp_path / name / "run", command=command, template_socket=tmp_path / "template.sock"
        )
        for name in ("a", "b")
    ]
    try:
        yield made
    finally:
        for pool in made:
            await pool.close()


def launch_line(tmp_path: Path, **env: str) -> WarmLaunch:
    return WarmLaunch(
        env={**os.environ, "RANK": "3", **env}, cwd=str(tmp_path), log=str(tmp_path / "r.log")
    )


async def take(pool: WarmPool, launch: WarmLaunch) -> int | None:
    """The rank's exit status, if it started warm (None: cold)."""
    proc = await pool.take(launch, job="j", exit_record=Path(launch.cwd) / "rank-3.exit")
    return None if proc is None else await proc.wait()


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def test_two_agents_fork_their_spares_and_ranks_from_one_template(
    tmp_path: Path, shared: Shared, pools: list[WarmPool]
) -> None:
    template = shared()
    for pool in pools:
        pool.resize(1)
    await until(lambda: all(pool.ready() == 1 for pool in pools))
    for code, pool in enumerate(pools, start=4):
        [spare] = pool.spares
        assert parent(spare.pid) == template.pid  # a fork of the shared template
        assert spare.socket.parent == pool.templates.directory  # in its agent's run dir
        assert await take(pool, launch_line(tmp_path, CODE=str(code))) == code
    await until(lambda: all(pool.ready() == 1 for pool in pools))  # refilled: forks
    assert starts(tmp_path) == 1  # the machine imported once
    assert template.poll() is None


async def test_one_agents_shutdown_leaves_the_template_and_the_others_spares(
    tmp_path: Path, shared: Shared, pools: list[WarmPool], command: list[str]
) -> None:
    template = shared()
    first, second = pools
    for pool in pools:
        pool.resize(1)
    await until(lambda: all(pool.ready() == 1 for pool in pools))
    gone, kept = first.spares[0].pid, second.spares[0].pid
    await first.close()
    await until(lambda: not pid_alive(gone))  # its own spare goes with it
    assert template.poll() is None and pid_alive(kept)
    assert (tmp_path / "template.sock").exists()
    assert await take(second, launch_line(tmp_path, CODE="3")) == 3
    await until(lambda: second.ready() == 1)
    # the agent started after it joins the template again: nothing of it to adopt
    successor = WarmPool(
        0, tmp_path / "a" / "run", command=command, template_socket=tmp_path / "template.sock"
    )
    try:
        assert await successor.adopt() == 0 and successor.templates.current is None
        successor.resize(1)
        await until(lambda: successor.ready() == 1)
        current = successor.templates.current
        assert current is not None and current.shared and current.pid == template.pid
    finally:
        await successor.close()
    assert starts(tmp_path) == 1


async def test_a_shared_template_still_importing_is_never_handed_a_launch(
    tmp_path: Path, shared: Shared, pools: list[WarmPool]
) -> None:
    """Other agents fork from it: a launch meanwhile starts cold."""
    template = shared(SPARE_DELAY="1.5")
    pool = pools[0]
    pool.resize(1)
    assert await take(pool, launch_line(tmp_path)) is None
    await until(lambda: pool.ready() == 1)
    assert template.poll() is None and not (tmp_path / "r.log").exists()
    assert await take(pool, launch_line(tmp_path, CODE="2")) == 2
    assert starts(tmp_path) == 1


async def test_a_rank_environment_is_checked_against_the_shared_templates(
    tmp_path: Path, shared: Shared, pools: list[WarmPool]
) -> None:
    """The template says the environment it imported in: this agent's own is not it."""
    shared(MKL_SHARED_TEST="1")
    pool = pools[0]
    pool.resize(1)
    await until(lambda: pool.ready() == 1)
    assert await take(pool, launch_line(tmp_path)) is None  # ours: without it
    assert await take(pool, launch_line(tmp_path, MKL_SHARED_TEST="1", CODE="6")) == 6


async def test_nothing_listening_means_the_pools_own_template_said_once(
    tmp_path: Path, pools: list[WarmPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(warm_template, "RESTART_FIRST_S", 0.05)
    pool = pools[0]
    with structlog.testing.capture_logs() as logs:
        pool.resize(1)
        await until(lambda: pool.ready() == 1)
        own = pool.templates.current
        assert own is not None and own.child is not None and not own.shared
        assert await take(pool, launch_line(tmp_path, CODE="1")) == 1
        os.kill(own.pid, signal.SIGKILL)  # the next is its own again, said no more
        await until(lambda: pool.templates.current not in (None, own) and starts(tmp_path) == 2)
    said = [e for e in logs if e["event"].startswith("shared warm template does not answer")]
    assert len(said) == 1 and said[0]["socket"] == str(tmp_path / "template.sock")
