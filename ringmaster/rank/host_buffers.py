"""Host copies of a rank's state for checkpoints, in buffers allocated once and reused.

Allocating the buffers is the expensive part of a first checkpoint: on a GPU, pinning
gigabytes of host memory took 4.38 s where a later checkpoint, reusing them, took 0.11 s
(1b3 preset, H200). :meth:`HostBuffers.reserve` allocates (and on CUDA pins) them in a
background thread from a description of the state taken early in the run, and the first
:meth:`HostBuffers.copy` waits for that thread if it is still running, then finds its
buffers ready.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

Path_ = tuple[Any, ...]  # (name, key, index, …): where a tensor sits in a named state
Spec = tuple[Path_, torch.Size, torch.dtype, torch.device]  # path, shape, dtype, source


def _bufferable(t: torch.Tensor) -> bool:
    """Plain dense tensors get a reused buffer; subclasses and the rare others are cloned."""
    return type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized


def _alias(t: torch.Tensor) -> tuple[Any, ...]:
    """Equal for views of the same memory with the same layout (tied weights)."""
    storage = (t.untyped_storage().data_ptr(), t.storage_offset())
    return (t.device, t.dtype, *storage, tuple(t.shape), t.stride())


def _leaves(item: Any, path: Path_) -> Iterator[tuple[Path_, torch.Tensor]]:
    """Every tensor of ``item`` with its path, in the order and by the paths
    :meth:`HostBuffers.copy` visits them."""
    if isinstance(item, torch.Tensor):
        yield path, item.detach()
    elif isinstance(item, dict):
        for key, value in item.items():
            yield from _leaves(value, (*path, key))
    elif type(item) in (list, tuple):
        for i, value in enumerate(item):
            yield from _leaves(value, (*path, i))


class HostBuffers:
    """Host copies of nested state (dicts, lists and tuples of tensors and plain values),
    in buffers allocated once and reused by every later copy of the same shapes.

    Only copy while nothing reads the previous copy: :meth:`Checkpointer.save` takes a
    snapshot only once the previous persist has finished.
    """

    def __init__(self) -> None:
        self._buffers: dict[Path_, torch.Tensor] = {}
        self.allocations = 0  # buffers allocated so far, in copies and reservations
        self._reserving: threading.Thread | None = None

    def reserve(self, states: Mapping[str, Any]) -> None:
        """Start allocating, in a background thread, the buffers a :meth:`copy` of each
        ``name -> state`` would allocate. Only shapes, dtypes and devices are read, here,
        before returning: the thread never touches the tensors, which may go on changing."""
        self.wait()
        specs: list[Spec] = []
        for name, state in states.items():
            aliases: set[tuple[Any, ...]] = set()
            for path, t in _leaves(state, (name,)):
                if not _bufferable(t) or (t.numel() and _alias(t) in aliases):
                    continue
                aliases.add(_alias(t))
                if not self._fits(self._buffers.get(path), t):
                    specs.append((path, t.shape, t.dtype, t.device))
        self._reserving = threading.Thread(
            target=self._allocate_all, args=(specs,), name="host-buffers", daemon=True
        )
        self._reserving.start()

    def wait(self) -> None:
        """Block until a reservation in flight (if any) has allocated everything."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def _allocate_all(self, specs: list[Spec]) -> None:
        gpus = [device for *_, device in specs if device.type == "cuda"]
        if gpus:  # a new thread: pin on behalf of the rank's own device, as its copies do
            torch.cuda.set_device(gpus[0])
        for path, shape, dtype, device in specs:
            pin = device.type == "cuda"
            buf = self._allocate(shape, dtype, pin)
            if not pin:
                buf.zero_()  # commit the pages now, not in the first copy's page faults
            self._buffers[path] = buf

    def _allocate(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)

    @staticmethod
    def _fits(buf: torch.Tensor | None, t: torch.Tensor) -> bool:
        return (
            buf is not None
            and buf.shape == t.shape
            and buf.dtype == t.dtype
            and buf.is_pinned() == t.is_cuda
        )

    def copy(self, state: Any, name: str) -> Any:
        """A copy of ``state`` (named ``name``: its buffers are kept apart from other
        names') whose tensors are this object's CPU buffers; containers are rebuilt and other
        values deep-copied. Views of the same memory stay shared (tied weights), tensor
        subclasses and non-strided tensors are cloned instead. Returns once every copy has
        landed (CUDA: pinned buffers, non-blocking copies, then one synchronize per device)."""
        self.wait()
        seen: set[Path_] = set()
        aliases: dict[tuple[Any, ...], torch.Tensor] = {}
        devices: set[torch.device] = set()

        def walk(item: Any, path: Path_) -> Any:
            if isinstance(item, torch.Tensor):
                return tensor(item.detach(), path)
            if isinstance(item, dict):
                out = copy.copy(item)  # keeps the type and attributes (state_dict's _metadata)
                for key, value in item.items():
                    out[key] = walk(value, (*path, key))
                return out
            if type(item) is list:
                return [walk(value, (*path, i)) for i, value in enumerate(item)]
            if type(item) is tuple:
                return tuple(walk(value, (*path, i)) for i, value in enumerate(item))
            return copy.deepcopy(item)

        def tensor(t: torch.Tensor, path: Path_) -> torch.Tensor:
            if not _bufferable(t):
                return copy.deepcopy(t)  # rare: no preallocated buffer, but still a copy
            alias = _alias(t)
            if t.numel() and alias in aliases:
                return aliases[alias]
            buf = self._buffers.get(path)
            if buf is None or not self._fits(buf, t):
                buf = self._buffers[path] = self._allocate(t.shape, t.dtype, t.is_cuda)
            seen.add(path)
            buf.copy_(t, non_blocking=t.is_cuda)
            if t.is_cuda:
                devices.add(t.device)
            aliases[alias] = buf
            return buf

        copied = walk(state, (name,))
        for device in devices:
            torch.cuda.synchronize(device)
        for path in [p for p in self._buffers if p[0] == name and p not in seen]:
            del self._buffers[path]  # state that disappeared: free its buffer
        return copied

    @property
    def nbytes(self) -> int:
        self.wait()
        return sum(b.nbytes for b in self._buffers.values())
