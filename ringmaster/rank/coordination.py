"""How the ranks of a checkpoint talk, and how a resume finds the newest checkpoint every
rank can use. Shared by the durable tier (:mod:`ringmaster.rank.checkpoint`) and the memory tier
(:mod:`ringmaster.rank.memory_tier`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringmaster.rank import durable
from ringmaster.thread_cpu import started_by


@dataclass
class Coordination:
    """How the ranks of a checkpoint talk: a gloo group, or nothing for one process."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    threads: frozenset[int] = frozenset()  # the group's own threads (ringmaster.thread_cpu)

    @classmethod
    def over_gloo(cls, timeout: timedelta | None = None) -> Coordination:
        """Every rank of the default process group, on a new gloo group of their own
        (every rank makes it at the same point); the threads it started are kept, as the
        memory tier counts their CPU time."""
        group, threads = started_by(partial(dist.new_group, backend="gloo", timeout=timeout))
        return cls(dist.get_rank(), dist.get_world_size(), group, threads)

    def all_gather(self, item: Any) -> list[Any]:
        if self.world_size == 1:
            return [item]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, item, group=self.group)
        return out

    def broadcast(self, item: Any) -> Any:
        if self.world_size == 1:
            return item
        box = [item]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())


@dataclass(frozen=True)
class Figures:
    """What each rank says of a snapshot in the gather that seals it; the memory tier's
    cadence and room check read every rank's (:class:`ringmaster.rank.memory_tier.Cadence`)."""

    entries: dict[str, durable.FileEntry] | None  # None: this rank failed to write
    stall_s: float = 0.0  # the loop was blocked this long
    previous_s: float = 0.0  # the previous memory snapshot's background work, end to end
    previous_cpu_s: float = 0.0  # the CPU time that work took (its thread's and the group's)
    step_s: float = 0.0  # the rank's recent step time
    free_bytes: int = 0  # free in the memory store's filesystem


FileChooser = Callable[[durable.Manifest], list[str] | None]


def find_resumable(
    root: Path, coord: Coordination, choose: FileChooser
) -> tuple[durable.Manifest, Path] | None:
    """The newest checkpoint every rank can use: for each candidate step dir, ``choose``
    names the files this rank needs (None: it cannot use that checkpoint), each rank
    verifies its files against the manifest, and the ranks agree. Returns the manifest and
    step dir, or None to start fresh."""
    names: list[str] = coord.broadcast(durable.candidates(root) if coord.rank == 0 else None)
    for name in names:
        step_dir = root / name
        manifest = durable.read_manifest(step_dir)
        ok = False
        if manifest is not None and manifest.step == durable.parse_step(name):
            files = choose(manifest)
            ok = files is not None and all(durable.verify(step_dir, manifest, f) for f in files)
        if coord.all_true(ok) and manifest is not None:
            return manifest, step_dir
    return None


def load_file(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state
