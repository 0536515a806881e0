"""A plain torch.distributed script that knows nothing of Ringmaster: it reads the
environment torchrun sets and trains a toy model. Ringmaster runs it unchanged with
``[job] entry = ["plain_ddp.py", "--steps", "20"]`` (see examples/plain_ddp.toml)."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # env:// — MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(args.steps):
        x = torch.randn(16, 8)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if args.out:
        env = {
            k: os.environ[k]
            for k in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
            )
        }
        with open(f"{args.out}/rank-{rank}.txt", "w") as out:
            out.write(f"{env} world={world} loss={loss.item():.4f}\n")
    # the DDP model goes before its process group: gloo's threads would otherwise wait for
    # the interpreter's lock at exit (pytorch/pytorch#56297)
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
