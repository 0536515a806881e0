"""Two-stage checkpoints: the loop blocks only to snapshot state in memory; a background
thread serialises it and makes it durable.

Snapshot (the only part the training loop waits for): each rank copies its model and
optimizer tensors into host buffers (:class:`trainer.host_buffers.HostBuffers`, or DCP's
stager) that are allocated in the background early in the run and reused by every
checkpoint (on CUDA: pinned memory, non-blocking copies, one synchronize per device), and
captures its step and RNG (the data position is a pure function of the step). The result
is a dict of file name -> object to ``torch.save``: a private copy the next optimizer step
cannot touch. An engine that must write files itself may also write them into the rank's
staging dir (``/dev/shm`` by default) during the snapshot; nothing else is written there.

Persist, in one background thread per rank: serialise each snapshot object straight into
``<dir>/step-<N>/`` and copy any staged files there (hashed while writing, fsynced), or
wait for the files an engine writes there itself (:class:`Written`: DCP), then
gather every rank's file list with sha256 and sizes over a dedicated gloo group; rank 0
writes the manifest and moves ``latest`` (:func:`trainer.durable.commit`) only if every
rank succeeded, prunes old checkpoints and reports the checkpoint. A separate process group
keeps these collectives from interleaving with the training loop's. One persist at a time:
the next snapshot waits for the previous persist (it reuses its buffers), and that wait
counts as stall.

Resume: every rank checks the files it needs in each candidate (``latest`` first, then
older) against the manifest, and the ranks agree (all-reduce MIN) on the newest one valid
for all of them, so a partial or corrupt checkpoint is never loaded and no two ranks load
different steps.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer import durable
from trainer.host_buffers import HostBuffers as HostBuffers  # re-exported for the benches

OnDurable = Callable[[int, Path, float], None]


@dataclass(frozen=True)
class Written:
    """Files an engine writes into the durable step dir itself, in the background (DCP's
    upload thread): the persist thread calls ``wait`` for their names (relative to the step
    dir), once written and fsynced, then hashes them in place."""

    wait: Callable[[], list[str]]


# Takes this rank's snapshot, given the rank's (empty) staging dir and the durable step dir
# the persist will fill: returns file name (relative to the step dir) -> object to serialise
# with torch.save in the background, or a :class:`Written` for files the engine writes
# there itself; may also write files into the staging dir, to be copied.
Stage = Callable[[Path, Path], dict[str, Any]]


def default_staging_dir(job_id: str, workdir: Path) -> Path:
    """A per-job dir in ``/dev/shm`` when that is writable (RAM), else under the workdir."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"ringmaster-{safe}"
    return workdir / ".staging"


@dataclass
class Coordination:
    """How the ranks of a checkpoint talk: a gloo group, or nothing for one process."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

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


class Checkpointer:
    def __init__(
        self,
        root: Path,
        staging: Path,
        coord: Coordination,
        *,
        keep: int,
        engine: str,
        job: str = "",
        on_durable: OnDurable | None = None,
        persist_delay_s: float = 0.0,
        persist_gate: Path | None = None,
    ) -> None:
        self.root = root
        self.coord = coord
        self.keep = keep
        self.engine = engine
        self.job = job  # recorded in every manifest: which job wrote the checkpoint
        self.on_durable = on_durable
        self.persist_delay_s = persist_delay_s  # test hook: widens the window for a kill
        self.persist_gate = persist_gate  # test hook: persists start serialising once it exists
        self.staging = staging / f"rank-{coord.rank}"
        self.last_step: int | None = None  # newest step staged (or resumed from)
        self.last_stall_s = 0.0
        self.last_in_memory: list[str] = []  # files of the newest snapshot still in memory
        self.durable_step: int | None = None  # newest step this rank knows is committed
        self._thread: threading.Thread | None = None
        root.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, stage: Stage) -> float:
        """Snapshot step ``step`` (``stage`` takes it) and start persisting it; returns the
        seconds the caller was blocked (waiting for the previous persist, then the
        snapshot). Saving the step already staged just waits for it to be durable and
        reports it again (an on-demand checkpoint right after a periodic one)."""
        start = time.monotonic()
        self.wait()
        if step == self.last_step:
            stall = time.monotonic() - start
            self._announce(step, stall)
            return stall
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        objects = stage(self.staging, self.root / durable.step_dir_name(step))
        stall = time.monotonic() - start
        self.last_step, self.last_stall_s, self.last_in_memory = step, stall, sorted(objects)
        self._thread = threading.Thread(
            target=self._persist, args=(step, stall, objects), name=f"persist-{step}", daemon=True
        )
        self._thread.start()
        return stall

    def wait(self) -> None:
        """Block until the persist in flight (if any) has finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Wait for the last persist, then drop this rank's staged copy."""
        self.wait()
        self.discard_staging()

    def discard_staging(self) -> None:
        """Drop this rank's staged copy (and the job's staging dir once it is empty)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.staging.parent.rmdir()  # only once every rank on the node has left

    def _persist(self, step: int, stall: float, objects: dict[str, Any]) -> None:
        step_dir = self.root / durable.step_dir_name(step)
        entries: dict[str, durable.FileEntry] | None = None
        try:
            while self.persist_gate is not None and not self.persist_gate.exists():
                time.sleep(0.05)
            entries = durable.copy_tree(self.staging, step_dir)
            for name, obj in objects.items():
                if isinstance(obj, Written):
                    for written in obj.wait():
                        entries[written] = durable.hash_file(step_dir / written)
                else:
                    entries[name] = durable.write_and_hash(step_dir / name, _saver(obj))
            durable.fsync_parents(step_dir, entries)
        except Exception as exc:  # any failure must still reach the all_gather below
            print(f"trainer: persist of step {step} failed: {exc!r}", file=sys.stderr, flush=True)
            entries = None
        if self.persist_delay_s:
            time.sleep(self.persist_delay_s)
        gathered: list[dict[str, durable.FileEntry] | None] = self.coord.all_gather(entries)
        if any(e is None for e in gathered):
            return  # some rank failed: leave the dir unsealed, ``latest`` where it was
        if self.coord.rank == 0:
            ranks = {str(r): sorted(e) for r, e in enumerate(gathered) if e is not None}
            files = {name: entry for e in gathered if e is not None for name, entry in e.items()}
            try:
                durable.commit(
                    self.root, step, self.coord.world_size, self.engine, files, ranks, self.job
                )
                durable.prune(self.root, self.keep)
            except OSError as exc:
                print(f"trainer: commit of step {step} failed: {exc}", file=sys.stderr, flush=True)
                return
        self.durable_step = step
        self._announce(step, stall)

    def _announce(self, step: int, stall: float) -> None:
        if self.on_durable is not None and self.coord.rank == 0 and self.durable_step == step:
            self.on_durable(step, self.root / durable.step_dir_name(step), stall)


def _saver(obj: Any) -> Callable[[durable.Sink], None]:
    def save(sink: durable.Sink) -> None:
        torch.save(obj, sink)  # type: ignore[arg-type]  # write and flush are all it uses

    return save


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
