"""Your own torch.distributed training loop with every Ringmaster reaction: the six
``rank.`` lines below (marked ``# ringmaster``) are all it takes. Without an agent (plain
``torchrun``, or alone) they do nothing and the loop runs as it would without them.

Run it under Ringmaster with ``[job] entry = ["rank_api_loop.py", "--steps", "200"]``
(examples/rank_api_loop.toml), or alone: ``torchrun --nproc-per-node 2 rank_api_loop.py``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ringmaster import rank  # ringmaster

VOCAB, WIDTH, SEQ, BATCH = 256, 64, 32, 8


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.blocks(self.embed(tokens), mask=mask, is_causal=True))


class Position:
    """Where this rank is in its data: the batch it trains on next."""

    def __init__(self) -> None:
        self.batch = 0

    def state_dict(self) -> dict[str, Any]:
        return {"batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch = state["batch"]


def batch(index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(index * 1000 + rank)
    )
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    me = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    position = Position()
    rank.register(model, optimizer, scheduler=scheduler, position=position)  # ringmaster
    start = rank.restore()  # ringmaster
    for step in range(start + 1, args.steps + 1):
        inputs, targets = batch(position.batch, me)
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        position.batch += 1
        tokens = BATCH * SEQ * dist.get_world_size()
        if rank.step(step, loss=loss, tokens=tokens, target=args.steps).stop:  # ringmaster
            break
        if args.eval_every and step % args.eval_every == 0:
            with rank.phase("eval"), torch.no_grad():  # ringmaster
                model.eval()
                model(batch(-1, me)[0])
                model.train()
    rank.finish()  # ringmaster
    # the DDP model goes before its process group: gloo's threads would otherwise wait for
    # the interpreter's lock at exit (pytorch/pytorch#56297)
    del model, optimizer, scheduler
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
