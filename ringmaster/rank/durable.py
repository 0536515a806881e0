"""The durable checkpoint layout, and the rules that make a checkpoint trustworthy.

::

    <checkpoint.dir>/
        step-<N>/...           each rank's files (``rank-<r>.pt``, ``trainer-rank-<r>.pt``,
                               an engine's own layout), fsynced
        step-<N>/manifest.json sha256 and size of every file, which rank wrote it; last
        latest                 the name of the newest complete step dir, replaced atomically

A step dir counts only once its manifest exists and every file matches it, so a crash at
any moment leaves at worst an incomplete dir that resume skips. Plain filesystem code with
no torch. The manifest and the read side (which step dir is newest) live in
:mod:`ringmaster.checkpoints`, so ``coordinatorctl`` can read checkpoints without importing
the trainer; they are re-exported here under their old names.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO, Protocol

import msgspec

# LATEST, MANIFEST and candidates are re-exported for this module's callers.
from ringmaster.checkpoints import LATEST as LATEST
from ringmaster.checkpoints import MANIFEST as MANIFEST
from ringmaster.checkpoints import (
    FileEntry,
    Manifest,
    parse_step,
    read_latest,
    read_manifest,
    step_dir_name,
    step_dirs,
)
from ringmaster.checkpoints import candidates as candidates

_CHUNK = 8 << 20


def shard_name(rank: int) -> str:
    return f"rank-{rank}.pt"


def trainer_file(rank: int) -> str:
    return f"trainer-rank-{rank}.pt"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a fsynced temporary and a rename, then fsync the dir."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)


def copy_and_hash(src: Path, dst: Path) -> FileEntry:
    """Copy ``src`` to ``dst`` (fsynced, via a temporary name), hashing while copying."""
    digest = hashlib.sha256()
    size = 0
    tmp = dst.with_name(dst.name + ".tmp")
    with src.open("rb") as fin, tmp.open("wb") as fout:
        while chunk := fin.read(_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    tmp.replace(dst)
    return FileEntry(sha256=digest.hexdigest(), size=size)


class Sink(Protocol):
    """What a writer passed to :func:`write_and_hash` may call (``torch.save`` needs no
    more)."""

    def write(self, data: bytes | memoryview, /) -> int: ...

    def flush(self) -> None: ...


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()


def write_and_hash(dst: Path, write: Callable[[Sink], object]) -> FileEntry:
    """Create ``dst`` with what ``write`` writes into the file object it is given (fsynced,
    via a temporary name), hashing while writing; the parent dir is created if needed."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    with tmp.open("wb") as fout:
        hashing = _HashingWriter(fout)
        write(hashing)
        fout.flush()
        os.fsync(fout.fileno())
    tmp.replace(dst)
    return FileEntry(sha256=hashing.digest.hexdigest(), size=hashing.size)


def fsync_parents(root: Path, names: Iterable[str]) -> None:
    """Fsync the directories under ``root`` holding the files ``names`` (relative paths)."""
    for parent in {(root / name).parent for name in names}:
        fsync_dir(parent)


def copy_tree(src: Path, dst: Path) -> dict[str, FileEntry]:
    """Copy every file under ``src`` into ``dst`` (merging with what other ranks put
    there), fsyncing files and directories; returns the entries by relative path."""
    entries = {}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src)
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        entries[rel.as_posix()] = copy_and_hash(path, dst / rel)
    fsync_parents(dst, entries)
    return entries


def hash_file(path: Path) -> FileEntry:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(sha256=digest.hexdigest(), size=size)


def commit(
    root: Path,
    step: int,
    world_size: int,
    engine: str,
    files: dict[str, FileEntry],
    ranks: dict[str, list[str]],
    job: str = "",
) -> Path:
    """Seal ``step-<step>``: write its manifest (naming ``job``, the job that wrote it),
    then point ``latest`` at it."""
    step_dir = root / step_dir_name(step)
    fsync_dir(step_dir)
    manifest = Manifest(
        step=step,
        world_size=world_size,
        engine=engine,
        created=time.time(),
        files=files,
        ranks=ranks,
        job=job,
    )
    _write_atomic(step_dir / MANIFEST, msgspec.json.encode(manifest))
    _write_atomic(root / LATEST, step_dir.name.encode())
    return step_dir


def verify(step_dir: Path, manifest: Manifest, name: str) -> bool:
    """Whether file ``name`` is listed in ``manifest`` and matches its size and sha256."""
    expected = manifest.files.get(name)
    path = step_dir / name
    try:
        if expected is None or path.stat().st_size != expected.size:
            return False
        return hash_file(path) == expected
    except OSError:
        return False


def prune(root: Path, keep: int) -> list[str]:
    """Delete step dirs older than the ``keep`` newest complete ones; returns their names."""
    latest = read_latest(root)
    latest_step = parse_step(latest) if latest else None
    if latest_step is None:
        return []
    complete = [
        step
        for step, name in step_dirs(root)
        if step <= latest_step and read_manifest(root / name) is not None
    ]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1]
    removed = [name for step, name in step_dirs(root) if step < oldest_kept]
    for name in removed:
        with contextlib.suppress(OSError):
            shutil.rmtree(root / name)
    return removed
