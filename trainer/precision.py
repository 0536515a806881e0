"""Numeric precision of the training step: fp32, bf16 autocast, or float8 via torchao.

float8 goes only into the linears inside transformer blocks, each with the scaling
:mod:`trainer.fp8_auto` chooses for the job's ``train.fp8_recipe``: ``auto`` (the default:
tensorwise or rowwise where float8 pays for that shape, high precision where it does
not), or ``tensorwise`` (one scale per tensor, the fastest) / ``rowwise`` (one scale per
row, more accurate with outliers) for every block linear. torchao's ``emulate=True`` runs
the float8 casts with the real scaling recipe but does the matmul in high precision, which
is how float8 training is exercised on CPU (torchao 0.18 + torch 2.13 checked: both
recipes train, and the forwards differ from fp32 by the quantisation error, as they should).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from trainer.fp8_auto import Fp8Recipe, plan

Precision = Literal["fp8", "bf16", "fp32"]


def apply_precision(
    model: nn.Module,
    precision: Precision,
    device: torch.device,
    recipe: Fp8Recipe = "auto",
    fsdp: bool = False,
    emulate: bool | None = None,
) -> nn.Module:
    """Convert ``model`` in place for ``precision`` (only fp8 changes modules: the block
    linears :func:`trainer.fp8_auto.plan` picks for ``recipe``) and return it. ``fsdp``:
    the model will be sharded with FSDP2, so tensorwise weights are all-gathered in float8.
    ``emulate``: float8 matmuls in high precision (default: off CUDA, where there is no
    float8 matmul)."""
    if precision != "fp8":
        return model
    choices = plan(model, recipe)
    for scaling in ("tensorwise", "rowwise"):
        chosen = {fqn for fqn, choice in choices.items() if choice.scaling == scaling}
        if not chosen:
            continue
        # Imported here: torchao takes seconds to import and only float8 linears need it.
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(scaling),
            emulate=device.type != "cuda" if emulate is None else emulate,
            enable_fsdp_float8_all_gather=fsdp and scaling == "tensorwise",
        )
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, fqn, chosen=chosen: fqn in chosen
        )
    return model


def count_float8_linears(model: nn.Module) -> int:
    """How many modules of ``model`` run their matmuls through float8."""
    if "torchao.float8" not in sys.modules:
        return 0  # nothing was converted, and importing torchao just to check costs seconds
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules())


def autocast_context(
    precision: Precision, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager[object]]:
    """A factory of the context each forward runs under. bf16 autocasts everything; fp8
    autocasts to bf16 on CUDA too, so the embeddings, norms, attention and LM head run in
    BF16 around the float8 block linears. On CPU fp8 stays fp32 outside the linears (CPU
    bf16 is slow and the emulated float8 matmuls run in high precision anyway)."""
    if precision == "bf16" or (precision == "fp8" and device.type == "cuda"):
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
