"""A simulated node losing its RAM (``inject NODE lose-node``) drops that node's memory
stores of its own cluster's jobs only: another cluster on the same host (a parallel test
worker, a second local cluster) may have a node of the same name whose job is training."""

from __future__ import annotations

from pathlib import Path

from ringmaster.memory_store import memory_store_name, remove_node


def test_a_lost_node_drops_only_its_own_jobs_stores(tmp_path: Path) -> None:
    ours, theirs = ("job-a", "node-1"), ("job-b", "node-1")
    for job, node in (ours, theirs, ("job-a", "node-0")):
        (tmp_path / memory_store_name(job) / node / "step-00000010").mkdir(parents=True)
    gone = remove_node(tmp_path, "node-1", ["job-a", "job-never-here"])
    assert gone == [tmp_path / memory_store_name("job-a") / "node-1"]
    assert not gone[0].exists()
    assert (tmp_path / memory_store_name("job-a") / "node-0").is_dir()  # another node's
    assert (tmp_path / memory_store_name("job-b") / "node-1").is_dir()  # another cluster's
