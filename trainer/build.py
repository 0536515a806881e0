"""The model a rank trains, from the job's ``[train]`` section: the preset's GPT, with
activation checkpointing, float8 linears and compiled blocks as the job asks (or as the
device suggests, for the keys left unset), each decision logged once."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from proto.job import TrainSection
from ringmaster.rank.log import Log
from trainer import compile as regional
from trainer.fp8_auto import plan, summary
from trainer.model import GPT
from trainer.precision import apply_precision
from trainer.presets import ModelConfig, param_count

# ``train.activation_checkpointing`` unset: on for models this big on CUDA, where saved
# activations, not weights, decide the micro-batch that fits ("1b3" and up).
CHECKPOINTING_FROM_PARAMS = 1e9


def activation_checkpointing(setting: bool | None, cfg: ModelConfig, device: torch.device) -> bool:
    if setting is not None:
        return setting
    return device.type == "cuda" and param_count(cfg) >= CHECKPOINTING_FROM_PARAMS


def build_model(train: TrainSection, cfg: ModelConfig, device: torch.device, log: Log) -> GPT:
    """The GPT for ``train`` (on the CPU, seeded by the caller), converted for its
    precision; with fp8, one log line per role of block linear says which scaling it got
    (or the high precision it stays in) and why."""
    model = GPT(cfg, activation_checkpointing(train.activation_checkpointing, cfg, device))
    if train.precision == "fp8":
        choices = plan(model, train.fp8_recipe)
        high = "bf16" if device.type == "cuda" else "fp32"
        for group in summary(model, choices, high):
            log(
                "float8",
                recipe=train.fp8_recipe,
                linears=group.linears,
                count=group.count,
                shape=group.shape,
                runs_in=group.scaling,
                why=group.reason,
            )
    fsdp = train.engine == "fsdp"
    apply_precision(model, train.precision, device, train.fp8_recipe, fsdp)
    return model


def compile_model(
    model: nn.Module, train: TrainSection, device: torch.device, env: Mapping[str, str], log: Log
) -> bool:
    """Compile ``model``'s blocks if ``train.compile`` (resolved for ``device``) asks for
    it, with the node's compile cache; returns whether it did."""
    if not regional.wanted(train.compile, device):
        return False
    cache = regional.cache_dir(env)
    regional.use_cache(cache)
    backend = env.get(regional.BACKEND_ENV) or "inductor"
    blocks = regional.compile_blocks(model, backend)
    log("compile", blocks=blocks, backend=backend, cache=cache)
    return True
