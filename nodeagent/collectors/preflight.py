"""Host preflight: the settings a training job silently depends on, checked at start and
on demand (``nodeagent --preflight``), then every ``interval_s``.

* ``net.core.somaxconn``: torch.distributed's TCP store on the master node takes one
  connection per rank at once; the kernel's default backlog (4096) drops SYNs on large
  worlds and the rendezvous times out.
* free space on the data and checkpoint mounts against what the job needs: a checkpoint
  that cannot be written is found out at the worst time.
* ``/dev/shm``'s size: checkpoints are staged there and DeepSpeed and NCCL keep buffers
  there; containers default to 64 MB.

A directory that does not exist yet is measured on the mount that would hold it. Each
check is the contract's :class:`PreflightCheck`, as the ``node.preflight`` event carries it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from nodeagent.collectors.base import Roots, Sample
from proto.events import PreflightCheck

GB = 1e9


@dataclass(frozen=True)
class SpaceNeed:
    name: str  # "data", "checkpoint"
    path: Path
    need_gb: float


def existing(path: Path) -> Path:
    """``path`` or its nearest existing parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class PreflightSample(Sample, kw_only=True):
    ok: bool  # every check passed
    checks: list[PreflightCheck]


class PreflightCollector:
    name = "preflight"

    def __init__(
        self,
        roots: Roots,
        *,
        needs: list[SpaceNeed],
        interval_s: float,
        somaxconn_min: int,
        shm_min_gb: float,
    ) -> None:
        self.interval_s = interval_s
        self._roots = roots
        self._needs = needs
        self._somaxconn_min = somaxconn_min
        self._shm_min_gb = shm_min_gb

    def collect(self, now: float) -> PreflightSample:
        checks = [self._somaxconn()]
        checks += [self._space(need) for need in self._needs]
        checks.append(self._shm())
        return PreflightSample(time=now, ok=all(c.ok for c in checks), checks=checks)

    def _somaxconn(self) -> PreflightCheck:
        want = f">= {self._somaxconn_min}"
        path = self._roots.procfs / "sys" / "net" / "core" / "somaxconn"
        try:
            value = int(path.read_text().strip())
        except (OSError, ValueError) as exc:
            return _check("somaxconn", False, f"unreadable: {_why(exc)}", want)
        return _check("somaxconn", value >= self._somaxconn_min, str(value), want)

    def _space(self, need: SpaceNeed) -> PreflightCheck:
        name, want = f"{need.name}_space", f">= {need.need_gb:g} GB free at {need.path}"
        try:
            stat = os.statvfs(existing(need.path))
        except OSError as exc:
            return _check(name, False, f"unreadable: {_why(exc)}", want)
        free = stat.f_bavail * stat.f_frsize / GB
        return _check(name, free >= need.need_gb, f"{free:.1f} GB free", want)

    def _shm(self) -> PreflightCheck:
        path = self._roots.dev / "shm"
        want = f">= {self._shm_min_gb:g} GB"
        try:
            stat = os.statvfs(path)
        except OSError as exc:
            return _check("shm_size", False, f"unreadable: {_why(exc)}", want)
        size = stat.f_blocks * stat.f_frsize / GB
        return _check("shm_size", size >= self._shm_min_gb, f"{size:.1f} GB", want)


def _check(name: str, ok: bool, value: str, want: str) -> PreflightCheck:
    return PreflightCheck(name=name, ok=ok, value=value, want=want)


def _why(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return str(exc)
