"""Which block linears run in float8, and with which scaling: ``train.fp8_recipe = "auto"``.

A float8 linear pays only where the matmul saved outweighs the casts and scale reductions
added around it; small matmuls get slower. The thresholds are torchao's own, from its H100
microbenchmarks of forward + backward per (M, K, N) shape: ``torchao/float8/README.md``,
section "Performance" (tensorwise and rowwise tables), as encoded by torchao 0.18 in
``torchao.float8.float8_linear_utils._auto_filter_for_recipe`` (K = in_features, N =
out_features; the tables assume a large M, tokens per micro-batch, which every GPU preset
here has: 8 x 2048):

* tensorwise gains nothing when ``K <= 4096 and N <= 1024``;
* rowwise gains nothing when ``N <= 2048``, ``K <= 1024``, or ``N <= 4096 and K <= 2048``.

The same README's training benchmark (Llama3-8B, 8xH100, compiled) has tensorwise at +25 %
over BF16 and rowwise at +10 %, with "rowwise scaling is better at handling outliers than
tensorwise scaling". So "auto" picks tensorwise wherever it pays, and rowwise instead only
for the linear whose input carries activation outliers, the MLP down projection (fed by
the GELU output, not by a LayerNorm), where rowwise pays too. Linears where neither pays
stay in high precision (BF16 on CUDA).

The choice depends on shapes only, never on the device, so a CPU run converts exactly the
linears a GPU run would (emulated there).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from torch import nn

Fp8Recipe = Literal["auto", "tensorwise", "rowwise"]
Scaling = Literal["tensorwise", "rowwise"]
OUTLIER_INPUTS = ("mlp.proj",)  # fqn suffixes of linears fed by an unnormalised activation


@dataclass(frozen=True)
class Choice:
    scaling: Scaling | None  # None: the linear stays in high precision
    reason: str  # one word (logged as key=value)


def tensorwise_pays(in_features: int, out_features: int) -> bool:
    return not (in_features <= 4096 and out_features <= 1024)


def rowwise_pays(in_features: int, out_features: int) -> bool:
    k, n = in_features, out_features
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def choose(in_features: int, out_features: int, recipe: Fp8Recipe, outliers: bool) -> Choice:
    """The scaling of one linear of shape (``in_features`` -> ``out_features``) under
    ``recipe``; ``outliers``: its input is an unnormalised activation."""
    if in_features % 16 or out_features % 16:
        return Choice(None, "dims-not-multiples-of-16")  # torch._scaled_mm needs them
    if recipe != "auto":
        return Choice(recipe, "requested")
    if not tensorwise_pays(in_features, out_features):
        return Choice(None, "too-small-to-gain")
    if outliers and rowwise_pays(in_features, out_features):
        return Choice("rowwise", "outlier-input-and-rowwise-pays")
    return Choice("tensorwise", "tensorwise-pays")


def block_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` inside a transformer block (``blocks.<i>.…``), by fqn. The
    embedding, the tied LM head and the norms never go float8: a small share of the FLOPs
    and the most sensitive to quantisation."""
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and fqn.startswith("blocks."):
            yield fqn, module


def plan(model: nn.Module, recipe: Fp8Recipe) -> dict[str, Choice]:
    """fqn -> :class:`Choice` for every block linear of ``model``."""
    return {
        fqn: choose(m.in_features, m.out_features, recipe, fqn.endswith(OUTLIER_INPUTS))
        for fqn, m in block_linears(model)
    }


@dataclass(frozen=True)
class Group:
    """The linears of one role across the blocks (``blocks.*.mlp.fc``), for one log line."""

    linears: str
    count: int
    shape: str  # in x out
    scaling: str  # tensorwise | rowwise | the high precision they stay in
    reason: str


def summary(model: nn.Module, choices: dict[str, Choice], high: str) -> list[Group]:
    """``choices`` grouped by role (the fqn with the block index as ``*``), in model order;
    ``high``: the precision the linears left out run in (bf16, fp32)."""
    modules = dict(model.named_modules())
    groups: dict[tuple[str, Choice], list[str]] = {}
    for fqn, choice in choices.items():
        groups.setdefault((re.sub(r"^blocks\.\d+\.", "blocks.*.", fqn), choice), []).append(fqn)
    out = []
    for (role, choice), fqns in groups.items():
        m = modules[fqns[0]]
        assert isinstance(m, nn.Linear)
        shape = f"{m.in_features}x{m.out_features}"
        out.append(Group(role, len(fqns), shape, choice.scaling or high, choice.reason))
    return out
