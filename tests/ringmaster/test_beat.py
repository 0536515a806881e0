"""The rank's beat: what it writes and when, that it goes on while the main thread waits in
a real gloo collective, and that a real trainer rank beats, ends ``done`` and dumps its
stacks on ``STACKS_SIGNAL`` without dying."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from proto.job import JobSpec
from proto.progress import Checkpointed, Finished, Paused, Resumed, StepDone
from ringmaster import rankbeat
from ringmaster.clock import EPOCH, ManualClock
from ringmaster.procs import wait_until
from ringmaster.rank.beat import Beat
from ringmaster.rank.fake_agent import FakeAgent
from ringmaster.rankbeat import CHECKPOINT, DONE, PAUSED, STARTUP, TRAINING, Phase
from ringmaster.rundir import STACKS_SIGNAL
from tests.trainer.conftest import Launcher
from tests.waits import until


def written(path: Path, phase: Phase, timeout: float = 10.0) -> None:
    """Until the beat at ``path`` says ``phase``."""
    until(
        lambda: (b := rankbeat.read(path)) is not None and b.phase == phase,
        timeout,
        f"a beat in phase {phase}",
        lambda: rankbeat.read(path),
    )


def test_a_beat_says_who_where_and_since_when(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.beat"
    clock = ManualClock()
    started = clock.monotonic()
    beat = Beat(path, interval_s=0.05, clock=clock).start()
    try:
        first = rankbeat.read(path)
        assert first is not None
        assert (first.phase, first.step, first.step_at) == (STARTUP, 0, None)
        assert first.main_thread == threading.main_thread().ident
        assert (first.phase_since, first.updated, first.wall) == (started, started, EPOCH)
        clock.advance(1.0)
        until(  # rewritten by the thread, every interval
            lambda: (b := rankbeat.read(path)) is not None and b.updated == started + 1.0,
            10,
            "a beat written after the clock moved",
            lambda: rankbeat.read(path),
        )
    finally:
        beat.stop()
    last = rankbeat.read(path)
    assert last is not None and last.phase == DONE
    assert not any(t.name == "rank-beat" for t in threading.enumerate())


def test_steps_end_startup_and_give_the_median(tmp_path: Path) -> None:
    beat = Beat(tmp_path / "b")
    beat.step_done(1, 30.0)  # the first step compiles
    after_first = beat.current
    assert (after_first.phase, after_first.step, after_first.step_s) == (TRAINING, 1, 30.0)
    assert after_first.step_at is not None and after_first.phase_since == after_first.step_at
    for step in range(2, 5):
        beat.step_done(step, 0.2)
    now = beat.current
    assert (now.step, now.step_s) == (4, 0.2)
    assert now.phase_since == after_first.phase_since  # still the same training phase


def test_the_step_collective_is_marked_while_inside_it(tmp_path: Path) -> None:
    beat = Beat(tmp_path / "b")
    with beat.in_collective():
        assert beat.current.in_collective
    assert not beat.current.in_collective
    with pytest.raises(RuntimeError), beat.in_collective():
        raise RuntimeError("a peer went away")
    assert not beat.current.in_collective


def test_phase_changes_are_written_at_once_and_undone_after_a_block(tmp_path: Path) -> None:
    path = tmp_path / "b"
    beat = Beat(path, interval_s=60.0).start()  # only a wake-up can write within the test
    try:
        beat.step_done(1, 0.1)
        with beat.during(CHECKPOINT):
            written(path, CHECKPOINT)
        written(path, TRAINING)
        assert beat.set_phase(PAUSED) == TRAINING
        written(path, PAUSED)
    finally:
        beat.stop()


def test_the_beat_lives_beside_the_job_spec(tmp_path: Path) -> None:
    spec = tmp_path / "jobs" / "j1" / "spec.json"
    assert Beat.from_env({"RINGMASTER_JOB_SPEC": str(spec)}, 3).path == spec.parent / "rank-3.beat"
    alone = Beat.from_env({}, 0).start()  # no agent: nothing written, nothing started
    assert alone.path is None
    alone.step_done(1, 0.1)
    alone.stop()
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_beat_warns_once_and_training_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[Path] = []
    write = rankbeat.write

    def counted(path: Path, beat: rankbeat.RankBeat) -> None:
        tries.append(path)
        write(path, beat)

    monkeypatch.setattr(rankbeat, "write", counted)
    beat = Beat(tmp_path / "missing" / "rank-0.beat", interval_s=0.02).start()
    wait_until(lambda: len(tries) >= 5, timeout=30)  # the beat thread lived on, trying
    beat.stop()
    err = capsys.readouterr().err
    assert err.count("cannot write the beat") == 1


def test_garbage_reads_as_no_beat(tmp_path: Path) -> None:
    path = tmp_path / "b"
    assert rankbeat.read(path) is None
    path.write_bytes(b'{"pid": "forty-two"}')
    assert rankbeat.read(path) is None
    path.write_bytes(b"\x00\xff{")
    assert rankbeat.read(path) is None


def test_the_beat_goes_on_while_the_main_thread_waits_in_a_collective(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of a real gloo group never joins the all-reduce: rank 0's main thread waits
    in it, and the beat thread keeps writing meanwhile."""
    store = dist.HashStore()
    groups: dict[int, dist.ProcessGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timeout=timedelta(seconds=1.5))

    joiners = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in joiners:
        t.start()
    for t in joiners:
        t.join()
    path = tmp_path / "b"
    writes: list[rankbeat.RankBeat] = []
    write = rankbeat.write

    def counted(path: Path, beat: rankbeat.RankBeat) -> None:
        writes.append(beat)
        write(path, beat)

    monkeypatch.setattr(rankbeat, "write", counted)
    beat = Beat(path, interval_s=0.1).start()
    before = len(writes)
    with pytest.raises(RuntimeError, match="Timed out"):  # gloo's 1.5 s: it waited them
        groups[0].allreduce([torch.ones(4)]).wait()
    during = len(writes) - before
    beat.stop()
    assert during >= 5, f"{during} beats while the main thread waited in the collective"


@pytest.mark.slow
def test_a_trainer_rank_beats_and_dumps_its_stacks_on_sigusr1(
    launch: Launcher, make_spec: Callable[..., JobSpec]
) -> None:
    # no rewinds; no memory snapshots, whose waits for a persist would be seen as checkpoints
    spec = make_spec(
        train={"steps": 250}, policy={"grad_norm_spike": 1e9}, checkpoint={"memory_tier": False}
    )
    ranks = launch(spec, world_size=1)
    path = launch.workdir / "rank-0.beat"  # beside the spec the launcher wrote
    until(
        lambda: (b := rankbeat.read(path)) is not None and b.step >= 2,
        90,
        "step 2 in the rank's beat",
        lambda: ranks.log(0)[-3000:],
    )
    training = rankbeat.read(path)
    assert training is not None and training.phase == TRAINING, ranks.log(0)[-3000:]
    assert training.pid == ranks.procs[0].pid and training.step_s > 0
    ranks.procs[0].send_signal(STACKS_SIGNAL)  # would end the rank if nothing caught it
    assert ranks.wait() == [0], ranks.log(0)[-3000:]
    done = rankbeat.read(path)
    assert done is not None and (done.phase, done.step) == (DONE, 250)
    log = ranks.log(0)
    assert f"Current thread 0x{training.main_thread:016x}" in log or (
        f"Thread 0x{training.main_thread:016x}" in log
    )
    assert "trainer/loop.py" in log


@pytest.mark.slow
def test_a_paused_rank_says_so_and_a_checkpoint_while_paused_leaves_it_paused(
    launch: Launcher, make_spec: Callable[..., JobSpec]
) -> None:
    agent = FakeAgent(launch.workdir / "agent.sock")
    spec = make_spec(train={"steps": 250}, policy={"grad_norm_spike": 1e9})
    ranks = launch(spec, world_size=1, socket_path=agent.path)
    path = launch.workdir / "rank-0.beat"

    def phase() -> str | None:
        beat = rankbeat.read(path)
        return None if beat is None else beat.phase

    try:
        agent.wait_for(StepDone, lambda m: m.step >= 2)
        agent.send("pause")
        agent.wait_for(Paused)
        written(path, PAUSED)
        agent.send("checkpoint")
        agent.wait_for(Checkpointed)
        done = rankbeat.read(path)
        assert done is not None
        until(  # a beat or more after the checkpoint
            lambda: (b := rankbeat.read(path)) is not None and b.updated > done.updated,
            10,
            "a beat written after the checkpoint",
            lambda: rankbeat.read(path),
        )
        assert phase() == PAUSED
        agent.send("resume")
        agent.wait_for(Resumed)
        agent.wait_for(Finished)
        assert ranks.wait() == [0]
        assert phase() == DONE
    finally:
        agent.close()
