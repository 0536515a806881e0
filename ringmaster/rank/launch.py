"""A rank's launch contract: torchrun's environment plus Ringmaster's additions.

A rank reads exactly what ``torchrun`` sets (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the same job runs unchanged under plain
torchrun (for a benchmark, say) or under a node agent, which adds:

* ``RINGMASTER_JOB_SPEC``: a JSON ``proto.job.JobSpec``; without it, ``--config JOB.toml``.
* ``RINGMASTER_JOB_ID`` (default ``local``) and ``RINGMASTER_WORKDIR`` (default the current
  directory; relative paths in the spec resolve against it).
* ``RINGMASTER_CONTROL_SOCKET``: the agent's Unix socket; rank 0 alone connects to it.
* ``RINGMASTER_ATTEMPT``: the job attempt the rank was launched for (default 0: none),
  stamped on every line it logs (:mod:`ringmaster.rank.log`).

The names are :mod:`ringmaster.rank_env`'s, which the agent sets from too.

Beside the job spec the agent wrote, the rank leaves its beat and, as it exits, its exit
record (:func:`exit_record`): how an agent that did not start it learns its exit status.

Every problem found here is a :class:`SpecError`, which the built-in worker prints as one
line and exits 2 for, before any rank joins the process group (the rank API raises it as
its own error).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from proto.job import JobSpec
from ringmaster import rank_env
from ringmaster.rundir import exit_beside


class SpecError(Exception):
    """A bad job spec or launch environment: reported in one line, exit status 2."""


@dataclass(frozen=True)
class Launch:
    spec: JobSpec
    job_id: str
    workdir: Path
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    control_socket: Path | None
    attempt: int

    def resolve(self, path: str) -> Path:
        """``path`` from the spec, relative to the job's working directory."""
        return self.workdir / path


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SpecError(f"{name}={raw!r} is not an integer") from None


def load_spec(env: Mapping[str, str], argv: Sequence[str]) -> JobSpec:
    """The job spec from ``RINGMASTER_JOB_SPEC`` (JSON), else from ``--config`` (TOML)."""
    parser = argparse.ArgumentParser(prog="python -m trainer.worker")
    parser.add_argument("--config", help="job TOML file, used when RINGMASTER_JOB_SPEC is unset")
    args = parser.parse_args(argv)
    if spec_path := env.get(rank_env.JOB_SPEC):
        path, decode = Path(spec_path), msgspec.json.decode
    elif args.config:
        path, decode = Path(args.config), msgspec.toml.decode
    else:
        raise SpecError("no job spec: set RINGMASTER_JOB_SPEC or pass --config JOB.toml")
    try:
        return decode(path.read_bytes(), type=JobSpec)
    except OSError as exc:
        raise SpecError(f"cannot read job spec {path}: {exc.strerror}") from None
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
        raise SpecError(f"invalid job spec {path}: {exc}") from None


def read_launch(env: Mapping[str, str], argv: Sequence[str]) -> Launch:
    """Everything a rank needs from its environment and command line, validated."""
    spec = load_spec(env, argv)
    world_size = _int_env(env, "WORLD_SIZE", 1)
    rank = _int_env(env, "RANK", 0)
    if not 0 <= rank < world_size:
        raise SpecError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    # Without MASTER_PORT only a single process makes sense; it picks a free port itself.
    if world_size > 1 and "MASTER_PORT" not in env:
        raise SpecError(f"WORLD_SIZE={world_size} needs MASTER_ADDR and MASTER_PORT")
    socket = env.get(rank_env.CONTROL_SOCKET)
    return Launch(
        spec=spec,
        job_id=env.get(rank_env.JOB_ID, "local"),
        workdir=Path(env.get(rank_env.WORKDIR) or Path.cwd()),
        rank=rank,
        local_rank=_int_env(env, "LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=_int_env(env, "LOCAL_WORLD_SIZE", 1),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int_env(env, "MASTER_PORT", 0),
        control_socket=Path(socket) if socket else None,
        attempt=_int_env(env, rank_env.ATTEMPT, 0),
    )


def exit_record(env: Mapping[str, str]) -> Path | None:
    """Where this rank leaves its exit status for its node agent (beside the job spec the
    agent wrote, ``ringmaster.rundir.exit_beside``); None without an agent's spec or with
    a ``RANK`` that is not a rank number (nobody would look for it)."""
    spec, rank = env.get(rank_env.JOB_SPEC), env.get("RANK", "0")
    if not spec or not (rank.isascii() and rank.isdigit()):
        return None
    return exit_beside(Path(spec), int(rank))


def torch_threads(env: Mapping[str, str], local_world_size: int) -> int:
    """Intra-op threads per rank: ``OMP_NUM_THREADS`` if set, else the cores shared evenly
    among this node's ranks (oversubscribing a small CPU box makes every rank slower)."""
    if "OMP_NUM_THREADS" in env:
        return max(1, _int_env(env, "OMP_NUM_THREADS", 1))
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))
