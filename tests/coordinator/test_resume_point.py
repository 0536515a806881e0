"""Where ``job.restarted`` says a job resumes: the memory tier while the new world holds a
copy of every shard, else the durable checkpoint."""

from __future__ import annotations

from coordinator.resume_point import expected_resume

OLD = ["n0", "n1", "n2"]


def test_a_kept_world_resumes_from_memory() -> None:
    assert expected_resume(OLD, OLD, True, 97, 50) == ("memory", 97)


def test_one_lost_node_is_covered_by_the_next_in_the_ring() -> None:
    assert expected_resume(OLD, ["n0", "n3", "n2"], True, 97, 50) == ("memory", 97)
    assert expected_resume(OLD, ["n3", "n1", "n2"], True, 97, 50) == ("memory", 97)


def test_two_neighbours_lost_leave_a_shard_without_a_copy() -> None:
    assert expected_resume(OLD, ["n0", "n3", "n4"], True, 97, 50) == ("durable", 50)


def test_another_world_size_or_an_older_snapshot_is_durable() -> None:
    assert expected_resume(OLD, ["n0", "n2"], False, 97, 50) == ("durable", 50)
    assert expected_resume(OLD, OLD, True, 50, 50) == ("durable", 50)
    assert expected_resume(OLD, OLD, True, None, None) == ("durable", 0)


def test_a_lone_node_keeps_its_memory_only_while_it_stays() -> None:
    assert expected_resume(["n0"], ["n0"], True, 9, None) == ("memory", 9)
    assert expected_resume(["n0"], ["n1"], True, 9, None) == ("durable", 0)
