"""Asynchronous torch.distributed.checkpoint saves of (FSDP2-)sharded state, made safe for
torchao float8.

Two things go wrong without this module:

* With FSDP2 ``fully_shard`` and ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``
  each weight is a DTensor whose local shard is torchao's ``WeightWithDynamicFloat8CastTensor``
  wrapper. ``dcp.save`` writes it correctly, but ``dcp.async_save`` writes garbage (checked
  on CPU/gloo with torch 2.13 + torchao 0.18: the round trip differs). :func:`plain_state`
  swaps each wrapper for the plain tensor it wraps, sharing storage, before saving.
* ``async_save`` runs its collectives while training takes its own on the job's group; on
  GPU that group is NCCL, which cannot carry a CPU-side save. The caller passes a separate
  gloo group (the one :class:`trainer.checkpoint.Coordination` already holds).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor


def _float8_wrappers() -> tuple[type, ...]:
    """torchao's weight wrappers, if torchao's float8 was imported (else nothing can be one)."""
    if "torchao.float8" not in sys.modules:
        return ()
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return (WeightWithDynamicFloat8CastTensor,)


def _plain_tensor(value: torch.Tensor, wrappers: tuple[type, ...]) -> torch.Tensor:
    if isinstance(value, DTensor):
        local = value.to_local()
        plain = _plain_tensor(local, wrappers)
        if plain is local:
            return value
        return DTensor.from_local(
            plain,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if wrappers and isinstance(value, wrappers):
        inner: torch.Tensor = value._tensor  # type: ignore[attr-defined]
        return inner
    return value


def plain_state(state: Any) -> Any:
    """``state`` (nested dicts and lists of tensors) with every torchao float8 weight
    wrapper, bare or inside a DTensor, replaced by the high-precision tensor it wraps (no
    copy). Everything else is returned as is."""
    wrappers = _float8_wrappers()

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _plain_tensor(value, wrappers)
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(item) for item in value)
        return value

    return walk(state)


def async_save(state: dict[str, Any], path: str, group: dist.ProcessGroup) -> Any:
    """Start saving ``state`` to ``path`` with DCP on ``group`` (gloo, not the training
    group); returns what ``dcp.async_save`` returns (wait with ``.result()``). The state
    is staged to host memory before this returns, so training may change it afterwards."""
    return dcp.async_save(plain_state(state), checkpoint_id=path, process_group=group)
