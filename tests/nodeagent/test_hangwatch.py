"""Hang judgment without I/O: every branch of ``nodeagent.hangwatch.judge`` and the node
fallback, with beats, process states and faulthandler dumps written by hand; and the
watch's own passes on a manual clock."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from msgspec.structs import replace

from nodeagent.hangwatch import (
    UNKNOWN,
    Kind,
    Proc,
    Thresholds,
    Verdict,
    fallback,
    judge,
    main_first,
    main_frames,
)
from nodeagent.hangwatch_loop import HangWatch
from nodeagent.rankprobe import STOPPED, proc_stat
from nodeagent.supervisor import Supervisor
from proto.events import EventBase
from proto.job import PolicySection
from proto.progress import Progress
from ringmaster.clock import ManualClock
from ringmaster.rankbeat import CHECKPOINT, DONE, PAUSED, STARTUP, TRAINING, RankBeat
from ringmaster.rundir import JobDir
from tests.waits import until

MAIN = 0x7F0000001000
OTHER = 0x7F0000002000
DEFAULTS = Thresholds()  # factor 3, floor 3 s
RUNNING = Proc(pid=42, state="S")


def beat(now: float, *, since_step: float, step_s: float = 0.1, **changes: object) -> RankBeat:
    """A training rank whose last step completed ``since_step`` seconds before ``now``,
    with a fresh beat."""
    made = RankBeat(
        pid=42,
        step=7,
        step_s=step_s,
        step_at=now - since_step,
        phase=TRAINING,
        phase_since=now - 500,
        updated=now - 0.2,
        main_thread=MAIN,
    )
    return replace(made, **changes)


def dump(
    main_frames_text: str, other_frames_text: str = '  File "/x/beat.py", line 9 in _run'
) -> str:
    return (
        f"Thread 0x{OTHER:016x} (most recent call first):\n{other_frames_text}\n\n"
        f"Current thread 0x{MAIN:016x} (most recent call first):\n{main_frames_text}\n"
    )


IN_COLLECTIVE = dump(
    '  File "/v/lib/torch/distributed/distributed_c10d.py", line 2501 in all_reduce\n'
    '  File "/v/lib/torch/distributed/c10d_logger.py", line 81 in wrapper\n'
    '  File "/repo/trainer/control.py", line 88 in reduce_step\n'
    '  File "/repo/trainer/loop.py", line 190 in _train_step'
)
IN_BACKWARD = dump(
    '  File "/v/lib/torch/autograd/graph.py", line 768 in _engine_run_backward\n'
    '  File "/v/lib/torch/_tensor.py", line 521 in backward\n'
    '  File "/repo/trainer/engine.py", line 40 in step'
)
OUTSIDE = dump(
    '  File "/repo/trainer/data.py", line 61 in batch\n'
    '  File "/repo/trainer/loop.py", line 188 in _train_step',
    # another thread in a collective does not make the main thread a victim
    '  File "/v/lib/torch/distributed/distributed_c10d.py", line 10 in barrier',
)


def test_phases_without_steps_are_never_hung() -> None:
    now = 10_000.0
    for phase in (STARTUP, CHECKPOINT, PAUSED, DONE):
        quiet = beat(now, since_step=900, phase=phase, phase_since=now - 900)
        assert judge(quiet, RUNNING, now, DEFAULTS, OUTSIDE) == Verdict(Kind.OK), phase
    first = beat(now, since_step=0, phase=STARTUP, step_at=None, step=0, step_s=0.0)
    assert judge(first, RUNNING, now, DEFAULTS, OUTSIDE).kind == Kind.OK
    # training without a completed step (a resumed rank before its first) is start-up too
    unstarted = beat(now, since_step=0, step_at=None)
    assert judge(unstarted, RUNNING, now, DEFAULTS, OUTSIDE).kind == Kind.OK


def test_the_threshold_is_the_median_times_the_factor_or_the_floor() -> None:
    now = 10_000.0
    slow = Thresholds(step_factor=3.0, floor_s=3.0)
    assert judge(beat(now, since_step=5.9, step_s=2.0), RUNNING, now, slow, OUTSIDE).kind == Kind.OK
    hung = judge(beat(now, since_step=6.1, step_s=2.0), RUNNING, now, slow, OUTSIDE)
    assert (hung.kind, hung.threshold_s) == (Kind.CULPRIT, 6.0)
    assert hung.stalled_s == pytest.approx(6.1)
    # fast steps: the floor holds
    assert judge(beat(now, since_step=2.9), RUNNING, now, slow, OUTSIDE).kind == Kind.OK
    fast = judge(beat(now, since_step=3.1), RUNNING, now, slow, OUTSIDE)
    assert (fast.kind, fast.threshold_s) == (Kind.CULPRIT, 3.0)
    tuned = Thresholds.of(PolicySection(hang_step_factor=5.0, hang_floor_s=1.0))
    assert tuned.limit(beat(now, since_step=0, step_s=0.5)) == 2.5
    assert tuned.limit(None) == 1.0


def test_stalled_time_counts_from_the_later_of_last_step_and_phase_start() -> None:
    now = 10_000.0
    resumed = beat(now, since_step=600, phase_since=now - 1.0)  # just back from a pause
    assert judge(resumed, RUNNING, now, DEFAULTS, OUTSIDE).kind == Kind.OK
    later = judge(resumed, RUNNING, now + 2.5, DEFAULTS, OUTSIDE)
    assert (later.kind, later.stalled_s) == (Kind.CULPRIT, pytest.approx(3.5))


def test_a_stopped_process_is_the_culprit_whatever_its_phase() -> None:
    now = 10_000.0
    stopped = Proc(pid=42, state="T", stopped_s=2.5)
    verdict = judge(beat(now, since_step=3.2), stopped, now, DEFAULTS)
    assert verdict.kind == Kind.CULPRIT
    assert verdict.evidence.startswith("process stopped (state T)")
    # stopped for a moment (a profiler's snapshot): not yet
    blip = Proc(pid=42, state="t", stopped_s=0.3)
    assert judge(beat(now, since_step=30), blip, now, DEFAULTS).kind == Kind.OK
    # before the first step, or without a beat at all (an entry script): stopped past the floor
    starting = beat(now, since_step=0, phase=STARTUP, step_at=None, step_s=0.0)
    assert judge(starting, Proc(42, "T", 2.9), now, DEFAULTS).kind == Kind.OK
    assert judge(starting, Proc(42, "T", 3.1), now, DEFAULTS).kind == Kind.CULPRIT
    assert judge(None, Proc(42, "T", 2.9), now, DEFAULTS).kind == Kind.OK
    entry = judge(None, Proc(42, "T", 3.1), now, DEFAULTS)
    assert (entry.kind, entry.stalled_s, entry.threshold_s) == (Kind.CULPRIT, 3.1, 3.0)
    # done: exiting, whatever it looks like
    assert (
        judge(beat(now, since_step=99, phase=DONE), Proc(42, "T", 99), now, DEFAULTS).kind
        == Kind.OK
    )


def test_without_a_beat_only_a_stopped_process_can_be_judged() -> None:
    assert judge(None, RUNNING, 10_000.0, DEFAULTS, OUTSIDE).kind == Kind.OK


def test_a_silent_beat_while_the_process_runs_marks_the_culprit() -> None:
    now = 10_000.0
    wedged = judge(beat(now, since_step=4, updated=now - 2.5), Proc(42, "R"), now, DEFAULTS)
    assert wedged.kind == Kind.CULPRIT
    assert wedged.evidence.startswith("beat silent for 2.5 s")
    # a beat that is late but not silent asks for stacks instead
    late = judge(beat(now, since_step=4, updated=now - 1.5), RUNNING, now, DEFAULTS)
    assert late.kind == Kind.STALLED


def test_stacks_decide_between_victim_and_culprit() -> None:
    now = 10_000.0
    stalled = beat(now, since_step=4)
    assert judge(stalled, RUNNING, now, DEFAULTS).kind == Kind.STALLED
    victim = judge(stalled, RUNNING, now, DEFAULTS, IN_COLLECTIVE)
    assert victim.kind == Kind.VICTIM
    assert victim.evidence == (
        "waits in a collective: all_reduce (/v/lib/torch/distributed/distributed_c10d.py:2501)"
    )
    assert judge(stalled, RUNNING, now, DEFAULTS, IN_BACKWARD).kind == Kind.VICTIM
    culprit = judge(stalled, RUNNING, now, DEFAULTS, OUTSIDE)
    assert culprit.kind == Kind.CULPRIT
    assert culprit.evidence == (
        "stalled outside any collective: main thread in batch (/repo/trainer/data.py:61)"
    )
    # NCCL: the main thread blocks in the sync after the all-reduce, in trainer code; the
    # beat says where it is
    said = judge(replace(stalled, in_collective=True), RUNNING, now, DEFAULTS, OUTSIDE)
    assert (said.kind, said.evidence) == (
        Kind.VICTIM,
        "waits in the step's collective (its beat says)",
    )
    # no dump (the rank catches no stacks signal): it cannot be singled out
    assert judge(stalled, RUNNING, now, DEFAULTS, "").kind == Kind.VICTIM


def test_the_main_thread_is_found_by_id_else_it_is_the_last() -> None:
    assert main_frames(OUTSIDE, MAIN)[0].func == "batch"
    assert main_frames(OUTSIDE, 12345)[0].func == "batch"  # listed last
    assert main_frames(OUTSIDE, OTHER)[0].func == "barrier"
    assert main_frames("no dump here\n", MAIN) == []


def test_event_stacks_put_the_main_thread_first_and_are_capped() -> None:
    text = main_first("rank output before\n" + OUTSIDE, MAIN, 8192)
    assert text.startswith(f"Current thread 0x{MAIN:016x}")
    assert "rank output before" not in text
    assert "barrier" in text
    assert main_first("nothing", MAIN, 8192) == ""
    capped = main_first(OUTSIDE, MAIN, 60)
    assert len(capped) == 60
    assert capped.endswith("(truncated)")


def test_the_fallback_reports_the_lowest_rank_once_all_stalled_twice_the_threshold() -> None:
    victim = Verdict(Kind.VICTIM, stalled_s=6.5, threshold_s=3.0)
    fresh = Verdict(Kind.VICTIM, stalled_s=4.0, threshold_s=3.0)
    ok = Verdict(Kind.OK)
    assert fallback({3: victim, 1: victim, 0: ok}) == 1
    assert fallback({3: victim, 1: fresh}) is None  # not every stalled rank is there yet
    assert fallback({3: victim, 1: Verdict(Kind.CULPRIT, 9, 3, "stopped")}) is None
    assert fallback({0: ok, 1: ok}) is None
    assert fallback({}) is None
    assert UNKNOWN.startswith("culprit unknown")


def test_an_unreadable_spec_means_the_default_thresholds(tmp_path: Path) -> None:
    async def emit(_: EventBase) -> None:
        raise AssertionError("nothing to emit")

    async def progress(_job: str, _message: Progress) -> None:
        raise AssertionError("no progress either")

    watch = HangWatch(Supervisor("node-a", tmp_path, emit, progress), emit, "node-a")
    jobdir = JobDir(tmp_path, "j1")
    assert watch._thresholds_of("j1", 1, jobdir) == Thresholds()  # missing
    jobdir.path.mkdir(parents=True)
    jobdir.spec.write_text("{not json")
    assert watch._thresholds_of("j1", 2, jobdir) == Thresholds()
    jobdir.spec.write_text('{"job": {"name": "j"}, "policy": {"hang_floor_s": 1.5}}')
    assert watch._thresholds_of("j1", 3, jobdir) == Thresholds(3.0, 1.5)


@pytest.mark.anyio
async def test_a_stopped_ranks_dump_without_its_main_thread_is_asked_for_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped rank is continued for its dump; a thread unwinding meanwhile has cut a
    dump short before the main thread's block. Such a dump is asked for again."""
    header = "(most recent call first):"
    cut = f'Thread 0x{OTHER:x} {header}\n  File "threading.py", line 284 in _acquire_restore\n'
    whole = f'{cut}\nThread 0x{MAIN:x} {header}\n  File "trainer/loop.py", line 9 in run\n'
    dumps = [cut, whole]
    asked: list[bool] = []

    async def capture_stacks(pid: int, log_path: Path, fifo: Path, *, stopped: bool) -> str:
        asked.append(stopped)
        return dumps.pop(0)

    monkeypatch.setattr("nodeagent.hangwatch_loop.capture_stacks", capture_stacks)

    async def emit(_: EventBase) -> None:
        raise AssertionError("nothing to emit")

    async def progress(_job: str, _message: Progress) -> None:
        raise AssertionError("no progress either")

    watch = HangWatch(Supervisor("node-a", tmp_path, emit, progress), emit, "node-a")
    proc = Proc(pid=42, state="T")
    stacks = await watch._stacks(proc, tmp_path / "log", tmp_path / "fifo", beat(0.0, since_step=9))
    assert asked == [True, True]
    assert stacks.startswith(f"Thread 0x{MAIN:x}") and "trainer/loop.py" in stacks


@dataclass
class _Run:
    attempt: int
    procs: dict[int, subprocess.Popen[bytes]]


@dataclass
class _Supervised:
    run_dir: Path
    runs: dict[str, _Run]


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.anyio
async def test_the_watch_measures_a_stop_on_its_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeper: subprocess.Popen[bytes]
) -> None:
    """A real process, stopped and continued; the watch's passes read a manual clock. The
    rank is the culprit once it has been seen stopped, without a break, for the threshold
    (3 s with no spec): a continue in between starts the count again."""

    async def no_stacks(pid: int, log_path: Path, fifo: Path, *, stopped: bool) -> str:
        return ""

    monkeypatch.setattr("nodeagent.hangwatch_loop.capture_stacks", no_stacks)
    events: list[EventBase] = []

    async def emit(event: EventBase) -> None:
        events.append(event)

    def state() -> str:
        stat = proc_stat(rank.pid)
        return stat.state if stat is not None else ""

    def signalled(sig: signal.Signals, stopped: bool) -> None:
        os.kill(rank.pid, sig)
        until(lambda: (state() in STOPPED) == stopped, 10, f"the rank after {sig.name}", state)

    clock = ManualClock()
    rank = sleeper
    watch = HangWatch(_Supervised(tmp_path, {"j1": _Run(1, {0: rank})}), emit, "n", clock=clock)
    signalled(signal.SIGSTOP, stopped=True)
    assert await watch.check() == []  # seen stopped from now on
    clock.advance(2.9)
    assert await watch.check() == []
    signalled(signal.SIGCONT, stopped=False)
    assert await watch.check() == []
    signalled(signal.SIGSTOP, stopped=True)
    assert await watch.check() == []  # seen stopped again: from here
    clock.advance(2.9)
    assert await watch.check() == []
    clock.advance(0.1)
    [event] = await watch.check()
    assert (event.rank, event.pid, event.stalled_s, event.threshold_s) == (0, rank.pid, 3.0, 3.0)
    assert event.evidence == "process stopped (state T) for 3.0 s"
    assert events == [event]
