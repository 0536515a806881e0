"""Warm interpreters an agent that died left running (the template and its spares),
found and taken over by the agent started after it.

A spare is not a rank, yet it is just as costly to lose, and its template more so: the
template's imports take seconds (16 to 19 s on two busy cores), and without it every spare
would need them again. So they outlive their agent the way ranks do. Each listens on a
socket in the run directory (``ringmaster.rundir.spare_dir``) named by its PID, its start
time and the stamp of the code it imported (the template's name says it is one); the
restarted agent connects to every one whose process still runs. One that has become a rank
closed its socket (the connection is refused), and one whose code differs from what this
agent would start (an upgrade between the two agents) is killed: it would train with the
old code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import structlog

from ringmaster.procs import environment
from ringmaster.rundir import RecordedSpare, recorded_spares, spare_running

log = structlog.get_logger()

CONNECT_S = 2.0  # a listening spare's socket accepts into its backlog at once
PACKAGES = ("trainer", "proto", "ringmaster")  # what a spare imports of ours
LIBRARIES = ("torch", "deepspeed", "torchao")

# a spare, the environment it started with (its import-time settings), its connection
Found = tuple[RecordedSpare, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]


def code_stamp(command: Sequence[str]) -> str:
    """What a spare started with ``command`` imports, in 12 hex digits: the command, our
    packages' sources (path, size, modification time) and the training libraries'
    versions. Found without importing any of them."""
    digest = hashlib.sha256("\0".join(command).encode())
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            for source in sorted(Path(location).rglob("*.py")):
                with contextlib.suppress(OSError):
                    st = source.stat()
                    digest.update(f"{source}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    for library in LIBRARIES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            digest.update(f"{library}={importlib.metadata.version(library)}\0".encode())
    return digest.hexdigest()[:12]


async def predecessors_spares(run_dir: Path, stamp: str) -> list[Found]:
    """Every spare of ``run_dir`` still waiting for an agent, connected to (its READY
    comes once its imports are done). The sockets of spares that are gone or are ranks now
    are removed, and spares of code other than ``stamp`` killed."""
    spares, unnamed = recorded_spares(run_dir)
    for path in unnamed:  # an agent died starting it: its spare exits on its own
        path.unlink(missing_ok=True)
    found: list[Found] = []
    for spare in spares:
        if not spare_running(spare):
            spare.path.unlink(missing_ok=True)
            continue
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(spare.path)), CONNECT_S
            )
        except (OSError, TimeoutError):  # refused: it runs a rank now
            spare.path.unlink(missing_ok=True)
            continue
        if spare.stamp != stamp:
            writer.close()
            spare.path.unlink(missing_ok=True)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(spare.pid, signal.SIGKILL)
            log.info("warm interpreter of other code killed", pid=spare.pid, stamp=spare.stamp)
            continue
        found.append((spare, environment(spare.pid), reader, writer))
    return found
