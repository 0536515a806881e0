"""The node agent's spare interpreters with real processes: handed out as ranks, refilled,
skipped for a cold start when they cannot serve, killed on close; and the supervisor
running the built-in trainer's ranks and a user's entry script in them, recorded and
stopped like any rank.

Spares here run ``trainer.warm.serve`` around a stand-in ``main`` (the real trainer
through a warm interpreter is tests/trainer/test_warm.py), so each is ready in a fraction
of a second."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import pytest
from supervisor_waits import until

from nodeagent import warm_pool
from nodeagent.adoption import RankProcess
from nodeagent.spare import import_time_difference
from nodeagent.supervisor import Supervisor
from nodeagent.warm_pool import WarmPool
from proto.commands import Launch, RankSpec
from proto.events import EventBase, WorkerExited
from proto.job import JobSection, JobSpec
from proto.progress import Progress
from proto.warm import WarmLaunch
from ringmaster.procs import pid_alive, start_time
from ringmaster.rundir import JobDir, LiveRank, live_ranks, spare_dir

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]

# A spare: counts its starts, then serves a main that logs its rank and cwd and sleeps
# ($SLEEP) or returns $CODE.
SPARE = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {repo!r})
    with open({counter!r}, "a") as f:
        f.write("x")
    if os.environ.get("SPARE_DIES"):
        sys.exit(3)
    time.sleep(float(os.environ.get("SPARE_DELAY", "0")))
    from trainer.warm import serve

    def main(argv):
        print("rank", os.environ.get("RANK"), "in", os.getcwd(), flush=True)
        time.sleep(float(os.environ.get("SLEEP", "0")))
        return int(os.environ.get("CODE", "0"))

    serve(main)
    """
)


@pytest.fixture
def spare(tmp_path: Path) -> list[str]:
    script = tmp_path / "spare.py"
    script.write_text(SPARE.format(repo=str(REPO), counter=str(tmp_path / "starts")))
    return [sys.executable, str(script)]


def starts(tmp_path: Path) -> int:
    path = tmp_path / "starts"
    return len(path.read_text()) if path.exists() else 0


@pytest.fixture
async def pool(tmp_path: Path, spare: list[str]) -> AsyncIterator[WarmPool]:
    warm = WarmPool(0, tmp_path / "run", command=spare)
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


async def test_a_ready_spare_becomes_the_rank_and_is_replaced(
    pool: WarmPool, tmp_path: Path
) -> None:
    pool.resize(1)
    await until(lambda: pool.ready() == 1)
    [spare] = pool.spares
    proc = await take(pool, launch_line(tmp_path, CODE="5"))
    assert proc is spare.child
    assert await proc.wait() == 5
    assert f"rank 3 in {tmp_path}" in (tmp_path / "r.log").read_text()
    await until(lambda: pool.ready() == 1)  # the replacement
    assert pool.spares[0].pid != proc.pid and starts(tmp_path) == 2


async def test_a_spare_still_importing_is_handed_the_launch_at_once(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold start would repeat the imports the spare is part-way through; and the
    launch is answered without waiting for them."""
    monkeypatch.setenv("SPARE_DELAY", "1.5")  # still "importing" when the launch comes
    pool.resize(1)
    await until(lambda: pool.spares)
    [spare] = pool.spares
    assert not spare.ready
    proc = await take(pool, launch_line(tmp_path, CODE="0"))
    assert proc is spare.child and not (tmp_path / "r.log").exists()  # not started yet
    assert await proc.wait() == 0
    assert f"rank 3 in {tmp_path}" in (tmp_path / "r.log").read_text()
    assert pool.import_s is not None and pool.import_s >= 1.5


async def test_spares_import_one_at_a_time_on_a_node_with_few_cores(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPARE_DELAY", "2")
    pool.imports_at_once = 1
    pool.resize(2)
    await until(lambda: pool.spares)
    assert len(pool.spares) == 1 and not pool._starting  # the second waits for the first
    await until(lambda: pool.ready() == 2)
    assert starts(tmp_path) == 2


async def test_a_spare_that_does_not_start_its_rank_in_time_is_killed(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wedged spare is its rank's process: killed, it is a rank that exited."""
    monkeypatch.setenv("SPARE_DELAY", "60")  # wedged in its imports
    monkeypatch.setattr(warm_pool, "FIRST_IMPORT_WAIT_S", 0.5)
    pool.resize(1)
    await until(lambda: pool.spares)
    assert pool.wait_bound() == 0.5
    proc = await take(pool, launch_line(tmp_path))
    assert proc is not None
    assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
    assert not (tmp_path / "r.log").exists()  # the rank never ran


def test_the_bound_follows_the_imports_seen() -> None:
    pool = WarmPool(1, Path("unused"))
    assert pool.wait_bound() == warm_pool.FIRST_IMPORT_WAIT_S
    pool.import_s = 20.0
    assert pool.wait_bound() == 40.0
    pool.import_s = 60.0
    assert pool.wait_bound() == warm_pool.FIRST_IMPORT_WAIT_S
    pool.import_s = 1.0
    assert pool.wait_bound() == 3 * warm_pool.HANDOVER_S


async def test_a_dead_spare_means_a_cold_start_and_a_replacement(
    pool: WarmPool, tmp_path: Path
) -> None:
    pool.resize(1)
    await until(lambda: pool.ready() == 1)
    dead = pool.spares[0].child
    assert dead is not None
    os.kill(dead.pid, signal.SIGKILL)
    assert await take(pool, launch_line(tmp_path)) is None  # the agent may not know yet
    await until(lambda: pool.ready() == 1 and pool.spares[0].child is not dead)
    # and once the agent has seen a ready spare die, the next launch replaces it too
    dead = pool.spares[0].child
    assert dead is not None
    os.kill(dead.pid, signal.SIGKILL)
    await dead.wait()
    assert await take(pool, launch_line(tmp_path)) is None
    await until(lambda: pool.ready() == 1 and pool.spares[0].child is not dead)


async def test_a_spare_that_cannot_start_is_not_restarted_in_a_loop(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPARE_DIES", "1")
    pool.resize(1)
    await until(lambda: starts(tmp_path) == 1 and not pool.spares and not pool._starting)
    await until(lambda: not pool._tasks)  # nothing left to do: no restart is on its way
    assert starts(tmp_path) == 1
    assert await take(pool, launch_line(tmp_path)) is None  # cold; and one more try
    await until(lambda: starts(tmp_path) == 2 and not pool.spares and not pool._starting)


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


async def test_close_kills_spares_but_not_the_ranks_they_became(
    pool: WarmPool, tmp_path: Path
) -> None:
    pool.resize(2)
    await until(lambda: pool.ready() == 2)
    rank = await take(pool, launch_line(tmp_path, SLEEP="600"))
    assert rank is not None
    await until(lambda: pool.ready() == 2)
    spares = [s.pid for s in pool.spares]
    await pool.close()
    await until(lambda: not any(pid_alive(p) for p in spares), timeout=5)
    assert not spare_dir(tmp_path / "run").exists(), "their socket directory is removed"
    assert rank.returncode is None and pid_alive(rank.pid)
    os.killpg(rank.pid, signal.SIGKILL)  # its own session, as for a rank started cold
    assert await rank.wait() == -signal.SIGKILL
    pool.resize(1)  # a closed pool starts nothing
    assert not pool.spares and not pool._starting


async def test_the_supervisor_runs_the_trainer_in_a_spare(tmp_path: Path, spare: list[str]) -> None:
    events: list[EventBase] = []

    async def on_event(event: EventBase) -> None:
        events.append(event)

    async def on_progress(job: str, message: Progress) -> None:
        pass

    sup = Supervisor("n", tmp_path / "run", on_event, on_progress, warm_command=spare)
    try:
        sup.warm_ranks(1)
        await until(lambda: sup.warm.ready() == 1)
        spare_pid = sup.warm.spares[0].pid
        cmd = Launch(
            job="j1",
            attempt=2,
            ranks=[RankSpec(rank=0, local_rank=0)],
            spec=JobSpec(job=JobSection(name="j")),
            env={"SLEEP": "600"},
            workdir=str(tmp_path),
        )
        [pid] = await sup.launch(cmd)
        assert pid == spare_pid  # the built-in trainer: started warm
        job = JobDir(sup.run_dir, "j1")
        assert job.rank_pid(0).read_text() == f"{pid} {start_time(pid)}"
        assert live_ranks(sup.run_dir) == [LiveRank("j1", 0, pid)]
        await until(lambda: "rank 0 in" in job.rank_log(0).read_text())
        await sup.stop("j1", force=True, grace_s=0)  # killpg by the rank's PID
        [exit_] = [e for e in events if isinstance(e, WorkerExited)]
        assert exit_.pid == pid and exit_.signal == signal.SIGTERM and exit_.attempt == 2
        assert live_ranks(sup.run_dir) == []
        # a user's entry script runs in a spare too, as __main__ with its arguments, and
        # the spares started after it are told to import its libraries
        await until(lambda: sup.warm.ready() == 1)
        spare_pid = sup.warm.spares[0].pid
        entry = tmp_path / "entry.py"
        said = tmp_path / "said"
        entry.write_text(
            "import sys, time\n"
            f"open({str(said)!r}, 'w').write(f'{{__name__}} {{sys.argv}}')\n"
            "time.sleep(600)\n"
        )
        argv = [str(entry), "--lr", "1e-4"]
        [warm] = await sup.launch(Launch(**{**msgspec.structs.asdict(cmd), "argv": argv}))
        assert warm == spare_pid
        await until(lambda: said.exists() and said.read_text() != "")
        assert said.read_text() == f"__main__ {argv}"
        assert live_ranks(sup.run_dir) == [LiveRank("j1", 0, warm)]
        assert sup.warm.preload == str(entry)
        await until(lambda: sup.warm.ready() == 1)
        environ = await asyncio.to_thread(
            Path(f"/proc/{sup.warm.spares[0].pid}/environ").read_bytes
        )
        assert f"RINGMASTER_SPARE_PRELOAD={entry}".encode() in environ.split(b"\0")
    finally:
        for job_id in list(sup.runs):
            await sup.stop(job_id, force=True, grace_s=0)
        await sup.close()
