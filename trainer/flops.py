"""Model FLOPs per token and model FLOPs utilisation (MFU), for rank 0's step reports.

MFU counts the FLOPs the model needs, not what the hardware executed: activation
checkpointing's recomputation and float8's casts are not credited, so MFU compares runs of
the same model fairly whatever they did to go faster (PaLM, Chowdhery et al. 2022,
appendix B). Per token, forward and backward:

* ``6 N``: two FLOPs per multiply-add, one multiply-add per parameter per token forward and
  two backward. N excludes the position table (a lookup, no matmul); the token embedding
  counts once, for the LM head it is tied to.
* ``12 L d T``: attention scores and the weighted sum, ``2 * 2 * T * d`` per layer forward
  (causal masking not discounted, as in PaLM), times three for forward and backward.

The denominator is the device's peak dense BF16 tensor-core rate times the world size.
Peaks come from NVIDIA's datasheets (dense, i.e. half the "with sparsity" figure); a device
not in the table (any CPU) has no MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.presets import ModelConfig, param_count

# Substrings of torch.cuda.get_device_name, most specific first -> dense BF16 FLOP/s.
PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),  # SXM5
    ("H200", 989e12),  # SXM (also GH200)
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward model FLOPs per trained token at context length ``seq_len``."""
    matmul_params = param_count(cfg) - cfg.max_seq_len * cfg.d_model
    return 6 * matmul_params + 12 * cfg.n_layers * cfg.d_model * seq_len


def peak_bf16_flops(name: str) -> float | None:
    """Peak dense BF16 FLOP/s of the device called ``name``; None when not in the table."""
    for pattern, peak in PEAK_BF16:
        if pattern in name:
            return peak
    return None


def device_peak(device: torch.device) -> float | None:
    """:func:`peak_bf16_flops` of ``device``; None off CUDA."""
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class Mfu:
    """What rank 0 needs to turn a step's tokens/s into MFU."""

    flops_per_token: int
    peak_per_device: float | None  # dense BF16 FLOP/s; None: unknown device, no MFU
    world_size: int

    def of(self, tokens_per_s: float) -> float | None:
        """MFU (a fraction) at ``tokens_per_s`` over the whole job."""
        if self.peak_per_device is None:
            return None
        return tokens_per_s * self.flops_per_token / (self.peak_per_device * self.world_size)
