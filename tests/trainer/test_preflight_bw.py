"""The preflight bandwidth measurement (trainer/preflight_bw.py) with real gloo ranks on
localhost standing in for nodes: a node slowed by the simulation knob is found with its
figure; its healthy peers are not."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from proto.progress import BandwidthChecked
from ringmaster.rank.log import Log
from tests.trainer.conftest import free_port
from trainer import preflight_bw


def _rank(rank: int, world: int, local: int, port: int, env: dict[str, str], out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        node_env = {**env, "RINGMASTER_NODE": f"node-{rank // local}"}
        with open(f"{out}.rank{rank}.log", "w") as log, contextlib.redirect_stderr(log):
            found = preflight_bw.check(
                rank, world, local, torch.device("cpu"), None, node_env, 0.5, Log(rank)
            )
        if rank == 0:
            assert found is not None
            Path(out).write_bytes(msgspec.json.encode(found))
        else:
            assert found is None
    finally:
        dist.destroy_process_group()


def _measure(tmp_path: Path, world: int, local: int, env: dict[str, str]) -> BandwidthChecked:
    out = tmp_path / "checked.json"
    mp.spawn(_rank, args=(world, local, free_port(), env, str(out)), nprocs=world)
    return msgspec.json.decode(out.read_bytes(), type=BandwidthChecked)


def test_the_slowed_node_is_found_with_its_figure(tmp_path: Path) -> None:
    env = {"RINGMASTER_SIMULATED": "1", "RINGMASTER_SIM_SLOW_NODE": "node-1:0.2"}
    found = _measure(tmp_path, world=3, local=1, env=env)
    assert list(found.node_gbps) == ["node-0", "node-1", "node-2"]
    assert found.slow == ["node-1"]
    # 16 MiB in at least 0.2 s: under 0.084 GB/s; loopback moves it far faster
    assert found.node_gbps["node-1"] < 0.084 < found.node_gbps["node-0"]
    assert found.median_gbps == sorted(found.node_gbps.values())[1]
    assert 0 < found.seconds < 10


def test_a_node_slow_only_once_is_measured_again_and_kept(tmp_path: Path) -> None:
    """node-1 slowed in the first measurement only (a passing burst of contention): its
    links are measured again, its better figure counts, and no node is singled out."""
    env = {"RINGMASTER_SIMULATED": "1", "RINGMASTER_SIM_SLOW_NODE": "node-1:0.2:1"}
    found = _measure(tmp_path, world=3, local=1, env=env)
    assert found.slow == [], found
    assert found.node_gbps["node-1"] > 0.084  # the second figure, not the slowed one
    said = (tmp_path / "checked.json.rank0.log").read_text()
    assert "measured_again=node-1" in said, said


def test_two_nodes_of_two_ranks_share_one_link_and_neither_is_singled_out(
    tmp_path: Path,
) -> None:
    found = _measure(tmp_path, world=4, local=2, env={"GROUP_WORLD_SIZE": "2"})
    assert list(found.node_gbps) == ["node-0", "node-1"]
    assert found.node_gbps["node-0"] == found.node_gbps["node-1"] > 0
    assert found.slow == []


def test_the_knob_is_ignored_off_a_simulated_node() -> None:
    knob = {"RINGMASTER_SIM_SLOW_NODE": "node-1:0.2"}
    assert preflight_bw.sim_delay(knob, "node-1") == 0.0
    assert preflight_bw.sim_delay({**knob, "RINGMASTER_SIMULATED": "1"}, "node-1") == 0.2
    assert preflight_bw.sim_delay({**knob, "RINGMASTER_SIMULATED": "1"}, "node-0") == 0.0
    once = {"RINGMASTER_SIM_SLOW_NODE": "node-1:0.2:1", "RINGMASTER_SIMULATED": "1"}
    assert preflight_bw.sim_delay(once, "node-1", 0) == 0.2
    assert preflight_bw.sim_delay(once, "node-1", 1) == 0.0


@pytest.mark.parametrize(
    ("nodes", "links"), [(1, []), (2, [(0, 1)]), (3, [(0, 1), (1, 2), (2, 0)])]
)
def test_the_ring_of_links(nodes: int, links: list[tuple[int, int]]) -> None:
    assert preflight_bw.ring(nodes) == links


def test_busbw_follows_nccl_tests() -> None:
    assert preflight_bw.bus_gbps(10**9, 1.0) == 1.0  # 2 ranks: busbw = algbw
    assert preflight_bw.bus_gbps(10**9, 1.0, ranks=8) == pytest.approx(1.75)
    assert preflight_bw.node_count({}, 8, 4) == 2
