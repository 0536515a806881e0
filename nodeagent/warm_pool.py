"""Spare rank interpreters, started ahead of need, so a rank (re)start skips the cold
Python start and the imports of torch, DeepSpeed and torchao.

Each spare is ``python -m trainer.warm`` in its own session (so, once it is a rank, its
PID is its process group's id, as for a rank started cold): it imports the training stack,
writes ``READY`` on its stdout and waits for one launch line on its stdin
(``proto.warm.WarmLaunch``). :meth:`WarmPool.take` hands a ready spare its launch, waits
for its ``STARTED`` and returns it as the rank's process; a replacement is started after
``refill_delay_s`` (on a node with few cores the replacement's imports would otherwise
compete with the ranks starting at that very moment). A launch that finds its spare still
importing hands it the launch at once and takes it as the rank's process: a cold start
would repeat those same imports from the beginning, beside the spare's, so it is never the
faster, and the launch is answered without waiting for imports. A spare that has not
started its rank within :meth:`WarmPool.wait_bound` is wedged: it is killed, and its
rank's exit is reported as any rank's.

The pool fails no launch itself: without a spare, when a ready spare's hand-over does
not take, or when the rank's environment differs from the spare's in a setting read at
import time (:func:`import_time_difference`), ``take`` returns None and the caller starts
the rank cold. A spare that dies before it is ready is not replaced until the next
``take`` asks, so a broken install costs one failed start per launch, not a loop (one
that dies after it was handed a launch is that rank's exit). Spares are killed when the
agent shuts down (ranks are not: they outlive the agent, and so does a spare already
handed its launch, which reads it on its own); a spare whose agent died without a word
and that was handed nothing sees its stdin close and exits.

The agent never imports the trainer: a spare is a process, like a rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from proto.codec import encode
from proto.warm import READY, STARTED, WarmLaunch

log = structlog.get_logger()

SPARE = (sys.executable, "-m", "trainer.warm")
HANDOVER_S = 10.0  # a ready spare answers in milliseconds; this only bounds a wedged one
# How long a spare handed a launch while importing may take to start the rank, before any
# spare was seen ready, and at most (34 s were seen on 2 cores with five agents starting)
FIRST_IMPORT_WAIT_S = 90.0
# Read when torch, DeepSpeed, OpenMP, the dynamic loader or Python itself start: a spare
# started under other values cannot become a rank that needs these. What torch reads when
# a process group or CUDA starts (TORCH_NCCL_*, NCCL_*, PYTORCH_CUDA_ALLOC_CONF) is read
# after the hand-over, in the rank's environment.
IMPORT_TIME = (
    "PYTHON",
    "LD_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH_LOGS",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "DS_ACCELERATOR",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
)
APPLIED_BY_WORKER = frozenset({"OMP_NUM_THREADS"})  # the worker sets its threads itself


def import_time_difference(spare: Mapping[str, str], rank: Mapping[str, str]) -> str | None:
    """The first variable read at import time whose value differs between the spare's
    environment and the rank's (set in one and not the other counts); None when a spare
    can become this rank."""
    for name in sorted(set(spare) | set(rank)):
        if name in APPLIED_BY_WORKER or not name.startswith(IMPORT_TIME):
            continue
        if spare.get(name) != rank.get(name):
            return name
    return None


@dataclass(eq=False)
class Spare:
    proc: asyncio.subprocess.Process
    env: dict[str, str]
    born: float = field(default_factory=time.monotonic)
    ready: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # ready, or dead


@dataclass
class WarmPool:
    size: int
    log_path: Path
    command: Sequence[str] = SPARE
    refill_delay_s: float = 0.0
    spares: list[Spare] = field(default_factory=list)
    _starting: int = 0
    import_s: float | None = None  # how long the newest ready spare took to import
    # a spare's imports keep about one core busy: on a node with few cores several at once
    # each take longer, and the first launch would wait for all of them
    imports_at_once: int = field(default_factory=lambda: max(1, (os.cpu_count() or 1) // 4))
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _closed: bool = False

    def resize(self, size: int) -> None:
        """Keep ``size`` spares: start the missing ones in the background, kill any over."""
        if self._closed or size == self.size:
            return
        self.size = size
        surplus = len(self.spares) - size
        if surplus > 0:
            # the youngest first: the oldest are the likeliest to be ready
            extra, self.spares = self.spares[size:], self.spares[:size]
            for spare in extra:
                _end(spare.proc)
                self._background(_reap(spare.proc))
        self._background(self._top_up())

    def ready(self) -> int:
        return sum(1 for s in self.spares if s.ready and s.proc.returncode is None)

    async def take(self, launch: WarmLaunch) -> asyncio.subprocess.Process | None:
        """A spare turned into the rank ``launch`` describes, or None: start it cold. A
        spare still importing is handed the launch at once and returned as the rank: it
        reads the launch once its imports are done (:meth:`_hand_over_later`)."""
        if self.size == 0:
            return None  # the pool is off
        self._prune()
        spare = next((s for s in self.spares if s.ready), None) or next(iter(self.spares), None)
        if spare is None:
            log.info("no warm interpreter: rank starts cold")
            self._refill()
            return None
        if (name := import_time_difference(spare.env, launch.env)) is not None:
            log.info("rank environment differs at import time: rank starts cold", variable=name)
            return None
        self.spares.remove(spare)
        self._refill()
        proc = spare.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(encode(launch) + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except OSError:
            log.warning("warm interpreter did not take the launch: rank starts cold", pid=proc.pid)
            await _kill(proc)
            return None
        if not spare.ready:
            self._background(self._hand_over_later(spare))
            return proc
        word = b""
        with contextlib.suppress(OSError, TimeoutError):
            word = await asyncio.wait_for(proc.stdout.readline(), HANDOVER_S)
        if word != STARTED:
            log.warning("warm interpreter did not take the launch: rank starts cold", pid=proc.pid)
            await _kill(proc)
            return None
        # the rank's own log replaces this pipe: it ends at EOF, and wait() waits for that
        self._background(_drain(proc.stdout))
        return proc

    def wait_bound(self) -> float:
        """How long a spare handed a launch while importing may take to start it: twice
        as long as the newest spare's imports took, at least three hand-overs' bound and
        at most ``FIRST_IMPORT_WAIT_S``."""
        if self.import_s is None:
            return FIRST_IMPORT_WAIT_S
        return min(FIRST_IMPORT_WAIT_S, max(3 * HANDOVER_S, 2 * self.import_s))

    async def _hand_over_later(self, spare: Spare) -> None:
        """A spare already is its rank's process; one that has not started the rank
        within :meth:`wait_bound` is wedged and killed: its rank exits, and is reported
        like any rank's exit. The agent's own shutdown leaves it be (ranks outlive the
        agent, and it reads its launch on its own)."""
        proc, bound = spare.proc, self.wait_bound()
        assert proc.stdout is not None
        log.info(
            "warm interpreter still importing: it starts the rank when ready",
            pid=proc.pid,
            importing_s=round(time.monotonic() - spare.born, 2),
            bound_s=round(bound, 1),
        )
        word = b""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(bound):
                await spare.settled.wait()
                if spare.ready:
                    word = await proc.stdout.readline()
        if self._closed:
            return
        if word == STARTED:
            await _drain(proc.stdout)
            return
        log.warning(
            "warm interpreter did not start its rank: killed, its exit is the rank's",
            pid=proc.pid,
            died=proc.returncode is not None,
            bound_s=round(bound, 1),
        )
        await _kill(proc)

    async def close(self) -> None:
        """Kill every spare (not the ranks they became); the pool starts no more."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        spares, self.spares = self.spares, []
        await asyncio.gather(*(_kill(s.proc) for s in spares), return_exceptions=True)

    def _refill(self) -> None:
        async def later() -> None:
            await asyncio.sleep(self.refill_delay_s)
            await self._top_up()

        self._background(later())

    def _prune(self) -> None:
        """Forget spares that died after they were ready: their places are free again."""
        self.spares = [s for s in self.spares if s.proc.returncode is None]

    def _importing(self) -> int:
        return self._starting + sum(1 for s in self.spares if not s.ready)

    async def _top_up(self) -> None:
        """Start missing spares, no more importing at once than ``imports_at_once``; the
        next starts when one is ready."""
        self._prune()
        while (
            not self._closed
            and len(self.spares) + self._starting < self.size
            and self._importing() < self.imports_at_once
        ):
            self._starting += 1
            try:
                spare = await self._spawn()
            finally:
                self._starting -= 1
            if spare is None:
                return
            if self._closed:
                await _kill(spare.proc)
                return
            self.spares.append(spare)
            self._background(self._await_ready(spare))

    async def _spawn(self) -> Spare | None:
        env = dict(os.environ)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.log_path.open("ab") as logf:
                proc = await asyncio.create_subprocess_exec(
                    *self.command,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=logf,
                    env=env,
                    start_new_session=True,
                )
        except OSError as exc:
            log.warning("cannot start a warm interpreter", error=str(exc))
            return None
        return Spare(proc, env)

    async def _await_ready(self, spare: Spare) -> None:
        try:
            await self._read_ready(spare)
        finally:
            spare.settled.set()

    async def _read_ready(self, spare: Spare) -> None:
        assert spare.proc.stdout is not None
        word = await spare.proc.stdout.readline()
        if word == READY:
            spare.ready = True
            self.import_s = time.monotonic() - spare.born
            log.info("warm interpreter ready", pid=spare.proc.pid, import_s=round(self.import_s, 2))
            await self._top_up()
            return
        if spare not in self.spares:
            return  # ended on purpose (resize, close), or a launch waits on it
        # died before it was ready: not replaced until a launch asks (no restart loop)
        self.spares.remove(spare)
        code = await _kill(spare.proc)
        log.warning("warm interpreter died before it was ready", code=code, log=str(self.log_path))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(4096):
        pass


def _end(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the spare's session (it has not become a rank) and close its stdin."""
    if proc.stdin is not None:
        proc.stdin.close()
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    await proc.wait()


async def _kill(proc: asyncio.subprocess.Process) -> int:
    """End the spare and reap it; its exit status."""
    _end(proc)
    return await proc.wait()
