"""An accelerate training loop as accelerate's documentation writes one — ``prepare``,
``accelerator.backward``, ``save_state`` every ``--save-steps``, resuming with
``load_state`` from its own newest checkpoint and ``skip_first_batches`` into the epoch,
accelerate's trigger to stop every process when the loss diverges — on a small model with
random tokens on CPU, plus the lines marked ``# ringmaster``. Without them it is the
unmodified script: Ringmaster still runs it (``[job] entry``), but can only start, kill
and restart it.

Each rank is its own process with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), which accelerate reads. Run it under Ringmaster with
``[job] entry = ["accelerate_loop.py", "--out", "acc-out"]``, or alone:
``torchrun --nproc-per-node 2 examples/accelerate_loop.py --out /tmp/acc-out``.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ringmaster.integrations.accelerate import Ringmaster, phase  # ringmaster

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


def random_tokens(samples: int, seed: int) -> TensorDataset:
    tokens = torch.randint(VOCAB, (samples, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def newest_checkpoint(out: str) -> int:
    """The step of the newest ``checkpoint-<step>`` in ``out`` (0: none)."""
    names = os.listdir(out) if os.path.isdir(out) else []
    steps = [int(m.group(1)) for n in names if (m := re.fullmatch(r"checkpoint-(\d+)", n))]
    return max(steps, default=0)


def batches(
    accelerator: Accelerator, loader: DataLoader, start: int, end: int
) -> Iterator[list[torch.Tensor]]:
    """The batches of steps ``start + 1`` to ``end``, epoch after epoch; the epoch resumed
    in skips those trained before (the seeded sampler orders an epoch the same each time)."""
    epoch, skip = divmod(start, len(loader))
    step = start
    while step < end:
        loader.set_epoch(epoch)
        for batch in accelerator.skip_first_batches(loader, skip) if skip else loader:
            yield batch
            step += 1
            if step == end:
                return
        epoch, skip = epoch + 1, 0


@phase("eval")  # ringmaster
def evaluate(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for inputs, targets in loader:
            loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            losses.append(accelerator.gather_for_metrics(loss.reshape(1)))
    model.train()
    return torch.cat(losses).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="acc-out")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-steps", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, default=0)
    args = parser.parse_args()
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    ringmaster = Ringmaster(accelerator, args.out)  # ringmaster
    set_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    train = DataLoader(random_tokens(4096, 0), batch_size=BATCH, shuffle=True)
    held_out = DataLoader(random_tokens(64, 1), batch_size=BATCH)
    model, optimizer, train, held_out, scheduler = accelerator.prepare(
        model, optimizer, train, held_out, scheduler
    )
    step = newest_checkpoint(args.out)
    if step:
        accelerator.load_state(os.path.join(args.out, f"checkpoint-{step}"))
        accelerator.print(f"resumed from checkpoint-{step}")
    step = ringmaster.restore(step)  # ringmaster
    model.train()
    for inputs, targets in batches(accelerator, train, step, args.steps):
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        if step % args.save_steps == 0:
            accelerator.save_state(os.path.join(args.out, f"checkpoint-{step}"))
        if not torch.isfinite(loss):  # diverged: every process leaves at the check
            accelerator.set_trigger()
        ringmaster.step(step, loss, target=args.steps)  # ringmaster
        if accelerator.check_trigger():
            break
        if args.eval_steps and step % args.eval_steps == 0:
            accelerator.print(
                f"step {step}: eval loss {evaluate(accelerator, model, held_out):.3f}"
            )
    ringmaster.finish()  # ringmaster
    # the DDP model's last reference goes before its process group: with gloo, freeing it
    # after end_training() can hang the process at exit (pytorch/pytorch#56297)
    model, optimizer, scheduler = accelerator.free_memory(model, optimizer, scheduler)
    accelerator.end_training()


if __name__ == "__main__":
    main()
