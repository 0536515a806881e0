"""DCP ``async_save`` of FSDP2-sharded float8 weights (a known DCP trap) on two real
gloo ranks: unwrapped first, the saved weights are exactly the ones at save time, even
though training changes them before the save completes."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.slow


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from ringmaster.rank.dcp_async import async_save, plain_state

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
        mesh = init_device_mesh("cpu", (2,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step() -> None:
            model(torch.randn(4, 32)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        state = model.state_dict()
        wrapped = type(state["0.weight"].to_local()).__name__
        unwrapped = type(plain_state(state)["0.weight"].to_local()).__name__
        expected = {k: v.full_tensor().clone() for k, v in state.items()}
        future = async_save({"model": state}, f"{out}/ckpt", dist.new_group(backend="gloo"))
        step()  # training goes on while the save completes
        future.result()
        changed = not all(torch.equal(v.full_tensor(), expected[k]) for k, v in state.items())
        fresh = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        dcp.load(fresh, checkpoint_id=f"{out}/ckpt")
        equal = all(torch.equal(v.full_tensor(), expected[k]) for k, v in fresh["model"].items())
        report = {"wrapped": wrapped, "unwrapped": unwrapped, "changed": changed, "equal": equal}
        Path(f"{out}/rank-{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_async_save_of_float8_all_gather_weights_round_trips(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert report == {
            "wrapped": "WeightWithDynamicFloat8CastTensor",  # the case the trap is about
            "unwrapped": "Tensor",
            "changed": True,  # the next step moved the weights during the save
            "equal": True,  # and the checkpoint still holds those of the save's step
        }
