"""The memory tier's pure parts: the buddy ring, the choice of a step the new world can
assemble, and the cadence."""

from __future__ import annotations

import os

import torch

from ringmaster.checkpoints import FileEntry, Manifest
from ringmaster.rank.memory_tier import (
    COST_BUDGET,
    COST_TARGET,
    Cadence,
    _choose,
    buddy_ranks,
    shares_cores,
)


def manifest(step: int, world: int) -> Manifest:
    ranks = {str(r): [f"own-{r}", f"trainer-{r}"] for r in range(world)}
    files = {n: FileEntry(sha256="x", size=1) for names in ranks.values() for n in names}
    return Manifest(step=step, world_size=world, engine="e", created=0.0, files=files, ranks=ranks)


def needs(m: Manifest, rank: int) -> list[str]:
    return [f"own-{rank}", f"trainer-{rank}", "own-0"]  # rank 0's file too, like ZeRO-1/2


def test_the_ring_copies_to_the_same_local_rank_on_the_next_node() -> None:
    to, source = buddy_ranks(["a", "a", "b", "b", "c", "c"])
    assert to == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert source == {2: 0, 3: 1, 4: 2, 5: 3, 0: 4, 1: 5}
    assert buddy_ranks(["a", "a"]) == ({}, {})  # one node: no copy elsewhere


def test_the_newest_step_the_new_world_can_assemble_is_chosen() -> None:
    old, new = manifest(7, 2), manifest(9, 2)
    # rank 0 (node a) holds its files and rank 1's copy of step 9; rank 1 (a new node) none
    offers = [
        {9: (new, sorted(new.files)), 7: (old, sorted(old.files))},
        {},
    ]
    chosen = _choose(offers, 2, needs)
    assert chosen is not None
    step, _, plan = chosen
    assert step == 9
    assert sorted(plan) == [("own-0", 0, 1), ("own-1", 0, 1), ("trainer-1", 0, 1)]


def test_a_step_missing_a_shard_everywhere_is_passed_over() -> None:
    new, old = manifest(9, 2), manifest(7, 2)
    offers = [
        {9: (new, ["own-0", "trainer-0"]), 7: (old, sorted(old.files))},
        {9: (new, ["trainer-1"])},  # own-1 of step 9 is nowhere
    ]
    chosen = _choose(offers, 2, needs)
    assert chosen is not None and chosen[0] == 7
    assert _choose(offers, 3, needs) is None  # a third rank's own files are nowhere


def test_another_world_size_is_chosen_where_the_engine_reshards_it() -> None:
    """A world grown from 2 to 3: rank 0 reads every file (it converts them), the others
    rank 0's trainer state; an engine that cannot reshard the step says None."""
    old = manifest(9, 2)

    def reshards(m: Manifest, rank: int) -> list[str] | None:
        return sorted(m.files) if rank == 0 else ["trainer-0"]

    offers = [{9: (old, ["own-0", "trainer-0"])}, {9: (old, ["own-1", "trainer-1"])}, {}]
    chosen = _choose(offers, 3, reshards)
    assert chosen is not None
    step, _, plan = chosen
    assert step == 9
    assert sorted(plan) == [
        ("own-1", 1, 0),
        ("trainer-0", 0, 1),
        ("trainer-0", 0, 2),
        ("trainer-1", 1, 0),
    ]
    assert _choose(offers, 3, lambda m, rank: None) is None


def test_the_automatic_cadence_keeps_the_snapshot_under_its_budget() -> None:
    cadence = Cadence(None, cap=50)
    assert cadence.due(1)
    cadence.plan(1, 0.0, 0.0, 0.0)
    assert cadence.next == 2
    # 10 ms blocked per snapshot against 100 ms steps: every 7 steps keeps it at 1.4 %,
    # under the 1.5 % aimed at (every 5 would be the whole 2 % budget)
    assert (COST_TARGET, COST_BUDGET) == (0.015, 0.02)
    assert cadence.plan(2, 0.010, 0.05, 0.100)
    assert (cadence.every, cadence.next) == (7, 9)
    assert not cadence.due(8) and cadence.due(9)
    # background work of 0.8 s must be out of the next snapshot's way
    cadence.plan(9, 0.001, 0.8, 0.100)
    assert cadence.every == 8
    cadence.plan(17, 10.0, 0.0, 0.100)
    assert cadence.every == 50  # never more seldom than the durable interval


def test_background_work_that_shares_the_cores_counts_against_the_budget() -> None:
    # 10 ms blocked and 30 ms of CPU in the background (0.2 s of wall time, at a low
    # priority) against 100 ms steps: 40 ms per snapshot at 1.5 % is every 27 steps where
    # the background work takes the training's cores, every 7 where it has its own
    contended = Cadence(None, cap=50, contended=True)
    contended.plan(1, 0.0, 0.0, 0.0)
    contended.plan(2, 0.010, 0.2, 0.100, cpu_s=0.030)
    assert contended.every == 27
    spare = Cadence(None, cap=50)
    spare.plan(1, 0.0, 0.0, 0.0)
    spare.plan(2, 0.010, 0.2, 0.100, cpu_s=0.030)
    assert spare.every == 7


def test_only_ranks_training_on_every_core_share_them() -> None:
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    assert shares_cores(torch.device("cpu"), cores)  # a rank per core, each with threads
    assert shares_cores(torch.device("cpu"), 1) == (cores - threads < 1)
    assert not shares_cores(torch.device("meta"), cores)  # a device does the training


def test_one_costly_snapshot_does_not_space_out_the_rest() -> None:
    cadence = Cadence(None, cap=100, contended=True)
    cadence.plan(1, 0.0, 0.0, 0.0)
    for step in range(2, 6):
        cadence.plan(step, 0.010, 0.02, 0.100, cpu_s=0.010)
    assert cadence.every == 14  # 20 ms a snapshot at 1.5 % of 100 ms steps
    cadence.plan(6, 0.010, 0.02, 0.100, cpu_s=0.150)  # a collection ran in its thread
    assert 14 < cadence.every < 50  # not the 107 steps that one snapshot alone would say


def test_a_fixed_cadence_is_kept() -> None:
    cadence = Cadence(3, cap=50)
    assert not cadence.plan(4, 10.0, 10.0, 0.1)
    assert cadence.next == 7
