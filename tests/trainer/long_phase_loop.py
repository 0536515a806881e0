"""A user loop with an evaluation after each step in ``argv[1]`` (comma-separated) that
lasts until the file ``eval-STEP`` appears in ``argv[2]``: what a notice or a checkpoint
request during a long phase gets (``tests/trainer/test_rank_api.py``). ``--loop-saves``:
as a loop whose framework writes the durable checkpoints (it writes none here)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ringmaster import rank
from ringmaster.procs import wait_until


def main() -> None:
    phases = {int(step) for step in sys.argv[1].split(",")}
    release = Path(sys.argv[2])
    rank.init(loop_saves="--loop-saves" in sys.argv)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rank.register(model, optimizer)
    start = rank.restore()
    for step in range(start + 1, 100_000):
        loss = model(torch.randn(4, 8)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank.step(step, loss=loss.item()).stop:
            break
        if step in phases:
            with rank.phase("eval"):
                wait_until((release / f"eval-{step}").exists, None)  # the test's word
    rank.finish()
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
