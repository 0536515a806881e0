"""The FSDP engine: FSDP2 ``fully_shard`` behind the same :class:`trainer.engine.Engine`
protocol as DDP, for models whose parameters and optimizer state do not fit on one GPU
replicated.

Each transformer block is its own shard group (all-gathered just before it runs, freed
after), the root holds the embedding, final norm and tied head. With ``precision = "fp8"``
and the tensorwise recipe, torchao all-gathers the block weights in float8
(``enable_fsdp_float8_all_gather``), halving that traffic, and the per-tensor scales are
computed for all weights in one go after each optimizer step
(``precompute_float8_dynamic_scale_for_fsdp``). On CUDA, parameters are gathered in BF16
and gradients reduced in FP32 (``MixedPrecisionPolicy``); on CPU everything stays FP32.

Checkpoints go through DCP ``async_save`` of the sharded state (:mod:`ringmaster.rank.dcp_async`,
which unwraps the float8 weights first): each rank writes only its shards, and DCP reshards
on load, so a job resumes with another world size.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from proto.job import TrainSection
from trainer.engine import TorchEngine
from trainer.precision import Precision, autocast_context


def _float8_all_gather(module: nn.Module) -> bool:
    """Whether torchao converted ``module``'s linears with float8 all-gather enabled."""
    if "torchao.float8" not in sys.modules:
        return False
    from torchao.float8.float8_linear import Float8Linear

    return any(
        isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather
        for m in module.modules()
    )


class FSDPEngine(TorchEngine):
    name = "fsdp"

    def __init__(
        self,
        module: nn.Module,
        train: TrainSection,
        precision: Precision,
        device: torch.device,
        checkpoint_group: dist.ProcessGroup | None = None,
    ) -> None:
        module = module.to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # the job's ranks
        policy = MixedPrecisionPolicy()
        autocast = autocast_context(precision, device)
        if device.type == "cuda" and precision in ("bf16", "fp8"):
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            autocast = autocast_context("fp32", device)  # the policy casts instead
        for block in module.get_submodule("blocks").children():
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh, mp_policy=policy)
        self.float8_all_gather = _float8_all_gather(module)
        super().__init__(
            module, module, train, autocast, device, checkpoint_group, replicated=False
        )

    def after_optimizer_step(self) -> None:
        if self.float8_all_gather:  # one pass computes every weight's float8 scale
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.module)
