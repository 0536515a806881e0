"""The node agent's warm interpreters with real processes: one template, spares forked from
it that are handed out as ranks and replaced by forks (no import), a template still
importing handed a launch, a dead template started again after a backoff, a template with
threads falling back to exec'd spares, cold starts when nothing can serve, and the template
and spares killed on close.

The interpreters run ``trainer.warm.serve`` around a stand-in ``main`` (``warm_stand_in``;
the real trainer through a warm interpreter is tests/trainer/test_warm.py)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import pytest
from supervisor_waits import until
from warm_stand_in import stand_in, starts

from nodeagent import spare_handover, warm_template
from nodeagent.adoption import RankProcess
from nodeagent.spare import import_time_difference
from nodeagent.warm_pool import WarmPool
from proto.warm import WarmLaunch
from ringmaster import retry
from ringmaster.procs import pid_alive
from ringmaster.rundir import recorded_spares, spare_dir

pytestmark = pytest.mark.anyio


@pytest.fixture
def spare(tmp_path: Path) -> list[str]:
    return stand_in(tmp_path)


@pytest.fixture
async def pool(tmp_path: Path, spare: list[str]) -> AsyncIterator[WarmPool]:
    # a refill delay no test waits out: it holds back a new template only, never a fork
    warm = WarmPool(0, tmp_path / "run", command=spare, refill_delay_s=600)
    try:
        yield warm
    finally:
        await warm.close()


def take(pool: WarmPool, launch: WarmLaunch) -> Coroutine[Any, Any, RankProcess | None]:
    return pool.take(launch, job="j", exit_record=Path(launch.cwd) / "rank-3.exit")


def launch_line(tmp_path: Path, **env: str) -> WarmLaunch:
    return WarmLaunch(
        env={**os.environ, "RANK": "3", **env}, cwd=str(tmp_path), log=str(tmp_path / "r.log")
    )


def template_pid(pool: WarmPool) -> int:
    assert pool.templates.current is not None
    return pool.templates.current.pid


async def test_spares_are_forks_of_one_template_and_refills_import_nothing(
    pool: WarmPool, tmp_path: Path
) -> None:
    pool.resize(1)
    await until(lambda: pool.ready() == 1)
    template = template_pid(pool)
    assert [s.template for s in recorded_spares(tmp_path / "run")[0]].count(True) == 1
    for code in (5, 0, 7):
        [spare] = pool.spares
        assert spare.child is None and spare.pid != template  # a fork, not our child
        proc = await take(pool, launch_line(tmp_path, CODE=str(code)))
        assert proc is not None and proc.pid == spare.pid
        assert await proc.wait() == code  # the template's record of what it reaped
        await until(lambda: pool.ready() == 1)  # the refill: a fork, at once
    assert f"rank 3 in {tmp_path}" in (tmp_path / "r.log").read_text()
    assert starts(tmp_path) == 1 and template_pid(pool) == template  # imported once


async def test_a_launch_that_finds_no_spare_ready_gets_a_fork(
    pool: WarmPool, tmp_path: Path
) -> None:
    pool.resize(1)
    await until(lambda: pool.ready() == 1)
    dead = pool.spares[0].pid
    os.kill(dead, signal.SIGKILL)
    await until(lambda: not pid_alive(dead))
    proc = await take(pool, launch_line(tmp_path, CODE="4"))  # no spare: one forked for it
    assert proc is not None and proc.pid != dead
    assert await proc.wait() == 4
    await until(lambda: pool.ready() == 1)
    assert starts(tmp_path) == 1


async def test_a_template_still_importing_is_handed_the_launch_and_leaves_a_successor(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold start would repeat the imports the template is part-way through; and the
    launch is answered without waiting for them. Its imports are not lost: before it
    becomes the rank it forks its successor, which the pool forks spares from."""
    monkeypatch.setenv("SPARE_DELAY", "1.5")  # still "importing" when the launch comes
    pool.resize(1)
    await until(lambda: pool.templates.current is not None)
    template = pool.templates.current
    assert template is not None and not template.ready and not pool.spares
    proc = await take(pool, launch_line(tmp_path, CODE="0"))
    assert proc is template.child and not (tmp_path / "r.log").exists()  # not yet
    assert await proc.wait() == 0
    assert f"rank 3 in {tmp_path}" in (tmp_path / "r.log").read_text()
    assert pool.import_s is not None and pool.import_s >= 1.5
    await until(lambda: pool.ready() == 1)  # forked from the successor
    successor = pool.templates.current
    assert successor is not None and successor.pid != template.pid
    assert successor.child is None and successor.socket.name.endswith("-template.sock")
    assert starts(tmp_path) == 1  # (the refill delay, 600 s, held nothing back)
    proc = await take(pool, launch_line(tmp_path, CODE="3"))
    assert proc is not None and await proc.wait() == 3


async def test_a_template_that_does_not_start_its_rank_in_time_is_killed(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wedged template is its rank's process: killed, it is a rank that exited."""
    monkeypatch.setenv("SPARE_DELAY", "60")  # wedged in its imports
    monkeypatch.setattr(spare_handover, "FIRST_IMPORT_WAIT_S", 0.5)
    pool.resize(1)
    await until(lambda: pool.templates.current is not None)
    assert pool.wait_bound() == 0.5
    proc = await take(pool, launch_line(tmp_path))
    assert proc is not None
    assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
    assert not (tmp_path / "r.log").exists()  # the rank never ran


def test_the_bound_follows_the_imports_seen() -> None:
    pool = WarmPool(1, Path("unused"))
    assert pool.wait_bound() == spare_handover.FIRST_IMPORT_WAIT_S
    pool.import_s = 20.0
    assert pool.wait_bound() == 40.0
    pool.import_s = 60.0
    assert pool.wait_bound() == spare_handover.FIRST_IMPORT_WAIT_S
    pool.import_s = 1.0
    assert pool.wait_bound() == 3 * spare_handover.HANDOVER_S


async def test_a_dead_template_is_started_again_after_a_backoff(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []
    held = asyncio.Event()  # never set: the backoff's wait lasts as long as the test

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await held.wait()

    backoff = functools.partial(retry.retrying_async, sleep=sleep)
    monkeypatch.setattr(warm_template, "retrying_async", backoff)
    pool.resize(1)
    await until(lambda: pool.ready() == 1)
    os.kill(template_pid(pool), signal.SIGKILL)  # it dies young: that counts as a failure
    await until(lambda: waits)
    assert starts(tmp_path) == 1 and 0 <= waits[0] <= warm_template.RESTART_FIRST_S
    proc = await take(pool, launch_line(tmp_path, CODE="2"))  # its fork still serves
    assert proc is not None and await proc.wait() is None  # reaped by nobody: unknown
    assert await take(pool, launch_line(tmp_path)) is None  # then: cold, no loop
    assert starts(tmp_path) == 1


async def test_a_template_that_cannot_start_is_not_restarted_in_a_loop(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPARE_DIES", "1")
    monkeypatch.setattr(warm_template, "RESTART_FIRST_S", 0.2)
    notes: list[float] = []
    died = pool.templates._died
    monkeypatch.setattr(pool.templates, "_died", lambda e, s: (notes.append(s), died(e, s)))
    pool.resize(1)
    await until(lambda: len(notes) >= 3)  # three starts, each after a longer window
    assert starts(tmp_path) <= len(notes) + 1
    assert await take(pool, launch_line(tmp_path)) is None  # cold meanwhile


async def test_a_template_with_threads_means_spares_started_one_at_a_time(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It cannot fork safely: it says so, and the pool starts spares with exec, each
    importing for itself, no more at once than a node with few cores bears."""
    monkeypatch.setenv("SPARE_THREAD", "1")
    monkeypatch.setenv("SPARE_DELAY", "1")
    pool.imports_at_once = 1
    pool.resize(2)
    await until(lambda: not pool.templates.forks and pool.spares)
    assert len(pool.spares) == 1 and not pool._starting  # the second waits for the first
    await until(lambda: pool.ready() == 2)
    assert all(s.child is not None for s in pool.spares) and pool.templates.current is None
    assert starts(tmp_path) == 3  # the template, then two spares
    proc = await take(pool, launch_line(tmp_path, CODE="6"))
    assert proc is not None and await proc.wait() == 6


async def test_a_template_with_a_thread_handed_a_launch_leaves_no_successor(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPARE_THREAD", "1")
    monkeypatch.setenv("SPARE_DELAY", "1")  # still "importing" when the launch comes
    pool.resize(1)
    await until(lambda: pool.templates.current is not None)
    proc = await take(pool, launch_line(tmp_path, CODE="2"))
    assert proc is not None and await proc.wait() == 2  # the template was the rank
    await until(lambda: pool.ready() == 1)  # and an exec'd spare stands for it
    assert not pool.templates.forks and pool.templates.current is None
    assert pool.spares[0].child is not None and starts(tmp_path) == 2


async def test_an_environment_read_at_import_time_means_a_cold_start(
    pool: WarmPool, tmp_path: Path
) -> None:
    pool.resize(1)
    await until(lambda: pool.ready() == 1)
    assert await take(pool, launch_line(tmp_path, LD_PRELOAD="/lib/x.so")) is None
    assert pool.ready() == 1  # the spare stays for a rank it can serve


def test_which_differences_count() -> None:
    spare = {"PATH": "/bin", "OMP_NUM_THREADS": "8", "PYTHONPATH": "/a"}
    runtime = {"RANK": "1", "NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert import_time_difference(spare, {**spare, **runtime}) is None
    assert import_time_difference(spare, {**spare, "OMP_NUM_THREADS": "1"}) is None
    assert import_time_difference(spare, {**spare, "PYTHONPATH": "/b"}) == "PYTHONPATH"
    assert import_time_difference(spare, {"PATH": "/bin"}) == "PYTHONPATH"
    assert import_time_difference(spare, {**spare, "CUDA_VISIBLE_DEVICES": "1"}) == (
        "CUDA_VISIBLE_DEVICES"
    )


async def test_close_kills_the_template_and_spares_but_not_the_ranks_they_became(
    pool: WarmPool, tmp_path: Path
) -> None:
    pool.resize(2)
    await until(lambda: pool.ready() == 2)
    rank = await take(pool, launch_line(tmp_path, SLEEP="600"))
    assert rank is not None
    await until(lambda: pool.ready() == 2)
    others = [template_pid(pool), *(s.pid for s in pool.spares)]
    await pool.close()
    await until(lambda: not any(pid_alive(p) for p in others), timeout=5)
    assert not spare_dir(tmp_path / "run").exists(), "their socket directory is removed"
    assert rank.returncode is None and pid_alive(rank.pid)
    os.killpg(rank.pid, signal.SIGKILL)  # its own session, as for a rank started cold
    assert await rank.wait() is None  # its template went with the pool: nobody says how
    pool.resize(1)  # a closed pool starts nothing
    assert not pool.spares and pool.templates.current is None
