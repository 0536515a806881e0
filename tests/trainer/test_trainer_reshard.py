"""A job's checkpoint loads at another world size: a data-parallel job that lost a node
continues on fewer ranks, and grows back. Real gloo ranks train and write the checkpoints;
a probe rank (``reshard_probe.py``) loads one through the engine and saves what it holds
right after loading, to compare with what was saved."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from dcp_files import read_dcp

from proto.job import JobSpec
from trainer import durable, zero_reshard

MakeSpec = Callable[..., JobSpec]
REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("reshard_probe.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def probe(spec: JobSpec, step_dir: Path, world_size: int, out: Path) -> list[dict[str, Any]]:
    """What each of ``world_size`` fresh ranks holds right after loading ``step_dir``."""
    out.mkdir()
    spec_path = out / "spec.json"
    spec_path.write_bytes(msgspec.json.encode(spec))
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
        }
        args = [sys.executable, str(PROBE), str(spec_path), str(step_dir), str(out)]
        log = (out / f"rank-{rank}.log").open("wb")
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=log, cwd=out))
    try:
        codes = [p.wait(90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * world_size, (out / "rank-0.log").read_text()[-3000:]
    return [torch.load(out / f"probe-rank-{r}.pt", weights_only=False) for r in range(world_size)]


def losses(workdir: Path) -> list[float]:
    lines = (workdir / "trace-rank-0.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def saved_zero(step_dir: Path) -> dict[str, Any]:
    """A DeepSpeed ZeRO-1/2 step dir as whole tensors: the module's parameters, and the
    fp32 master weights and Adam moments of the (single) group laid end to end."""
    ds = step_dir / "ds"
    module = torch.load(ds / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    files = zero_reshard.zero_files(
        [p.name for p in ds.iterdir()], len(list(ds.glob("*optim_states.pt")))
    )
    assert files is not None
    states = zero_reshard.read_states([ds / name for name in files])
    paddings = [s[zero_reshard.GROUP_PADDINGS][0] for s in states]
    adam = [s[zero_reshard.BASE_OPTIMIZER_STATE]["state"][0] for s in states]
    return {
        "params": module,
        "fp32": torch.cat([s[zero_reshard.FP32_SLICES][0] for s in states]),
        "step": adam[0]["step"],
        **{
            key: torch.cat(
                [zero_reshard.unpadded(a[key], p) for a, p in zip(adam, paddings, strict=True)]
            )
            for key in ("exp_avg", "exp_avg_sq")
        },
    }


def check_zero_load(saved: dict[str, Any], held: list[dict[str, Any]]) -> None:
    """Every new rank holds the saved parameters, and its slices laid end to end are the
    saved master weights and moments (then zeros: the new padding)."""
    for rank in held:
        assert rank["params"].keys() == saved["params"].keys()
        for name, value in saved["params"].items():
            assert torch.equal(rank["params"][name], value), name
        assert torch.equal(rank["adam"]["step"], saved["step"])
    whole = saved["fp32"].numel()
    for key, slices in [
        ("fp32", [r["fp32"] for r in held]),
        *[(k, [r["adam"][k] for r in held]) for k in ("exp_avg", "exp_avg_sq")],
    ]:
        joined = torch.cat([s.detach().reshape(-1) for s in slices])
        assert torch.equal(joined[:whole], saved[key]), key
        assert not joined[whole:].any(), key
    assert saved["exp_avg"].abs().sum() > 0  # trained: not the zeros of a fresh optimizer


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "precision"), [(1, "fp32"), (2, "bf16")])
def test_zero_checkpoint_shrinks_to_one_rank_and_grows_back(
    tmp_path: Path, launch: Any, make_spec: MakeSpec, stage: int, precision: str
) -> None:
    ds = {"engine": "deepspeed", "zero_stage": stage, "precision": precision}
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {"RINGMASTER_TEST_TRACE": str(trace)}
    ckpt = {"every_steps": 4, "dir": "ckpt"}

    def spec(steps: int) -> JobSpec:
        return make_spec(train={**ds, "steps": steps}, checkpoint=ckpt)

    two = launch(spec(8), env=env)
    assert two.wait() == [0, 0], two.log(0)
    first = losses(trace)
    # one rank loads the two ranks' checkpoint: parameters, master weights, Adam state
    saved = saved_zero(tmp_path / "ckpt" / "step-8")
    check_zero_load(saved, probe(spec(12), tmp_path / "ckpt" / "step-8", 1, tmp_path / "p1"))
    # and trains on from step 8, the loss falling on from where it was
    one = launch(spec(12), world_size=1, env=env)
    assert one.wait() == [0], one.log(0)
    assert one.events(0, "resumed_from")[0]["step"] == "8"
    after = losses(trace)[len(first) :]
    assert len(after) == 4, after
    assert sum(after) / 4 < sum(first[:4]) / 4 - 0.1, (first, after)  # not from scratch
    step_12 = durable.read_manifest(tmp_path / "ckpt" / "step-12")
    assert step_12 is not None and step_12.world_size == 1
    # two ranks load the one rank's checkpoint, and train on
    saved = saved_zero(tmp_path / "ckpt" / "step-12")
    check_zero_load(saved, probe(spec(14), tmp_path / "ckpt" / "step-12", 2, tmp_path / "p2"))
    again = launch(spec(14), env=env)
    assert again.wait() == [0, 0], again.log(0)
    assert again.events(1, "resumed_from")[0]["step"] == "12"
    assert durable.read_latest(tmp_path / "ckpt") == "step-14"


@pytest.mark.slow
def test_ddp_checkpoint_of_one_rank_loads_on_two(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    def spec(steps: int) -> JobSpec:
        return make_spec(train={"steps": steps}, checkpoint={"dir": "ckpt"})

    alone = launch(spec(4), world_size=1)
    assert alone.wait() == [0], alone.log(0)
    step_dir = tmp_path / "ckpt" / "step-4"
    saved = read_dcp(step_dir, tmp_path)
    for rank in probe(spec(6), step_dir, 2, tmp_path / "probe"):
        for name, value in saved["model"].items():
            assert torch.equal(rank["params"][name], value), name
        state = rank["optimizer"]["state"]
        assert state.keys() == saved["optimizer"]["state"].keys() and state
        for name, moments in saved["optimizer"]["state"].items():
            assert moments["exp_avg"].abs().sum() > 0, name
            for key, value in moments.items():
                assert torch.equal(state[name][key], value), (name, key)
    both = launch(spec(6))
    assert both.wait() == [0, 0], both.log(0)
    assert both.events(1, "resumed_from")[0]["step"] == "4"


@pytest.mark.slow
def test_checkpoints_no_engine_here_can_load_are_refused_in_one_line(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    zero3 = {"engine": "deepspeed", "zero_stage": 3, "steps": 2}
    assert launch(make_spec(train=zero3)).wait() == [0, 0]
    for train, world_size, why in [
        (zero3, 1, "only at the world size that wrote them (2)"),
        ({"steps": 2}, 2, "another engine's (resume with deepspeed-zero3)"),
    ]:
        ranks = launch(make_spec(train=train), world_size=world_size)
        assert ranks.wait() == [1] * world_size
        log = ranks.log(0)
        refusal = [line for line in log.splitlines() if line.startswith("trainer: ")]
        assert len(refusal) == 1 and "Traceback" not in log, log
        assert "(newest step-2: deepspeed-zero3, world size 2)" in refusal[0]
        assert f"world size {world_size}) cannot load: " in refusal[0]
        assert why in refusal[0]
    assert durable.read_latest(tmp_path / "ckpt") == "step-2"


def test_zero_files_want_one_per_saved_rank_and_slices_pad_with_zeros() -> None:
    names = [f"ds/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (1, 0)]
    assert zero_reshard.zero_files([*names, "ds/mp_rank_00_model_states.pt"], 2) == names[::-1]
    assert zero_reshard.zero_files(names[:1], 2) is None  # rank 0's partition missing
    # slices of 3 ranks (the last padded by 2) re-cut for 2 ranks of 5 elements each
    saved = [
        torch.tensor([1.0, 2.0, 3.0]),
        torch.tensor([4.0, 5.0, 6.0]),
        torch.tensor([7.0, 0, 0]),
    ]
    whole = [zero_reshard.unpadded(t, p) for t, p in zip(saved, (0, 0, 2), strict=True)]
    assert zero_reshard.take(whole, 0, 5).tolist() == [1, 2, 3, 4, 5]
    assert zero_reshard.take(whole, 5, 5).tolist() == [6, 7, 0, 0, 0]
