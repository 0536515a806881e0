"""Reading the trainer's DCP checkpoints in tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def read_dcp(step_dir: Path, scratch: Path) -> dict[str, Any]:
    """A DCP checkpoint's whole state (``step_dir/dcp``) as one plain dict, through torch's
    own converter, as an operator would inspect it."""
    out = scratch / f"{step_dir.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir / "dcp", out)
    state: dict[str, Any] = torch.load(out, weights_only=True)
    return state
