"""A user loop whose evaluation after step ``argv[1]`` outlasts any notice's grace: what a
notice during a long phase gets (``tests/trainer/test_rank_api.py``)."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ringmaster import rank


def main() -> None:
    phase_after = int(sys.argv[1])
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
        if step == phase_after:
            with rank.phase("eval"):
                time.sleep(600)
    rank.finish()
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
