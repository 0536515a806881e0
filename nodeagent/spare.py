"""One spare interpreter as the pool sees it (``nodeagent.warm_pool``): its process and
connection, whether it can serve a rank's environment, and how it ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.adoption import AdoptedRank, RankProcess
from ringmaster.procs import pid_alive, start_time

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
    """A spare and the pool's connection to it. ``child`` is None for a spare adopted from
    the agent before this one: known by its PID and start time, not waitable."""

    pid: int
    started: int | None
    env: dict[str, str]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    socket: Path
    child: asyncio.subprocess.Process | None = None
    born: float = field(default_factory=time.monotonic)
    ready: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # ready, or dead

    def alive(self) -> bool:
        if self.child is not None:
            return self.child.returncode is None
        return pid_alive(self.pid) and start_time(self.pid) == self.started

    def as_rank(self, job: str, exit_record: Path) -> RankProcess:
        """The rank's process: the child itself, or an adopted spare watched as an adopted
        rank is (its status from the exit record it leaves)."""
        if self.child is not None:
            return self.child
        return AdoptedRank(job, self.pid, self.started, exit_record)


def close(spare: Spare) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        spare.writer.close()


async def kill(spare: Spare) -> int | None:
    """End a spare that is not a rank (its whole session), reap it and remove its socket;
    its exit status (None for an adopted one, which is nobody's child here)."""
    close(spare)
    spare.socket.unlink(missing_ok=True)
    if spare.alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(spare.pid, signal.SIGKILL)
    if spare.child is not None:
        return await spare.child.wait()
    return None
