"""Lightning's own Slurm auto-requeue, for bench/slurm_requeue.py to compare with: the
model of examples/lightning_module.py, one process on the CPU, Lightning's
``SLURMEnvironment(auto_requeue=True)`` (on ``USR1`` it saves ``hpc_ckpt_N.ckpt`` and runs
``scontrol requeue``; the requeued run loads it), no Ringmaster. Each step appends
``<unix time> <global step> <SLURM_RESTART_COUNT>`` to ``--steps-log``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.plugins.environments import SLURMEnvironment
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from lightning_module import RandomTokens, TinyLanguageModel


class StepLog(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.run = path, os.environ.get("SLURM_RESTART_COUNT", "0")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        with self.path.open("a") as f:
            f.write(f"{time.time():.3f} {trainer.global_step} {self.run}\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps-log", type=Path, required=True)
    args = p.parse_args()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1_000_000,
        default_root_dir=args.out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        plugins=[SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1)],
        callbacks=[StepLog(args.steps_log)],
    )
    train = DataLoader(RandomTokens(4096, 33, 256), batch_size=8, shuffle=True)
    trainer.fit(TinyLanguageModel(), train_dataloaders=train)


if __name__ == "__main__":
    main()
