"""The CPU time of threads a library started (``ringmaster/thread_cpu.py``), on real
threads of this process."""

from __future__ import annotations

import threading
import time

import pytest

from ringmaster.procs import wait_until
from ringmaster.thread_cpu import cpu_s, started_by, task_ids

if not task_ids():
    pytest.skip("no /proc/self/task to read threads from", allow_module_level=True)


def _spin(until: threading.Event, spun: threading.Event) -> None:
    began = time.thread_time()
    while not until.is_set():
        if time.thread_time() - began > 0.05:
            spun.set()


def test_the_threads_a_call_starts_are_found_and_their_cpu_counted() -> None:
    stop, spun = threading.Event(), threading.Event()

    def start() -> threading.Thread:
        worker = threading.Thread(target=_spin, args=(stop, spun), daemon=True)
        worker.start()
        return worker

    worker, threads = started_by(start)
    try:
        assert worker.native_id in threads and threading.get_native_id() not in threads
        assert spun.wait(30), "the worker never ran"
        # at least the 50 ms of CPU the worker measured on itself
        assert cpu_s(threads) >= 0.05
    finally:
        stop.set()
        worker.join()


def test_a_thread_that_is_gone_counts_nothing() -> None:
    worker = threading.Thread(target=lambda: None)
    worker.start()
    worker.join()
    tid = worker.native_id or 0
    # join() returns once Python is done with the thread; the kernel reaps its task a
    # moment later, and until then its run time is still there to read
    wait_until(lambda: tid not in task_ids(), timeout=30)
    assert cpu_s(frozenset({tid})) == 0.0
    assert cpu_s(frozenset()) == 0.0
