"""Fixtures that run real trainer ranks: each rank a ``python -m trainer.worker`` process
with the torchrun environment set by hand, its stderr in its own log file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from proto.job import JobSpec
from ringmaster.memory_store import remove_job_ram
from ringmaster.rank.log import read
from tests.trainer.zygote import Forked, Zygote
from tests.waits import until

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def job_spec(**sections: dict[str, Any]) -> JobSpec:
    """A small fast job (tiny model, fp32, DDP) with ``sections`` merged over it."""
    raw: dict[str, Any] = {
        "job": {"name": "test"},
        "train": {
            "engine": "ddp",
            "model": "tiny",
            "steps": 10,
            "precision": "fp32",
            "micro_batch_size": 2,
            "seq_len": 32,
            "lr": 3e-3,
        },
        "checkpoint": {"every_steps": 1000, "dir": "ckpt", "keep": 3},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return msgspec.convert(raw, JobSpec)


class Ranks:
    """One launch of a job: ``world_size`` worker processes."""

    def __init__(self, procs: list[subprocess.Popen[bytes] | Forked], logs: list[Path]) -> None:
        self.procs = procs
        self.logs = logs

    def wait(self, timeout: float = 90.0) -> list[int]:
        """Every rank's exit status, once all have ended within ``timeout``."""
        until(
            lambda: all(p.poll() is not None for p in self.procs),
            timeout,
            "every rank's end",
            lambda: {rank: p.poll() for rank, p in enumerate(self.procs)},
            interval=0.05,
        )
        return [p.wait() for p in self.procs]

    def signal(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def events(self, rank: int, event: str) -> list[dict[str, str]]:
        """The fields of every ``event=<event>`` log line of ``rank``."""
        return [r for r in read(self.log(rank)) if r["event"] == event]

    def wait_for_event(self, rank: int, event: str, timeout: float = 30.0) -> dict[str, str]:
        """The first ``event`` line of ``rank``'s log, waiting up to ``timeout`` for it."""

        def found() -> dict[str, str] | None:
            ended = self.procs[rank].poll() is not None  # before reading: its last words
            lines = self.events(rank, event)
            if lines:
                return lines[0]
            assert not ended, f"rank {rank} ended, and logged no {event}:\n{self.log(rank)}"
            return None

        return until(found, timeout, f"rank {rank}'s {event}", lambda: self.log(rank), 0.05)


class Launcher:
    def __init__(self, workdir: Path, zygote: Zygote | None = None) -> None:
        self.workdir = workdir
        self.zygote = zygote  # forks the ranks when there is one (tests/trainer/zygote.py)
        self.launched: list[Ranks] = []
        self.count = 0
        # unique, so staging dirs and memory snapshots in /dev/shm never clash, not even
        # with those a killed earlier run of the same test left
        self.job_id = f"test-{workdir.name}-{uuid.uuid4().hex[:6]}"
        self.job_ids: set[str] = set()

    def __call__(
        self,
        spec: JobSpec,
        *,
        world_size: int = 2,
        job_id: str | None = None,
        socket_path: Path | None = None,
        env: dict[str, str] | None = None,
        per_rank_env: dict[int, dict[str, str]] | None = None,
        argv: list[str] | None = None,
    ) -> Ranks:
        """``argv``: the rank's command after the interpreter (default: the built-in
        trainer, ``-m trainer.worker``)."""
        self.count += 1
        self.job_ids.add(job_id or self.job_id)
        spec_path = self.workdir / f"spec-{self.count}.json"
        spec_path.write_bytes(msgspec.json.encode(spec))
        port = free_port()
        procs, logs = [], []
        for rank in range(world_size):
            rank_env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "RINGMASTER_JOB_SPEC": str(spec_path),
                "RINGMASTER_JOB_ID": job_id or self.job_id,
                "RINGMASTER_WORKDIR": str(self.workdir),
                "PYTHONPATH": str(REPO),
                **(env or {}),
                **(per_rank_env or {}).get(rank, {}),
            }
            if socket_path is not None:
                rank_env["RINGMASTER_CONTROL_SOCKET"] = str(socket_path)
            log = self.workdir / f"launch-{self.count}-rank-{rank}.log"
            command = argv or ["-m", "trainer.worker"]
            forked = (
                self.zygote.spawn(command, rank_env, self.workdir, log) if self.zygote else None
            )
            if forked is not None:
                procs.append(forked)
            else:
                with log.open("wb") as stderr:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, *command],
                            cwd=self.workdir,
                            env=rank_env,
                            stdout=subprocess.DEVNULL,
                            stderr=stderr,
                        )
                    )
            logs.append(log)
        ranks = Ranks(procs, logs)
        self.launched.append(ranks)
        return ranks


@pytest.fixture
def make_spec() -> Callable[..., JobSpec]:
    """``make_spec(train={...}, checkpoint={...})``: :func:`job_spec` as a fixture."""
    return job_spec


@pytest.fixture
def launch(tmp_path: Path, zygote: Zygote | None) -> Iterator[Launcher]:
    """Start ranks with ``launch(spec, ...)``; any still running at teardown are killed."""
    launcher = Launcher(tmp_path, zygote)
    yield launcher
    for ranks in launcher.launched:
        ranks.signal(signal.SIGKILL)
        ranks.wait(10)
    # a killed rank leaves its staged shard and its memory tier behind
    for job_id in {launcher.job_id, *launcher.job_ids}:
        remove_job_ram(job_id)
