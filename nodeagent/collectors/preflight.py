"""Host preflight: the settings a training job silently depends on, checked at start and
on demand (``nodeagent --preflight``), then every ``interval_s``.

* ``net.core.somaxconn``: torch.distributed's TCP store on the master node takes one
  connection per rank at once; the kernel's default backlog (4096) drops SYNs on large
  worlds and the rendezvous times out. A tunable (:mod:`.sysctl`) is a warning, raised by
  the agent itself where it may.
* free space on the data and checkpoint mounts against what the job needs: a checkpoint
  that cannot be written is found out at the worst time.
* ``/dev/shm``'s size: checkpoints are staged there and DeepSpeed and NCCL keep buffers
  there; containers default to 64 MB.

Space and shared memory are required: a measured shortfall refuses the node (so does a
mount that cannot be measured at all). A directory that does not exist yet is measured on
the mount that would hold it. Each check is the contract's :class:`PreflightCheck`, as the
``node.preflight`` event carries it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeagent.collectors import sysctl
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
    ok: bool  # no required check failed: the node is fit, warnings or not
    checks: list[PreflightCheck]


class PreflightCollector:
    name = "preflight"

    def __init__(
        self,
        roots: Roots,
        *,
        needs: list[SpaceNeed],
        interval_s: float,
        tunables: Sequence[sysctl.Tunable],
        shm_min_gb: float,
        fix: bool = False,
    ) -> None:
        self.interval_s = interval_s
        self._roots = roots
        self._needs = needs
        self._tunables = tunables
        self._shm_min_gb = shm_min_gb
        self._fix = fix  # raise tunables on the first reading (see :mod:`.sysctl`)

    def collect(self, now: float) -> PreflightSample:
        checks = [sysctl.check(t, self._roots.procfs, fix=self._fix) for t in self._tunables]
        self._fix = False
        checks += [self._space(need) for need in self._needs]
        checks.append(self._shm())
        ok = all(c.ok for c in checks if c.required)
        return PreflightSample(time=now, ok=ok, checks=checks)

    def _space(self, need: SpaceNeed) -> PreflightCheck:
        name, want = f"{need.name}_space", f">= {need.need_gb:g} GB free at {need.path}"
        try:
            stat = os.statvfs(existing(need.path))
        except OSError as exc:
            return _check(name, False, f"unreadable: {sysctl.why(exc)}", want)
        free = stat.f_bavail * stat.f_frsize / GB
        return _check(name, free >= need.need_gb, f"{free:.1f} GB free", want)

    def _shm(self) -> PreflightCheck:
        path = self._roots.dev / "shm"
        want = f">= {self._shm_min_gb:g} GB"
        try:
            stat = os.statvfs(path)
        except OSError as exc:
            return _check("shm_size", False, f"unreadable: {sysctl.why(exc)}", want)
        size = stat.f_blocks * stat.f_frsize / GB
        return _check("shm_size", size >= self._shm_min_gb, f"{size:.1f} GB", want)


def _check(name: str, ok: bool, value: str, want: str) -> PreflightCheck:
    return PreflightCheck(name=name, ok=ok, value=value, want=want)
