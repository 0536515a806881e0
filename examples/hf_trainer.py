"""A Hugging Face ``Trainer`` script as its documentation writes it — a GPT-2 built from a
config, random tokens, ``save_steps``, resuming from its own newest checkpoint — plus the
two lines marked ``# ringmaster``. Without them it is the unmodified script: Ringmaster
still runs it (``[job] entry``), but can only start, kill and restart it.

Run it under Ringmaster with examples/hf_trainer.toml, or alone:
``torchrun --nproc-per-node 2 examples/hf_trainer.py --out /tmp/hf-out``.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from ringmaster.integrations.hf import RingmasterCallback  # ringmaster


class RandomTokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(vocab, (samples, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="hf-out")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-steps", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    config = GPT2Config(
        n_layer=args.layers, n_head=2, n_embd=args.width, vocab_size=512, n_positions=64
    )
    model = GPT2LMHeadModel(config)
    data = RandomTokens(8192, 64, config.vocab_size)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=3e-4,
        save_steps=args.save_steps,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=data,
        eval_dataset=RandomTokens(64, 64, config.vocab_size) if args.eval_steps else None,
        callbacks=[RingmasterCallback()],  # ringmaster
    )
    last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
