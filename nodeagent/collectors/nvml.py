"""One NVML session per agent process, shared by the GPU collectors, and the XID watcher.

pynvml opens ``libnvidia-ml.so.1`` by name once per process and caches its function
pointers, so there is no switching libraries later. The ``nvml_library`` setting names a
file instead: it is opened first by its path, and because its soname is
``libnvidia-ml.so.1`` the loader hands that same library to pynvml's by-name open. That is
how a simulated node's agent gets the stub library without a special environment.

XID errors arrive through an NVML event set. Waiting on it blocks in the driver, so one
thread waits (with a timeout, so it can stop) and queues what it receives, stamped with
the agent's clock; a byte on a pipe tells the sampling loop to collect now instead of at
the next interval.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from nodeagent.collectors.base import CollectorUnavailable
from ringmaster.clock import SYSTEM, Clock

T = TypeVar("T")
Handle = Any  # pynvml's c_nvmlDevice_t

# Metrics a device may simply not have (consumer boards, older drivers, no privileges):
# the value is None, the device is not in error.
_ABSENT = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    }
)


def optional(call: Callable[..., T], *args: Any) -> T | None:
    """``call(*args)``, or None when the device does not support it."""
    try:
        return call(*args)
    except pynvml.NVMLError as exc:
        if exc.value in _ABSENT:
            return None
        raise


def text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def address(handle: Handle) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


class NvmlSession:
    """Initialises NVML on first use; until that succeeds every use raises
    :class:`CollectorUnavailable` ("no NVML: ...") and the next use tries again."""

    def __init__(self, library: str | None = None) -> None:
        self.library = library
        self.driver = ""
        self._lock = threading.Lock()
        self._ready = False
        self._pinned: ctypes.CDLL | None = None  # keeps a library opened by path loaded

    def ensure(self) -> None:
        with self._lock:
            if self._ready:
                return
            if self.library and self._pinned is None:
                try:
                    self._pinned = ctypes.CDLL(self.library)
                except OSError as exc:
                    raise CollectorUnavailable(f"no NVML: {exc}") from None
            try:
                pynvml.nvmlInit()
                self.driver = text(pynvml.nvmlSystemGetDriverVersion())
            except pynvml.NVMLError as exc:
                raise CollectorUnavailable(f"no NVML: {exc}") from None
            self._ready = True

    def count(self) -> int:
        count: int = pynvml.nvmlDeviceGetCount()
        return count


class XidWatcher:
    """Queues ``(gpu, xid, time)`` for every XID critical error NVML reports."""

    def __init__(self, wait_ms: int = 500, limit: int = 1024, clock: Clock = SYSTEM) -> None:
        self.wait_ms = wait_ms
        self.clock = clock
        self.error = ""
        self._queue: deque[tuple[int, int, float]] = deque(maxlen=limit)
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def fileno(self) -> int:
        return self._read

    def start(self, handles: dict[int, Handle]) -> None:
        """Register every GPU that supports XID events and start waiting."""
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            self.error = f"no event set: {exc}"
            return
        by_address: dict[int, int] = {}
        for index, handle in handles.items():
            try:
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, event_set
                )
            except pynvml.NVMLError as exc:
                self.error = f"GPU {index}: {exc}"
                continue
            by_address[address(handle)] = index
        self._thread = threading.Thread(
            target=self._run, args=(event_set, by_address), name="nvml-xid", daemon=True
        )
        self._thread.start()

    def _run(self, event_set: Any, by_address: dict[int, int]) -> None:
        try:
            while not self._stop.is_set():
                try:
                    data = pynvml.nvmlEventSetWait_v2(event_set, self.wait_ms)
                except pynvml.NVMLError as exc:
                    if exc.value != pynvml.NVML_ERROR_TIMEOUT:
                        self.error = f"event wait: {exc}"
                        self._stop.wait(1.0)
                    continue
                if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                    gpu = by_address.get(address(data.device), -1)
                    self._queue.append((gpu, int(data.eventData), self.clock.time()))
                    with contextlib.suppress(BlockingIOError):  # already woken
                        os.write(self._write, b"x")
        finally:
            pynvml.nvmlEventSetFree(event_set)

    def drain(self) -> list[tuple[int, int, float]]:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass
        items = []
        while self._queue:
            items.append(self._queue.popleft())
        return items

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.wait_ms / 1000 + 1)
        os.close(self._read)
        os.close(self._write)
