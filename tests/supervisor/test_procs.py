"""The shared process helpers: liveness that does not count zombies, PID files, and the
one polling loop every wait in the CLI and the tests is built on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringmaster.clock import ManualClock
from ringmaster.procs import pid_alive, read_pid, start_time, wait_until, wait_until_async


def test_a_running_process_is_alive_and_a_zombie_or_a_reaped_one_is_not() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert pid_alive(proc.pid)
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # a zombie now
        assert not pid_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not pid_alive(proc.pid)


def test_read_pid(tmp_path: Path) -> None:
    (tmp_path / "ok.pid").write_text("1234\n")
    (tmp_path / "empty.pid").write_text("")
    assert read_pid(tmp_path / "ok.pid") == 1234
    assert read_pid(tmp_path / "empty.pid") is None
    assert read_pid(tmp_path / "missing.pid") is None


def test_wait_until_returns_the_first_truthy_result() -> None:
    answers = iter([None, 0, "", "done", "later"])
    assert wait_until(lambda: next(answers), timeout=5, interval=0.001) == "done"


def test_wait_until_times_out_after_one_last_try_at_the_deadline() -> None:
    clock = ManualClock()
    start = clock.monotonic()
    calls: list[float] = []

    def never() -> bool:
        calls.append(clock.monotonic() - start)
        return False

    with pytest.raises(TimeoutError):
        wait_until(never, timeout=0.2, interval=0.08, clock=clock, sleep=clock.advance)
    # every interval, then a last try at the deadline however short the wait to it
    assert calls == pytest.approx([0.0, 0.08, 0.16, 0.2])


def test_wait_until_tries_once_even_with_no_time_left() -> None:
    assert wait_until(lambda: True, timeout=0) is True
    with pytest.raises(TimeoutError):
        wait_until(lambda: False, timeout=0)


@pytest.mark.anyio
async def test_wait_until_async_awaits_the_predicate() -> None:
    answers = iter([None, None, 7])

    async def ready() -> int | None:
        return next(answers)

    async def never() -> bool:
        return False

    assert await wait_until_async(ready, timeout=None, interval=0.001) == 7
    with pytest.raises(TimeoutError):
        await wait_until_async(never, timeout=0.05, interval=0.01)


def test_start_time_is_the_kernels_and_a_pid_file_may_carry_it(tmp_path: Path) -> None:
    stat = Path("/proc/self/stat").read_text()  # this process: the same as os.getpid()
    assert start_time(os.getpid()) == int(stat.rsplit(")", 1)[1].split()[19])
    assert start_time(2**22 + 1) is None  # above the kernel's PID limit: no such process
    (tmp_path / "rank.pid").write_text("1234 98765")
    assert read_pid(tmp_path / "rank.pid") == 1234
