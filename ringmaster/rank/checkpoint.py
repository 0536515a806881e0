"""Two-stage checkpoints: the loop blocks only to snapshot state in memory; a background
thread serialises it and makes it durable.

Snapshot (the only part the training loop waits for): each rank copies its model and
optimizer tensors into host buffers (:class:`ringmaster.rank.host_buffers.HostBuffers`, or DCP's
stager) that are allocated in the background early in the run and reused by every
checkpoint (on CUDA: pinned memory, non-blocking copies, one synchronize per device), and
captures its step and RNG (the data position is a pure function of the step). The result
is a dict of file name -> object to ``torch.save``: a private copy the next optimizer step
cannot touch. An engine that must write files itself may also write them into the rank's
staging dir (``/dev/shm`` by default) during the snapshot; nothing else is written there.

Persist, in one background thread per rank: serialise each snapshot object into the
step dir of the job's memory tier when it has one (:mod:`ringmaster.rank.memory_tier`: RAM on this
node, copied to a buddy rank's node), else straight into ``<dir>/step-<N>/``, copying any
staged files there (hashed while writing), or wait for the files an engine writes there
itself (:class:`Written`: DCP); for a durable checkpoint with a memory tier, copy the
files from RAM into ``<dir>/step-<N>/`` (fsynced). Then gather every rank's file list with
sha256 and sizes over a dedicated gloo group; the memory tier seals its step once the
buddy copies are made, and for a durable checkpoint rank 0 writes the manifest and moves
``latest`` (:func:`ringmaster.rank.durable.commit`) only if every rank succeeded, prunes old
checkpoints and reports the checkpoint. A separate process group keeps these collectives
from interleaving with the training loop's. One persist at a time: the next snapshot
waits for the previous persist (it reuses its buffers), and that wait counts as stall.
A memory snapshot is the same pipeline without the durable copy; a durable checkpoint of
a step already in memory only copies it. Stalls and the background's time are read from
the checkpointer's clock: they are reported, and the memory tier plans its cadence on
them.

Resume (:mod:`ringmaster.rank.coordination`): every rank checks the files it needs in each
candidate (``latest`` first, then older) against the manifest, and the ranks agree
(all-reduce MIN) on the newest one valid for all of them, so a partial or corrupt
checkpoint is never loaded and no two ranks load different steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from proto.job import shm_staging_name
from ringmaster import thread_cpu
from ringmaster.clock import SYSTEM, Clock
from ringmaster.rank import durable
from ringmaster.rank.coordination import Coordination, Figures
from ringmaster.rank.host_buffers import HostBuffers as HostBuffers  # re-exported for the benches

if TYPE_CHECKING:
    from ringmaster.rank.memory_tier import MemoryTier

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
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / shm_staging_name(job_id)
    return workdir / ".staging"


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
        clock: Clock = SYSTEM,
    ) -> None:
        self.root = root
        self.clock = clock
        self.coord = coord
        self.keep = keep
        self.engine = engine
        self.job = job  # recorded in every manifest: which job wrote the checkpoint
        self.on_durable = on_durable
        self.persist_delay_s = persist_delay_s  # test hook: widens the window for a kill
        self.persist_gate = persist_gate  # test hook: persists start serialising once it exists
        self.staging = staging / f"rank-{coord.rank}"
        self.last_step: int | None = None  # newest step staged durably (or resumed from)
        self.last_stall_s = 0.0
        self.last_in_memory: list[str] = []  # files of the newest snapshot still in memory
        self.durable_step: int | None = None  # newest step this rank knows is committed
        self.memory: MemoryTier | None = None  # the memory tier, when the job has one
        self.memory_last: int | None = None  # newest memory-only snapshot started
        self.memory_sealed: int | None = None  # newest step sealed in the memory tier
        self.memory_figures: list[Figures] = []  # every rank's, from the last memory seal
        self.memory_snapshots = 0
        self.memory_stall_s = 0.0
        self._own: tuple[int, dict[str, durable.FileEntry]] | None = None
        self._background_s = 0.0
        self._background_cpu_s = 0.0
        self._memory_only_in_flight = False  # the persist in flight is a memory snapshot's
        self._thread: threading.Thread | None = None
        root.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, stage: Stage) -> float:
        """Snapshot step ``step`` (``stage`` takes it) and start persisting it; returns the
        seconds the caller was blocked (waiting for the previous persist, then the
        snapshot). Saving the step already staged just waits for it to be durable and
        reports it again (an on-demand checkpoint right after a periodic one); a step
        already in the memory tier is copied from there."""
        start = self.clock.monotonic()
        self.wait()
        if step == self.last_step:
            stall = self.clock.monotonic() - start
            if self.durable_step == step:
                self._announce(step, stall)
            return stall
        self.last_step = step
        if self.memory is not None and step == self.memory_last and self._own is not None:
            stall = self.clock.monotonic() - start
            self._start(step, Figures(dict(self._own[1]), stall), {}, durable=True)
            return stall
        objects = self._stage(step, stage)
        stall = self.clock.monotonic() - start
        self.last_stall_s, self.last_in_memory = stall, sorted(objects)
        self._start(step, Figures(None, stall), objects, durable=True)
        return stall

    def memory_due(self, step: int) -> bool:
        return self.memory is not None and self.memory.cadence.due(step)

    def save_to_memory(
        self, step: int, stage: Stage, step_s: float, waited: float = 0.0
    ) -> dict[str, Any] | None:
        """Snapshot step ``step`` into the memory tier only (``waited``: what
        :meth:`settle` said, when the caller settled first). Returns what changed, for the
        rank's log: a new cadence, or the tier turned off (no room for it); None if
        nothing did. Decided from every rank's figures of the previous memory snapshot,
        read once it is sealed, so every rank decides alike at the same step."""
        tier = self.memory
        assert tier is not None
        waited += self.settle()
        figures = self.memory_figures
        if figures and (short := tier.room_short(figures)) is not None:
            self.forget_memory()
            self.memory = None
            return {"off": short}
        begin = self.clock.monotonic()
        objects = self._stage(step, stage)
        stall = waited + self.clock.monotonic() - begin
        change = tier.plan(step, figures)
        self.memory_last = step
        self.memory_snapshots += 1
        self.memory_stall_s += stall
        free = shutil.disk_usage(tier.store.root.parent.parent).free
        mine = Figures(None, stall, self._background_s, self._background_cpu_s, step_s, free)
        self._start(step, mine, objects, False)
        return change

    def busy(self) -> bool:
        """Whether a persist is in flight (the next snapshot would wait for it)."""
        return self._thread is not None and self._thread.is_alive()

    def settle(self) -> float:
        """Wait for the persist in flight; the seconds waited when it was a memory
        snapshot's (the memory tier's own cost; waiting for a durable one is not)."""
        start = self.clock.monotonic()
        self.wait()
        return self.clock.monotonic() - start if self._memory_only_in_flight else 0.0

    def forget_memory_together(self) -> None:
        """Every rank at once: wait for the persist in flight, agree that every rank has
        (ranks of one node share its store: none may still be sealing into it), then drop
        the memory tier's snapshots."""
        self.wait()
        if self.memory is not None:
            self.coord.all_true(True)
        self.forget_memory()

    def forget_memory(self) -> None:
        """Drop the memory tier's snapshots (this node's; every rank does it alike)."""
        if self.memory is not None:
            self.memory.store.clear()
        self.memory_last = self.memory_sealed = None
        self.memory_figures = []
        self._own = None

    @property
    def memory_totals(self) -> dict[str, Any]:
        """For the rank's last log line: memory snapshots taken and the loop's time in them."""
        if not self.memory_snapshots:
            return {}
        return {
            "memory_snapshots": self.memory_snapshots,
            "memory_stall_s": round(self.memory_stall_s, 4),
        }

    def _stage(self, step: int, stage: Stage) -> dict[str, Any]:
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        return stage(self.staging, self._write_dir(step))

    def _write_dir(self, step: int) -> Path:
        """Where a snapshot's files are written first: the memory tier when there is one
        (a durable checkpoint is then copied from it), else the durable step dir."""
        if self.memory is not None:
            return self.memory.store.step_dir(step)
        return self.root / durable.step_dir_name(step)

    def _start(self, step: int, figures: Figures, objects: dict[str, Any], durable: bool) -> None:
        self._memory_only_in_flight = not durable
        self._thread = threading.Thread(
            target=self._persist,
            args=(step, figures, objects, durable),
            name=f"persist-{step}",
            daemon=True,
        )
        self._thread.start()

    def wait(self) -> None:
        """Block until the persist in flight (if any) has finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Wait for the last persist, then drop this rank's staged copy."""
        self.wait()
        self.discard_staging()

    def _cpu_s(self) -> float:
        """CPU time of this thread and of the checkpoint group's own threads: a memory
        snapshot's background cost where it shares the cores with training."""
        return time.thread_time() + thread_cpu.cpu_s(self.coord.threads)

    def discard_staging(self) -> None:
        """Drop this rank's staged copy (and the job's staging dir once it is empty)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.staging.parent.rmdir()  # only once every rank on the node has left

    def _persist(
        self, step: int, figures: Figures, objects: dict[str, Any], durable_too: bool
    ) -> None:
        began, cpu = self.clock.monotonic(), self._cpu_s()
        step_dir = self.root / durable.step_dir_name(step)
        entries = figures.entries
        if not durable_too and self.memory is not None and self.memory.cadence.contended:
            yield_cores()
        try:
            while durable_too and self.persist_gate is not None and not self.persist_gate.exists():
                time.sleep(0.05)
            if entries is None:
                entries = self._write(self._write_dir(step), objects)
                self._own = (step, entries)
            if durable_too and self.memory is not None:
                written = self.memory.store.step_dir(step)
                for name in entries:
                    (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
                    durable.copy_and_hash(written / name, step_dir / name)
                durable.fsync_parents(step_dir, entries)
        except Exception as exc:  # any failure must still reach the all_gather below
            print(f"trainer: persist of step {step} failed: {exc!r}", file=sys.stderr, flush=True)
            entries = None
        if self.persist_delay_s and durable_too:
            time.sleep(self.persist_delay_s)
        gathered: list[Figures] = self.coord.all_gather(
            dataclasses.replace(figures, entries=entries)
        )
        if any(f.entries is None for f in gathered):
            return  # some rank failed: leave the dir unsealed, ``latest`` where it was
        ranks = {str(r): sorted(f.entries or {}) for r, f in enumerate(gathered)}
        files = {name: entry for f in gathered for name, entry in (f.entries or {}).items()}
        if self.memory is not None and objects:  # a new snapshot (not one promoted)
            try:
                self.memory.seal(step, files, ranks, self.engine, self.job)
                self.memory_sealed = step
            except OSError as exc:  # the durable commit below must still happen
                print(f"trainer: memory seal of step {step} failed: {exc}", file=sys.stderr)
            if not durable_too:
                self.memory_figures = gathered
                self._background_s = self.clock.monotonic() - began
                self._background_cpu_s = self._cpu_s() - cpu
        if not durable_too:
            return
        if self.coord.rank == 0:
            try:
                durable.commit(
                    self.root, step, self.coord.world_size, self.engine, files, ranks, self.job
                )
                durable.prune(self.root, self.keep)
            except OSError as exc:
                print(f"trainer: commit of step {step} failed: {exc}", file=sys.stderr, flush=True)
                return
        # announced first, so no step report names this step durable before its own report
        self._announce(step, figures.stall_s)
        self.durable_step = step

    def _write(self, where: Path, objects: dict[str, Any]) -> dict[str, durable.FileEntry]:
        """Serialise ``objects`` (and copy the staged files) into ``where``."""
        entries = durable.copy_tree(self.staging, where)
        for name, obj in objects.items():
            if isinstance(obj, Written):
                for written in obj.wait():
                    entries[written] = durable.hash_file(where / written)
            else:
                entries[name] = durable.write_and_hash(where / name, _saver(obj))
        durable.fsync_parents(where, entries)
        return entries

    def _announce(self, step: int, stall: float) -> None:
        if self.on_durable is not None and self.coord.rank == 0:
            self.on_durable(step, self.root / durable.step_dir_name(step), stall)


def _saver(obj: Any) -> Callable[[durable.Sink], None]:
    def save(sink: durable.Sink) -> None:
        torch.save(obj, sink)  # type: ignore[arg-type]  # write and flush are all it uses

    return save


def yield_cores() -> None:
    """This thread (a memory snapshot's background work, where it shares the cores with
    training) at the lowest CPU priority: the scheduler gives it what training leaves
    idle (waits in collectives) before an equal share. A durable persist is never
    lowered: a preemption notice waits on it."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
