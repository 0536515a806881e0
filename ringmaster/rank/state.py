"""A rank's training state as the checkpointer sees it (:class:`State`), and what a loop
registers as that state through the rank API.

A loop that brings its own engine implements :class:`State` itself: its own checkpoint
format (the built-in trainer's engines, :class:`trainer.engine.Engine`, DeepSpeed's
layout among them). A loop that registers its objects gets :class:`Registered`: a model
and its optimizer go through ``torch.distributed.checkpoint.state_dict``
(:class:`ringmaster.rank.dcp_async.DcpState`), so a plain module, DDP and FSDP2 all save
and load the same way and DCP reshards them when the world size changes. Everything else
the loop registers — a learning-rate scheduler, a ``StatefulDataLoader``, a sampler's
position, any object with ``state_dict``/``load_state_dict`` — and the RNG states go into
the rank's own small file beside them (:class:`Objects`), as the built-in trainer's step
and data offset do.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ringmaster.rank import durable
from ringmaster.rank.dcp_async import DcpState

NAME = "dcp"  # the manifests of registered state say so (``Manifest.engine``)


class State(Protocol):
    """What a checkpoint holds of a rank and how it comes back: the checkpoint half of a
    loop's own engine, or what a loop registers through the rank API
    (:class:`Registered`). The checkpointer, the memory tier and the resume
    (:mod:`ringmaster.rank.session`) see only this."""

    name: str  # recorded in the manifest: a checkpoint loads only into a state of its name

    def snapshot(self, staging: Path, target: Path) -> dict[str, Any]:
        """Copy this rank's state for a checkpoint of step dir ``target``, quickly (the
        loop waits): file name -> an in-memory copy the next step cannot change, serialised
        later by the persist thread, or a :class:`ringmaster.rank.checkpoint.Written` for
        files the state writes into ``target`` in the background. A state that cannot hand
        itself over either way may write files into ``staging`` (the rank's empty staging
        dir)."""
        ...

    def prepare_snapshot(self) -> None:
        """Start allocating the host buffers :meth:`snapshot` copies into, in the
        background (the first snapshot waits for that if still needed). Called on every
        rank at the same point, after the first optimizer step of the process, when the
        optimizer state exists; may take collectives."""
        ...

    def files_for(self, manifest: durable.Manifest) -> list[str] | None:
        """The files of a checkpoint this rank verifies and loads; None if it cannot use
        that checkpoint (another state's, or a layout this world size cannot load). A
        checkpoint written at another world size loads where the state reshards it."""
        ...

    def refusal(self, manifest: durable.Manifest) -> str | None:
        """Why :meth:`files_for` refuses ``manifest``, in a few words for the operator's
        one line; None when it does not (the files may still fail their checksums)."""
        ...

    def memory_files(self, manifest: durable.Manifest, rank: int) -> list[str] | None:
        """Every file rank ``rank`` of this world opens loading ``manifest``: its own and
        the other ranks' it reads too (at another world size, what resharding reads).
        A durable dir shows every rank every file; the memory tier brings these to the
        rank's node. None where :meth:`files_for` refuses the checkpoint."""
        ...

    def load(self, step_dir: Path, manifest: durable.Manifest) -> None:
        """Restore the state :meth:`snapshot` captured, from a verified checkpoint."""
        ...

    def close(self) -> None:
        """Release what checkpoints hold (host buffers), after the last one is durable."""
        ...


@runtime_checkable
class Stateful(Protocol):
    """``torch.distributed.checkpoint.stateful.Stateful``: what the loop may register."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


class Registered:
    """A model and optimizer registered by the loop, as a :class:`State`.
    Without a model there are no DCP files: the loop's whole state is in its rank file."""

    name = NAME

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.dcp: DcpState | None = None
        if model is not None:
            # Tensors that are not DTensors have the same fully qualified names on every
            # rank, and DCP keeps one copy of such a tensor: they are replicated (DDP, a
            # plain module in data parallel), so each rank stages only its share of them.
            self.dcp = DcpState(model, optimizer, group, replicated=not _sharded(model))

    def snapshot(self, staging: Path, target: Path) -> dict[str, Any]:
        return {} if self.dcp is None else self.dcp.snapshot(target)

    def prepare_snapshot(self) -> None:
        if self.dcp is not None:
            self.dcp.prepare()

    def files_for(self, manifest: durable.Manifest) -> list[str] | None:
        return None if self.refusal(manifest) is not None else self._files(manifest)

    def _files(self, manifest: durable.Manifest) -> list[str]:
        return [] if self.dcp is None else self.dcp.files_for(manifest)

    def refusal(self, manifest: durable.Manifest) -> str | None:
        if manifest.engine != self.name:
            return f"another loop's (its state is {manifest.engine!r})"
        if self.dcp is not None and not self._files(manifest):
            return "no model in it (none was registered when it was written)"
        return None

    def memory_files(self, manifest: durable.Manifest, rank: int) -> list[str] | None:
        return self.files_for(manifest)  # DCP reads every shard as it reshards

    def load(self, step_dir: Path, manifest: durable.Manifest) -> None:
        if self.dcp is not None:
            self.dcp.load(step_dir)

    def close(self) -> None:
        if self.dcp is not None:
            self.dcp.close()


class Position(Protocol):
    """What the loop keeps in each rank's own file besides the step and the RNG: the
    built-in trainer's data offset, a user loop's registered objects."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Objects:
    """A user loop's registered objects (schedulers, data loaders, samplers …) by name."""

    def __init__(self, objects: Mapping[str, Stateful]) -> None:
        self.objects = dict(objects)

    def state_dict(self) -> dict[str, Any]:
        # a private copy: the next step must not change what the persist thread writes
        return {"objects": {k: copy.deepcopy(o.state_dict()) for k, o in self.objects.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("objects", {})
        for name, obj in self.objects.items():
            if name in saved:
                obj.load_state_dict(saved[name])


def capture_rng() -> dict[str, Any]:
    """Every RNG a loop draws from: torch's (CPU, and CUDA when present), Python's and
    NumPy's, in types ``torch.load(weights_only=True)`` reads back."""
    rng: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": _python_rng()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy_rng()
    if numpy is not None:
        rng["numpy"] = numpy
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` took (a checkpoint of an older release holds
    torch's alone)."""
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available() and "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "python" in rng:
        version, state, gauss = rng["python"]
        random.setstate((version, tuple(state), gauss))
    if "numpy" in rng:
        import numpy as np

        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _python_rng() -> list[Any]:
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def _numpy_rng() -> list[Any] | None:
    try:
        import numpy as np
    except ImportError:
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached]
