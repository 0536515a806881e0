"""Model and optimizer checkpoints through torch.distributed.checkpoint (DCP) ``async_save``,
for the DDP and FSDP engines, made safe for torchao float8.

Stage 1 (the loop waits): ``async_save`` copies the state into host memory through one
:class:`~torch.distributed.checkpoint.staging.DefaultStager` kept for the whole run, whose
buffers are allocated on the first checkpoint and reused by every later one (pinned, with
non-blocking copies, on CUDA). Stage 2 (DCP's upload thread): plan and write
``step-<N>/dcp/`` straight into the durable dir, fsynced; each rank writes the
``__<rank>_*.distcp`` files of its tensors (under DDP, where every rank holds the same
state, each stages and writes only its share of it), rank 0 the ``.metadata``. The
checkpointer's persist thread waits for that, hashes the files in place and seals the
step as for every engine.

Three things go wrong without this module:

* With FSDP2 ``fully_shard`` and ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``
  each weight is a DTensor whose local shard is torchao's ``WeightWithDynamicFloat8CastTensor``
  wrapper. ``dcp.save`` writes it correctly, but ``dcp.async_save`` writes garbage (checked
  on CPU/gloo with torch 2.13 + torchao 0.18: the round trip differs). :func:`plain_state`
  swaps each wrapper for the plain tensor it wraps, sharing storage, before saving.
* ``async_save`` runs its collectives in its own thread while training takes its own on the
  job's group; on GPU that group is NCCL, which cannot carry a CPU-side save. Saves and
  loads run on the separate gloo group :class:`ringmaster.rank.checkpoint.Coordination` holds.
* ``async_save`` without a stager builds a new one, so new host buffers, every time.

The stager keeps one host copy per source tensor storage, created the first time it
stages that storage. :meth:`DcpState.prepare` has it create them in a background thread
early in the run (after the first optimizer step: torch's AdamW creates its moments
there), so the first checkpoint finds them as later ones do. That goes through the
stager's ``_stage_untyped_storage`` (private; torch 2.13): with a torch lacking it, the
first checkpoint allocates them, as before.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ringmaster.rank import durable
from ringmaster.rank.checkpoint import Written

DCP_DIR = "dcp"  # inside every step dir
METADATA = ".metadata"  # DCP's index of the checkpoint, written by rank 0


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


def async_save(
    state: dict[str, Any],
    path: str | Path,
    group: dist.ProcessGroup | None,
    stager: DefaultStager | None = None,
) -> Future[Any]:
    """Start saving ``state`` to ``path`` with DCP on ``group`` (gloo, not the training
    group); wait with ``.result()``. The state is staged to host memory before this
    returns, so training may change it afterwards."""
    future = dcp.async_save(
        plain_state(state), checkpoint_id=path, process_group=group, async_stager=stager
    )
    assert isinstance(future, Future)  # synchronous staging: no separate staging future
    return future


def replicated_share(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The part of a replicated (DDP) model + optimizer state that ``rank`` saves: the
    parameters and their optimizer state dealt out over the ranks by size (greedy, largest
    first, the same on every rank), so each rank stages and writes about 1/world of it
    instead of all of it; anything else stays on every rank (DCP keeps one copy)."""
    model, optimizer = state["model"], state["optimizer"]
    optimizer.setdefault("state", {})
    sizes = {
        fqn: t.numel() * t.element_size() for fqn, t in model.items() if isinstance(t, torch.Tensor)
    }
    loads = [0] * world_size
    owner: dict[str, int] = {}
    for fqn in sorted(sizes, key=lambda f: (-sizes[f], f)):
        owner[fqn] = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner[fqn]] += sizes[fqn]

    def kept(entries: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in entries.items() if owner.get(k, rank) == rank}

    return {"model": kept(model), "optimizer": {**optimizer, "state": kept(optimizer["state"])}}


class DcpState:
    """One rank's model and optimizer (None: the model alone), saved and loaded as a DCP
    checkpoint (any layout: plain replicated tensors under DDP, DTensor shards under FSDP2).
    DCP reshards on load, so a job resumes with another world size. ``replicated``: every
    rank holds the same state (DDP), so each saves only its :func:`replicated_share` — with
    8 ranks a node, staging the whole state on each would hold 8 copies in host memory."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        group: dist.ProcessGroup | None,
        replicated: bool = False,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.group = group
        alone = not dist.is_initialized()  # a lone process without a process group
        self.rank = 0 if alone else dist.get_rank(group)
        self.world_size = 1 if alone else dist.get_world_size(group)
        self.replicated = replicated
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,  # staged when async_save returns: simple to reason on
                use_non_blocking_copy=cuda,
            )
        )
        self._preparing: threading.Thread | None = None

    @property
    def _optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return () if self.optimizer is None else (self.optimizer,)

    def _state(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.module, self._optimizers)
        return {"model": model, "optimizer": optimizer}

    def _saved_state(self) -> dict[str, Any]:
        state = self._state()
        if self.replicated:
            state = replicated_share(state, self.rank, self.world_size)
        return state

    def prepare(self) -> None:
        """Start creating the stager's host copy of every storage a snapshot stages, in a
        background thread (on CUDA from a side stream, so the copies it makes on the way
        overlap training instead of queueing behind it). Their contents do not matter:
        each snapshot copies over them."""
        stager = getattr(self.stager, "_state_dict_stager", None)
        stage = getattr(stager, "_stage_untyped_storage", None)
        if stage is None:
            return
        storages = list(_storages(plain_state(self._saved_state())))
        gpus = [s.device for s in storages if s.device.type == "cuda"]
        stream = torch.cuda.Stream(device=gpus[0]) if gpus else None  # entering it sets the device

        def allocate() -> None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for storage in storages:
                    stage(storage, non_blocking=False)

        self.wait_prepared()
        self._preparing = threading.Thread(target=allocate, name="dcp-buffers", daemon=True)
        self._preparing.start()

    def wait_prepared(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    @property
    def host_bytes(self) -> int | None:
        """Bytes of the host copies the stager holds (None with a torch that hides them)."""
        stager = getattr(self.stager, "_state_dict_stager", None)
        cached = getattr(stager, "_cached_storage_mapping", None)
        return None if cached is None else sum(s.nbytes() for s in cached.values())

    def snapshot(self, target: Path) -> dict[str, Any]:
        """Stage the state and start writing it to ``target/dcp``; the checkpointer hashes
        this rank's files once they are written."""
        self.wait_prepared()
        future = async_save(self._saved_state(), target / DCP_DIR, self.group, self.stager)

        def written() -> list[str]:
            metadata = future.result()
            mine = f"__{self.rank}_"
            names = {
                info.relative_path
                for info in metadata.storage_data.values()
                if info.relative_path.startswith(mine)
            }
            if self.rank == 0:
                names.add(METADATA)
            return sorted(f"{DCP_DIR}/{name}" for name in names)

        return {DCP_DIR: Written(written)}

    @staticmethod
    def files_for(manifest: durable.Manifest) -> list[str]:
        """Every DCP file of the checkpoint: after resharding, a rank may read any of them."""
        return sorted(name for name in manifest.files if name.startswith(f"{DCP_DIR}/"))

    def load(self, step_dir: Path) -> None:
        state = self._state()
        plain = plain_state(state)  # loads in place: same storage as the model's tensors
        dcp.load(plain, checkpoint_id=step_dir / DCP_DIR, process_group=self.group)
        set_state_dict(
            self.module,
            self._optimizers,
            model_state_dict=plain["model"],
            optim_state_dict=plain["optimizer"],
        )

    def close(self) -> None:
        self.wait_prepared()
        self.stager.close()


class DcpCheckpoints:
    """The checkpoint half of an engine whose state DCP saves (DDP, FSDP): the engine sets
    ``name`` and ``state``."""

    name: str
    state: DcpState

    def snapshot(self, staging: Path, target: Path) -> dict[str, Any]:
        return self.state.snapshot(target)

    def prepare_snapshot(self) -> None:
        self.state.prepare()

    def files_for(self, manifest: durable.Manifest) -> list[str] | None:
        files = self.state.files_for(manifest)
        return files if self.refusal(manifest) is None else None

    def refusal(self, manifest: durable.Manifest) -> str | None:
        if manifest.engine != self.name:
            return f"another engine's (resume with {manifest.engine})"
        if not self.state.files_for(manifest):
            return "no DCP files in its manifest"
        return None

    def memory_files(self, manifest: durable.Manifest, rank: int) -> list[str] | None:
        # every rank reads the whole metadata and shards (DCP reshards as it loads)
        return self.files_for(manifest)

    def load(self, step_dir: Path, manifest: durable.Manifest) -> None:
        self.state.load(step_dir)

    def close(self) -> None:
        self.state.close()


def _storages(state: Any) -> Iterator[torch.UntypedStorage]:
    """Each distinct storage behind the tensors of ``state`` (a DTensor's: its local
    shard's), as the stager sees them."""
    seen: set[int] = set()
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, DTensor):
            stack.append(item.to_local())
        elif isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if item.data_ptr() and id(storage) not in seen:
                seen.add(id(storage))
                yield storage
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
