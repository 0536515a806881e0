"""A PyTorch Lightning script as its documentation writes it — a small ``LightningModule``
(a tiny language model on random tokens), a ``ModelCheckpoint`` every ``--save-steps``
keeping ``last.ckpt``, ``trainer.fit(..., ckpt_path="last")`` resuming from it — plus the two
lines marked ``# ringmaster``. Without them it is the unmodified script: Ringmaster still
runs it (``[job] entry``), but can only start, kill and restart it.

Each rank is its own process with torchrun's environment (Ringmaster's launch, or
``torchrun --nproc-per-node 2 examples/lightning_module.py --out /tmp/pl-out``); the
``Trainer``'s devices and nodes are read from it. Alone it runs as one process on the CPU.
"""

from __future__ import annotations

import argparse
import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ringmaster.integrations.lightning import RingmasterCallback  # ringmaster


class RandomTokens(Dataset[torch.Tensor]):
    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(vocab, (samples, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class TinyLanguageModel(pl.LightningModule):
    def __init__(self, vocab: int = 256, dim: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return self.head(hidden + self.mlp(hidden))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="pl-out")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-steps", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, default=0)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    model = TinyLanguageModel()
    train = DataLoader(RandomTokens(4096, 33, 256), batch_size=8, shuffle=True)
    val = DataLoader(RandomTokens(32, 33, 256), batch_size=8) if args.eval_steps else None
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=local_world_size,
        num_nodes=world_size // local_world_size,
        max_steps=args.steps,
        default_root_dir=args.out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=args.eval_steps or None,
        check_val_every_n_epoch=None if args.eval_steps else 1,
        callbacks=[
            ModelCheckpoint(
                dirpath=os.path.join(args.out, "checkpoints"),
                every_n_train_steps=args.save_steps,
                save_last=True,
            ),
            RingmasterCallback(),  # ringmaster
        ],
    )
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path="last")


if __name__ == "__main__":
    main()
