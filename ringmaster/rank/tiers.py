"""The checkpoints a job's spec asks of a rank, whichever loop it runs: the durable tier
(``[checkpoint] dir``, each snapshot staged in RAM first) and, where the job has it, the
memory tier under it. One place builds them, so a user's loop (the rank API's driver, for
the state it registered) and a loop with its own engine (the built-in trainer's worker)
checkpoint alike; every rank calls it at the same point, as the memory tier gathers
every rank's node."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

import torch

from ringmaster import rank_env
from ringmaster.rank import memory_tier, termination
from ringmaster.rank.checkpoint import Checkpointer, default_staging_dir
from ringmaster.rank.coordination import Coordination
from ringmaster.rank.launch import Launch
from ringmaster.rank.log import Log


def checkpointer(
    launch: Launch,
    coord: Coordination,
    state: str,
    device: torch.device,
    env: Mapping[str, str],
    log: Log,
    *,
    memory_cap: int | None = None,
    persist_delay_s: float = 0.0,
    persist_gate: Path | None = None,
) -> Checkpointer:
    """This rank's checkpointer for the state named ``state`` (its manifests say so), its
    staged copies dropped if the agent stops the rank, with the memory tier when the job
    has one (what became of it logged). ``memory_cap``: the tier's sparsest cadence in
    steps (default the durable checkpoints'); ``persist_delay_s``, ``persist_gate``: the
    tests' hooks (:class:`ringmaster.rank.checkpoint.Checkpointer`)."""
    ckpt = launch.spec.checkpoint
    staging = launch.resolve(ckpt.staging_dir) if ckpt.staging_dir else None
    made = Checkpointer(
        launch.resolve(ckpt.dir),
        staging or default_staging_dir(launch.job_id, launch.workdir),
        coord,
        keep=ckpt.keep,
        engine=state,
        job=launch.job_id,
        persist_delay_s=persist_delay_s,
        persist_gate=persist_gate,
    )
    termination.on_sigterm(made.discard_staging)
    if ckpt.memory_tier:
        node = env.get(rank_env.NODE) or socket.gethostname()
        made.memory, said = memory_tier.build(
            coord,
            launch.job_id,
            node,
            ckpt.memory_every_steps,
            ckpt.every_steps if memory_cap is None else memory_cap,
            memory_tier.shares_cores(device, launch.local_world_size),
            first_attempt=launch.attempt == 1,
        )
        log("memory_tier", state=said)
    return made
