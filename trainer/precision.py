"""Numeric precision of the training step: fp32, bf16 autocast, or float8 via torchao.

float8 goes only into the linears inside transformer blocks. Embeddings, the (tied) LM head
and LayerNorms keep full precision: they are a small share of the FLOPs and the most
sensitive to quantisation. torchao's ``emulate=True`` runs the float8 casts with the real
scaling recipe but does the matmul in high precision, which is how float8 training is
exercised on CPU (torchao 0.18 + torch 2.13 checked: it trains, and the forward differs
from fp32 by the quantisation error, as it should).

The scaling recipe is the job's ``train.fp8_recipe``: ``tensorwise`` (one scale per tensor,
the fastest) or ``rowwise`` (one scale per row, more accurate with outliers). Both run
emulated on CPU (checked with torchao 0.18 + torch 2.13: they train, and the forwards differ
from fp32 by a small amount), so neither is refused there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

Precision = Literal["fp8", "bf16", "fp32"]
Fp8Recipe = Literal["tensorwise", "rowwise"]


def _in_block_linear(module: nn.Module, fqn: str) -> bool:
    """torchao's module filter: only ``blocks.<i>.…`` linears with float8-friendly shapes."""
    if not (isinstance(module, nn.Linear) and fqn.startswith("blocks.")):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_precision(
    model: nn.Module,
    precision: Precision,
    device: torch.device,
    recipe: Fp8Recipe = "tensorwise",
    fsdp: bool = False,
) -> nn.Module:
    """Convert ``model`` in place for ``precision`` (only fp8 changes modules, scaled by
    ``recipe``) and return it. ``fsdp``: the model will be sharded with FSDP2, so weights
    are all-gathered in float8 where the recipe allows it (tensorwise)."""
    if precision == "fp8":
        # Imported here: torchao takes seconds to import and only fp8 needs it.
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        # Off CUDA there is no float8 matmul to use: emulate it (real casts and scales).
        config = dataclasses.replace(
            config,
            emulate=device.type != "cuda",
            enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise",
        )
        convert_to_float8_training(model, config=config, module_filter_fn=_in_block_linear)
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
