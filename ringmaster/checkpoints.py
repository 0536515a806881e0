"""Reading a durable checkpoint dir without torch: its manifests, and which step is newest.

::

    <checkpoint.dir>/
        step-<N>/...           each rank's files
        step-<N>/manifest.json sha256 and size of every file, which rank and job wrote it
        latest                 the name of the newest complete step dir

The trainer writes this layout (:mod:`ringmaster.rank.durable`); the operator's CLI reads it before
submitting a job, to say where training will resume from and to refuse a start that a
finished checkpoint would end at once. Both need the same manifest type and the same rule
for "newest", so they live here, in the shared runtime that neither side's boundary forbids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

LATEST = "latest"
MANIFEST = "manifest.json"


class FileEntry(msgspec.Struct, frozen=True):
    sha256: str
    size: int


class Manifest(msgspec.Struct, kw_only=True):
    step: int
    world_size: int
    engine: str
    created: float
    files: dict[str, FileEntry]  # path relative to the step dir -> checksum
    ranks: dict[str, list[str]] = {}  # rank -> the files it wrote
    job: str = ""  # the id of the job that wrote it ("": written before ids were recorded)


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def parse_step(name: str) -> int | None:
    prefix, _, number = name.partition("-")
    return int(number) if prefix == "step" and number.isdigit() else None


def read_manifest(step_dir: Path) -> Manifest | None:
    try:
        return msgspec.json.decode((step_dir / MANIFEST).read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError):
        return None


def read_latest(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if parse_step(name) is not None else None


def step_dirs(root: Path) -> list[tuple[int, str]]:
    """(step, name) of every step dir under ``root``, newest first."""
    try:
        names = [p.name for p in root.iterdir() if p.is_dir()]
    except OSError:
        return []
    found = [(step, name) for name in names if (step := parse_step(name)) is not None]
    return sorted(found, reverse=True)


def candidates(root: Path) -> list[str]:
    """Step dirs to try on resume, in order: the one ``latest`` names, then older ones.

    Dirs newer than ``latest`` are ignored: ``latest`` only moves after a manifest is
    written, so anything newer is a persist that never finished. Without a readable
    ``latest`` every dir is a candidate, newest first (each is still verified).
    """
    latest = read_latest(root)
    dirs = step_dirs(root)
    if latest is None:
        return [name for _, name in dirs]
    latest_step = parse_step(latest)
    assert latest_step is not None
    return [latest] + [name for step, name in dirs if step < latest_step]


@dataclass(frozen=True)
class Sealed:
    """A step dir whose manifest was written: what a resume would start from."""

    path: Path
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def job(self) -> str:
        return self.manifest.job


def newest_sealed(root: Path) -> Sealed | None:
    """The newest step dir under ``root`` with a manifest for that step, in resume order.

    Files are not hashed (that reads every byte of a checkpoint): a resume still verifies
    them and falls back to an older step if one does not match, so this is where a resume
    starts unless the checkpoint was damaged after it was sealed.
    """
    for name in candidates(root):
        manifest = read_manifest(root / name)
        if manifest is not None and manifest.step == parse_step(name):
            return Sealed(root / name, manifest)
    return None
