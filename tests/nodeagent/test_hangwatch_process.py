"""The hang watch against real ranks: the real supervisor launches a small script as a
job's ``entry`` (it beats with ``trainer.beat`` and dumps its stacks on ``STACKS_SIGNAL`` like the
trainer), the test stops or wedges it with real signals, and the watch must emit one
``worker.hung`` naming it, with its stacks, and nothing for a rank that is merely slow.

The ranks' timing is real; the test waits for what it can see (steps in the beats, events,
stalls measured on the watch's own clock), each wait bounded, and runs a last pass of
the watch itself before it says that nothing more is reported."""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nodeagent.hangwatch import FALLBACK_FACTOR, UNKNOWN
from nodeagent.hangwatch_loop import HangWatch
from nodeagent.rankprobe import proc_stat
from nodeagent.supervisor import Supervisor
from proto.commands import Launch, RankSpec
from proto.events import EventBase, WorkerHung
from proto.job import JobSection, JobSpec, PolicySection
from proto.progress import Progress
from ringmaster import rankbeat
from ringmaster.rundir import JobDir
from tests.waits import until_async

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]
FLOOR_S = 1.0  # the jobs' hang_floor_s: steps take 0.05 s, so the floor is the threshold

# MODE_<rank>: train (forever), stuck (in its own code after step 5), collective (in a
# stand-in collective after step 5), checkpoint (a 4 s checkpoint after step 5).
# FIRST_STEP_S: how long the first step takes (compiling, say).
RANK = textwrap.dedent(
    """
    import faulthandler, importlib.util, os, signal, time
    from ringmaster.rundir import STACKS_SIGNAL
    from ringmaster.rank import stacks
    from ringmaster.rank.beat import Beat

    rank = int(os.environ["RANK"])
    if not os.environ.get("NO_STACKS"):
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
        if not os.environ.get("NO_STACKS_THREAD"):
            stacks.serve_from_env(os.environ, rank)
    mode = os.environ.get(f"MODE_{rank}", "train")
    beat = Beat.from_env(os.environ, rank).start()

    def stuck_in_user_code():
        while True:
            time.sleep(0.05)

    def wait_for_peers():
        spec = importlib.util.spec_from_file_location("fake_c10d", os.environ["FAKE_C10D"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.all_reduce()

    def train_forever(first_s):
        step = 0
        while True:
            started = time.monotonic()
            time.sleep(first_s if step == 0 else 0.05)
            step += 1
            beat.step_done(step, time.monotonic() - started)
            if step == 5 and mode == "stuck":
                stuck_in_user_code()
            if step == 5 and mode == "collective":
                wait_for_peers()
            if step == 5 and mode == "checkpoint":
                with beat.during("checkpoint"):
                    time.sleep(4)

    # every rank starts training together, as ranks past a rendezvous do: one started
    # late on a loaded machine would otherwise still be training while its peers stall
    ready = os.path.join(os.environ["RINGMASTER_WORKDIR"], f"ready-{rank}")
    open(ready, "w").close()
    world = int(os.environ["RANKS"])
    while not all(
        os.path.exists(os.path.join(os.path.dirname(ready), f"ready-{r}")) for r in range(world)
    ):
        time.sleep(0.01)
    train_forever(float(os.environ.get("FIRST_STEP_S", "0.05")))
    """
)
# A module whose path says torch.distributed: its frames read as "inside a collective".
FAKE_C10D = "import time\n\ndef all_reduce():\n    while True:\n        time.sleep(0.05)\n"


class Sink:
    def __init__(self) -> None:
        self.events: list[EventBase] = []

    async def event(self, event: EventBase) -> None:
        self.events.append(event)

    async def progress(self, job: str, message: Progress) -> None:
        pass

    def hung(self) -> list[WorkerHung]:
        return [e for e in self.events if isinstance(e, WorkerHung)]


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.sink = Sink()
        self.supervisor = Supervisor(
            "node-a", tmp_path / "run", self.sink.event, self.sink.progress
        )
        self.watch = HangWatch(self.supervisor, self.sink.event, "node-a", interval_s=0.1)
        self.task: asyncio.Task[None] | None = None

    async def launch(self, ranks: int = 1, **env: str) -> list[int]:
        script = self.tmp / "rank.py"
        script.write_text(RANK)
        fake = self.tmp / "torch" / "distributed" / "fake_c10d.py"
        fake.parent.mkdir(parents=True, exist_ok=True)
        fake.write_text(FAKE_C10D)
        spec = JobSpec(
            job=JobSection(name="j", entry=[str(script)]),
            policy=PolicySection(hang_floor_s=FLOOR_S),
        )
        cmd = Launch(
            job="j1",
            attempt=2,
            ranks=[RankSpec(rank=r, local_rank=r) for r in range(ranks)],
            spec=spec,
            argv=[str(script)],
            env={"PYTHONPATH": str(REPO), "FAKE_C10D": str(fake), "RANKS": str(ranks), **env},
            workdir=str(self.tmp),
        )
        pids = await self.supervisor.launch(cmd)
        self.task = asyncio.create_task(self.watch.run())
        return pids

    def beat(self, rank: int) -> rankbeat.RankBeat | None:
        return rankbeat.read(JobDir(self.supervisor.run_dir, "j1").rank_beat(rank))

    async def steps(self, rank: int, at_least: int, timeout: float = 15.0) -> None:
        await until_async(
            lambda: (b := self.beat(rank)) is not None and b.step >= at_least,
            timeout,
            f"rank {rank}'s step {at_least}",
            lambda: self.beat(rank),
        )

    async def hung(self, count: int = 1, timeout: float = 10.0) -> list[WorkerHung]:
        await until_async(
            lambda: len(self.sink.hung()) >= count,
            timeout,
            f"{count} worker.hung",
            lambda: self.sink.events,
            interval=0.01,
        )
        return self.sink.hung()

    async def stalled(self, rank: int, seconds: float) -> None:
        """Until ``rank`` has made no step for ``seconds`` on the watch's clock."""

        def since() -> float | None:
            beat = self.beat(rank)
            if beat is None or beat.step_at is None:
                return None
            return self.watch.clock.monotonic() - max(beat.step_at, beat.phase_since)

        await until_async(
            lambda: (s := since()) is not None and s >= seconds,
            seconds + 15.0,
            f"rank {rank} stalled for {seconds:g} s",
            since,
        )

    async def last_pass(self) -> list[WorkerHung]:
        """Stop the watch's loop and make one more pass: what it would report now."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        return await self.watch.check()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.supervisor.stop("j1", force=True, grace_s=0)
        await self.supervisor.close()


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    made = Harness(tmp_path)
    try:
        yield made
    finally:
        await made.close()


async def test_a_stopped_rank_is_reported_once_with_its_stacks(harness: Harness) -> None:
    _, victim = await harness.launch(ranks=2, MODE_0="collective")
    await harness.steps(0, 5)
    await harness.steps(1, 5)
    os.kill(victim, signal.SIGSTOP)
    (event,) = await harness.hung(timeout=FLOOR_S + 2.0)  # reported within that of SIGSTOP
    assert (event.rank, event.pid, event.attempt, event.job, event.node) == (
        1,
        victim,
        2,
        "j1",
        "node-a",
    )
    assert event.evidence.startswith("process stopped (state T)")
    assert event.threshold_s == FLOOR_S  # read from the job's spec
    assert event.stalled_s >= FLOOR_S
    assert event.step >= 5
    assert "train_forever" in event.stacks
    # from the rank's stacks thread (faulthandler would name the thread it ran in
    # "Current thread"), which holds the GIL as it reads the frames
    assert event.stacks.startswith("Thread 0x")
    assert "Current thread" not in event.stacks
    # the capture continued it for the dump and stopped it again: the fault is unchanged
    state = proc_stat(victim)
    assert state is not None and state.state in ("T", "t")
    # rank 0 waits "in a collective" for ever: a victim, not reported, not even after twice
    # the threshold; and rank 1 is not reported again
    await harness.stalled(0, (FALLBACK_FACTOR + 1) * FLOOR_S)
    assert await harness.last_pass() == []
    assert [e.rank for e in harness.sink.hung()] == [1]
    assert "Thread" in (harness.tmp / "run" / "jobs" / "j1" / "rank-0.log").read_text()


async def test_a_rank_stuck_in_its_own_code_is_the_culprit(harness: Harness) -> None:
    (pid,) = await harness.launch(MODE_0="stuck")
    (event,) = await harness.hung()
    assert event.pid == pid
    assert event.evidence.startswith("stalled outside any collective: main thread in")
    assert "stuck_in_user_code" in event.evidence
    assert "stuck_in_user_code" in event.stacks
    assert "_run" in event.stacks  # the beat thread's stack comes too


async def test_when_every_stalled_rank_waits_in_a_collective_the_lowest_is_reported(
    harness: Harness,
) -> None:
    pids = await harness.launch(ranks=2, MODE_0="collective", MODE_1="collective")
    await harness.steps(1, 5)
    (event,) = await harness.hung()
    # victims first, for twice the threshold, as the watch measured it
    assert event.stalled_s >= FALLBACK_FACTOR * FLOOR_S
    assert (event.rank, event.pid, event.evidence) == (0, pids[0], UNKNOWN)
    assert "all_reduce" in event.stacks
    assert await harness.last_pass() == []
    assert len(harness.sink.hung()) == 1  # one per job and attempt


async def test_a_slow_first_step_and_a_long_checkpoint_are_not_hangs(harness: Harness) -> None:
    await harness.launch(ranks=1, FIRST_STEP_S="3.5", MODE_0="checkpoint")
    await harness.steps(0, 6, timeout=20.0)  # 3.5 s of start-up, then 4 s of checkpoint
    first = harness.beat(0)
    assert first is not None and first.phase == "training"
    assert await harness.last_pass() == []  # in training again
    assert harness.sink.hung() == []


async def test_stacks_are_not_asked_of_a_rank_that_cannot_give_them(harness: Harness) -> None:
    """The stacks signal would kill a process that does not catch it: a stopped rank without
    faulthandler is reported without stacks, and lives on (stopped)."""
    (pid,) = await harness.launch(NO_STACKS="1")
    await harness.steps(0, 3)
    os.kill(pid, signal.SIGSTOP)
    (event,) = await harness.hung()
    assert (event.pid, event.stacks) == (pid, "")
    state = proc_stat(pid)
    assert state is not None and state.state in ("T", "t")


async def test_a_rank_without_a_stacks_thread_gives_them_through_faulthandler(
    harness: Harness,
) -> None:
    """A rank whose stacks thread does not answer (wedged holding the GIL, or a rank
    that never started one) is asked through the stacks signal instead."""
    (pid,) = await harness.launch(NO_STACKS_THREAD="1")
    await harness.steps(0, 3)
    os.kill(pid, signal.SIGSTOP)
    (event,) = await harness.hung()
    assert event.pid == pid
    assert "train_forever" in event.stacks
    assert "Current thread" in event.stacks  # faulthandler's mark
    state = proc_stat(pid)
    assert state is not None and state.state in ("T", "t")
