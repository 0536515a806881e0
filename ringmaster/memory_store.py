"""One node's memory tier of a job: recent checkpoints in RAM, in the durable layout.

::

    /dev/shm/ringmaster-mem-<job>/<node>/
        step-<N>/...            the files of this node's ranks, and of the ranks whose
                                buddy is on this node (a copy)
        step-<N>/manifest.json  every rank's files with sha256 and size, written once every
                                rank's files of step N are on two nodes
        restore-rank-<r>/       a resume in progress: rank r's step assembled from here
                                and from peers

tmpfs outlives a rank's process, not the node: a rank restarted on this node finds its
own shard here, and a rank on a node that lost its RAM (or one that replaces a lost node)
gets its shard from the buddy's copy. The ``<node>`` level keeps the stores of simulated
nodes sharing one host apart. A step counts only once its manifest exists, as in the
durable dir; the store keeps the newest sealed step and the one being written, so a rank
holds at most two snapshots (its own and its buddy's) besides the one in flight.

Plain filesystem code with no torch: the ring and the transfers are
:mod:`ringmaster.rank.memory_tier`'s; the node agent and the local cluster's fault injection
read the layout too, so it lives in the shared runtime.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import msgspec

from proto.job import memory_store_name, safe_name, shm_staging_name
from ringmaster.checkpoints import MANIFEST, Manifest, parse_step, read_manifest, step_dir_name

SHM = Path("/dev/shm")


def node_store(job_id: str, node: str, shm: Path = SHM) -> Path | None:
    """This node's store for ``job_id``; None when ``shm`` is not a writable tmpfs dir."""
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return None
    return shm / memory_store_name(job_id) / safe_name(node)


class MemoryStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def restore_dir(self, rank: int) -> Path:
        return self.root / f"restore-rank-{rank}"

    def sealed(self) -> dict[int, tuple[Manifest, list[str]]]:
        """Each sealed step: its manifest and the files of it present here."""
        found: dict[int, tuple[Manifest, list[str]]] = {}
        with contextlib.suppress(OSError):
            for path in self.root.iterdir():
                step = parse_step(path.name)
                manifest = read_manifest(path) if step is not None else None
                if step is None or manifest is None or manifest.step != step:
                    continue
                present = [name for name in manifest.files if (path / name).is_file()]
                found[step] = (manifest, sorted(present))
        return found

    def seal(self, step: int, manifest: Manifest) -> None:
        """Write step ``step``'s manifest (every rank of a node writes the same one, via a
        temporary of its own), then drop the older steps."""
        step_dir = self.step_dir(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        tmp = step_dir / f"{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_bytes(msgspec.json.encode(manifest))
        tmp.replace(step_dir / MANIFEST)
        self.drop_older(step)

    def drop_older(self, step: int) -> None:
        with contextlib.suppress(OSError):
            for path in self.root.iterdir():
                older = parse_step(path.name)
                if older is not None and older < step:
                    shutil.rmtree(path, ignore_errors=True)

    def clear(self) -> None:
        """Forget every step (after a numeric rewind, or once the job's end is durable),
        and the job's dir once no node's store is left in it."""
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.root.parent.rmdir()

    def link_or_copy(self, step: int, name: str, dst: Path) -> None:
        """Put this store's copy of file ``name`` of ``step`` at ``dst`` (a hard link on
        the same tmpfs: no bytes move)."""
        src = self.step_dir(step) / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)


def remove_job_node(shm: Path, job_id: str, node: str) -> bool:
    """Drop ``node``'s store of ``job_id`` (and the job's dir once empty); whether there
    was one."""
    root = shm / memory_store_name(job_id) / safe_name(node)
    found = root.is_dir()
    MemoryStore(root).clear()
    return found


def remove_node(shm: Path, node: str, jobs: Iterable[str]) -> list[Path]:
    """Drop ``node``'s stores of ``jobs`` (a simulated node losing its RAM: only the jobs
    its own cluster ran there, since another cluster on this host may have a node of the
    same name); the removed dirs."""
    removed = []
    for job in sorted(set(jobs)):
        if remove_job_node(shm, job, node):
            removed.append(shm / memory_store_name(job) / safe_name(node))
    return removed


def remove_job_staging(shm: Path, job_id: str) -> bool:
    """Drop the host's checkpoint staging of ``job_id`` (its ranks' host copies, as big as
    the model's state), which ranks remove as they end but not when they are killed;
    whether there was one."""
    root = shm / shm_staging_name(job_id)
    found = root.is_dir()
    shutil.rmtree(root, ignore_errors=True)
    return found


def remove_job_ram(job_id: str, shm: Path = SHM) -> None:
    """Drop all ``job_id`` holds in this host's RAM: its ranks' checkpoint staging and
    every node's memory store — what ranks run without an agent (a test, a bench) leave
    once killed, where an agent would clean up after them."""
    remove_job_staging(shm, job_id)
    shutil.rmtree(shm / memory_store_name(job_id), ignore_errors=True)
