"""Training batches whose order is a pure function of (seed, step, rank, world size).

Nothing about the data position lives in process state: the samples of step ``s`` on rank
``r`` are always the same global sample ids, so a job resumed from a checkpoint at step
``s`` sees exactly the samples an uninterrupted run would, and no data-loader state has to
be checkpointed.

Two sources:

* ``"synthetic"``: sample ``i`` is generated from ``(seed, i)``: an arithmetic byte
  sequence (random start and stride) with 5% random noise, so a model must infer the
  stride from context and the loss visibly falls within tens of steps.
* a path to a ``.bin`` of uint16 tokens, read through ``numpy.memmap``: the file is cut
  into windows of ``seq_len + 1`` tokens, and each epoch visits all windows in a
  permutation seeded by ``(seed, epoch)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SYNTHETIC = "synthetic"
_STRIDES = np.array([1, 2, 3, 5, 7])
_NOISE = 0.05


@dataclass(frozen=True)
class Layout:
    """How global sample ids are dealt out: ``micro_batch_size`` per rank per step."""

    micro_batch_size: int
    world_size: int


def sample_ids(layout: Layout, step: int, rank: int) -> list[int]:
    """Global sample ids rank ``rank`` trains on in step ``step`` (0-based, the step about
    to run). Ranks get disjoint contiguous slices of each step's global batch."""
    first = (step * layout.world_size + rank) * layout.micro_batch_size
    return list(range(first, first + layout.micro_batch_size))


def synthetic_sample(seed: int, sample_id: int, length: int, vocab_size: int) -> np.ndarray:
    """Sample ``sample_id`` of the synthetic stream: ``length`` tokens below ``vocab_size``."""
    rng = np.random.default_rng([seed, sample_id])
    start = rng.integers(vocab_size)
    stride = rng.choice(_STRIDES)
    tokens = (start + stride * np.arange(length)) % vocab_size
    noisy = rng.random(length) < _NOISE
    tokens[noisy] = rng.integers(vocab_size, size=int(noisy.sum()))
    return tokens.astype(np.int64)


class TokenFile:
    """Windows of a uint16 token file, in a per-epoch permutation seeded by ``seed``."""

    def __init__(self, path: Path, seq_len: int, seed: int) -> None:
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.window = seq_len + 1
        self.n_windows = len(self.tokens) // self.window
        if self.n_windows == 0:
            raise ValueError(
                f"{path}: {len(self.tokens)} tokens, fewer than one sample of {self.window}"
            )
        self.seed = seed
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def sample(self, sample_id: int) -> np.ndarray:
        epoch, index = divmod(sample_id, self.n_windows)
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._epoch = epoch
        start = int(self._order[index]) * self.window
        return np.asarray(self.tokens[start : start + self.window], dtype=np.int64)


class Batches:
    """Input/target batches for one rank: ``batch(step)`` is deterministic."""

    def __init__(
        self, source: str, *, seq_len: int, vocab_size: int, seed: int, layout: Layout, rank: int
    ) -> None:
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.layout = layout
        self.rank = rank
        self.file = None if source == SYNTHETIC else TokenFile(Path(source), seq_len, seed)

    def ids(self, step: int) -> list[int]:
        return sample_ids(self.layout, step, self.rank)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 of shape (micro_batch_size, seq_len)."""
        rows = [self._sample(i) for i in self.ids(step)]
        data = torch.from_numpy(np.stack(rows))
        top = int(data.max())
        if top >= self.vocab_size:
            raise ValueError(
                f"token id {top} is outside the model's vocabulary of {self.vocab_size}"
            )
        return data[:, :-1], data[:, 1:]

    def _sample(self, sample_id: int) -> np.ndarray:
        if self.file is None:
            return synthetic_sample(self.seed, sample_id, self.seq_len + 1, self.vocab_size)
        return self.file.sample(sample_id)
