"""Loading a DeepSpeed ZeRO-1/2 optimizer state saved at another data-parallel world size.

Why: a job that lost a node continues on fewer nodes, and grows back later, from the same
checkpoint. ZeRO stages 1 and 2 give each rank one equal slice of every parameter group's
flat fp32 master weights and Adam moments (the flat group padded at its end so that it
divides by the world size), so the slices saved by N ranks are not the slices M ranks
need. DeepSpeed 0.19's own ways do not get there for us: ``load_checkpoint`` refuses a
changed world size outright; its ``zero_optimization.elastic_checkpoint`` changes the save
format so the loader can merge the slices, but that loader asserts on torch's AdamW (which
keeps ``step`` per parameter, not per group) and picks "this rank's" saved slice by the new
rank, out of range when the world grew; the universal checkpoint is an offline conversion
(``ds_to_universal``) writing a second copy of the checkpoint between two runs.

The saved slices already hold all that is needed, in the format we write today:
``single_partition_of_fp32_groups`` (each rank's slice of the fp32 master weights, its
padding already removed) and the base optimizer's ``state_dict`` (each rank's moments,
padded by ``group_paddings``). Laid end to end without their padding, the slices are the
whole flat group, which does not depend on the world size; each rank copies out its new
slice. Tensors come from memory-mapped files, so a rank reads only the saved slices that
overlap its own instead of holding the whole optimizer state. The parameters themselves
are not sharded in ZeRO-1/2 (``mp_rank_00_model_states.pt`` holds them all) and load as
usual.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# DeepSpeed's own file names (deepspeed.runtime.engine) and state dict keys
# (deepspeed.checkpoint.constants), spelled out to keep this module import-light.
MODEL_STATES = re.compile(r"mp_rank_\d+_model_states\.pt")
ZERO_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
FP32_SLICES = "single_partition_of_fp32_groups"
GROUP_PADDINGS = "group_paddings"


def zero_files(names: Sequence[str], world_size: int) -> list[str] | None:
    """The ZeRO optimizer files among ``names`` (paths), one per saved rank in rank order;
    None unless there is exactly one for each of ``world_size`` ranks."""
    by_rank: dict[int, str] = {}
    for name in names:
        match = ZERO_FILE.fullmatch(Path(name).name)
        if match is not None:
            by_rank.setdefault(int(match.group(1)), name)
    if sorted(by_rank) != list(range(world_size)):
        return None
    return [by_rank[rank] for rank in range(world_size)]


def take(pieces: Sequence[torch.Tensor], start: int, size: int) -> torch.Tensor:
    """Elements ``[start, start + size)`` of the 1-D tensors ``pieces`` laid end to end,
    zeros past their end (the new padding). Only the overlapping parts are read."""
    out = pieces[0].new_zeros(size)
    offset = 0
    for piece in pieces:
        lo, hi = max(start, offset), min(start + size, offset + piece.numel())
        if lo < hi:
            out[lo - start : hi - start] = piece[lo - offset : hi - offset]
        offset += piece.numel()
    return out


def unpadded(tensor: torch.Tensor, padding: int) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat[: flat.numel() - padding]


def read_states(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Each saved rank's ZeRO optimizer state dict, memory-mapped. ``weights_only=False``:
    DeepSpeed pickles its loss scaler into them; these files were written by the job and
    verified against its manifest before this is called."""
    states = []
    for path in paths:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        states.append(saved[OPTIMIZER_STATE_DICT])
    return states


def reshard(
    states: Sequence[dict[str, Any]], rank: int, world_size: int, sizes: Sequence[int]
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """This rank's slice of each parameter group from the saved ranks' ``states``:
    (fp32 master slices, the base optimizer's state dict to load). ``sizes``: the length of
    this rank's slice of each group now."""
    base = states[0][BASE_OPTIMIZER_STATE]
    if not isinstance(base, dict):
        raise RuntimeError("ZeRO checkpoint saved in DeepSpeed's elastic format, not ours")
    fp32: list[torch.Tensor] = []
    optimizer_state: dict[int, dict[str, Any]] = {}
    for group, size in enumerate(sizes):
        paddings = [state[GROUP_PADDINGS][group] for state in states]
        pieces = [state[FP32_SLICES][group].reshape(-1) for state in states]
        whole = sum(piece.numel() for piece in pieces)
        if whole > size * world_size:
            raise RuntimeError(
                f"ZeRO parameter group {group} holds {whole} elements, more than "
                f"{size} x {world_size} ranks: not this model's checkpoint"
            )
        start = rank * size
        fp32.append(take(pieces, start, size))
        (index,) = base["param_groups"][group]["params"]
        saved = [state[BASE_OPTIMIZER_STATE]["state"].get(index, {}) for state in states]
        entry: dict[str, Any] = {}
        for key, value in saved[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # a slice, like fp32
                parts = [unpadded(s[key], p) for s, p in zip(saved, paddings, strict=True)]
                entry[key] = take(parts, start, size)
            else:  # the same on every rank (Adam's step); copied out of the mapped file
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        if entry:
            optimizer_state[index] = entry
    return fp32, {"state": optimizer_state, "param_groups": base["param_groups"]}


def load_resharded(zero_optimizer: Any, paths: Sequence[Path], rank: int, world_size: int) -> None:
    """Restore a DeepSpeed ZeRO-1/2 optimizer (``engine.optimizer``) from the ZeRO files
    ``paths`` another world size saved, one per saved rank in rank order."""
    masters = zero_optimizer.single_partition_of_fp32_groups
    fp32, optimizer_state = reshard(
        read_states(paths), rank, world_size, [master.numel() for master in masters]
    )
    with torch.no_grad():
        for master, values in zip(masters, fp32, strict=True):
            master.copy_(values)
    zero_optimizer.optimizer.load_state_dict(optimizer_state)  # torch's AdamW
    zero_optimizer._link_all_hp_params()  # as DeepSpeed's own load does after this
