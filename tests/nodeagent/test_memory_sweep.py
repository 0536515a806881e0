"""The agent drops memory-tier snapshots of jobs that no longer run on its node, and only
those: a live job's, another node's, and a recent one's stay."""

from __future__ import annotations

import os
from pathlib import Path

from nodeagent.memory_sweep import stale_stores, sweep
from proto.job import memory_store_name
from proto.node import RANK_MEMORY_S

NOW = 1_000_000.0


def store(shm: Path, job: str, node: str, age_s: float) -> Path:
    root = shm / memory_store_name(job) / node
    step = root / "step-00000040"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    for path in (step, root):
        os.utime(path, (NOW - age_s, NOW - age_s))
    return root


def test_only_old_stores_of_jobs_without_a_rank_here_are_dropped(tmp_path: Path) -> None:
    failed = store(tmp_path, "failed-job", "node-1", RANK_MEMORY_S + 60)
    running = store(tmp_path, "running-job", "node-1", RANK_MEMORY_S + 60)
    recent = store(tmp_path, "just-ended", "node-1", 30)
    other = store(tmp_path, "failed-job", "node-2", RANK_MEMORY_S + 60)

    stale = stale_stores(tmp_path, "node-1", ["running-job"], NOW)
    assert [s.store for s in stale] == [failed]
    assert stale[0].idle_s > RANK_MEMORY_S

    dropped = sweep(tmp_path, "node-1", ["running-job"], NOW)
    assert [s.store for s in dropped] == [failed]
    assert not failed.exists() and running.is_dir() and recent.is_dir() and other.is_dir()
    assert failed.parent.is_dir()  # node-2's store of the job is still in it


def test_the_last_store_of_a_job_takes_its_dir_and_a_second_sweep_finds_nothing(
    tmp_path: Path,
) -> None:
    gone = store(tmp_path, "failed-job", "node-1", RANK_MEMORY_S + 1)
    (tmp_path / "unrelated").mkdir()  # not the tier's: never touched
    assert sweep(tmp_path, "node-1", [], NOW)
    assert not gone.parent.exists() and (tmp_path / "unrelated").is_dir()
    assert sweep(tmp_path, "node-1", [], NOW) == []


def test_a_store_written_to_lately_is_not_stale_even_if_its_dir_is_old(tmp_path: Path) -> None:
    root = store(tmp_path, "job", "node-1", RANK_MEMORY_S + 60)
    fresh = root / "step-00000048"
    fresh.mkdir()
    os.utime(fresh, (NOW - 5, NOW - 5))
    os.utime(root, (NOW - RANK_MEMORY_S - 60, NOW - RANK_MEMORY_S - 60))
    assert stale_stores(tmp_path, "node-1", [], NOW) == []
