"""Files between ranks over a gloo group, as point-to-point sends of their bytes: how the
memory tier copies snapshots to a buddy and assembles a restore, and how a checkpoint
that only rank 0 has converted (DeepSpeed's universal copy, made in a rank's own restore
dir) reaches the other ranks."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def send_recv(
    sends: list[tuple[Path, int]], recvs: list[tuple[Path, int, int]], group: object
) -> None:
    """Send each (file, peer); receive each (file, peer, size) into place. Both sides know
    every size beforehand, so an empty file travels as no message at all. Files to one
    peer are matched in the order both sides list them."""
    ops, landing = [], []
    for path, peer in sends:
        data = path.read_bytes()
        if data:
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            ops.append(dist.P2POp(dist.isend, tensor, peer, group))  # type: ignore[arg-type]
    for path, peer, size in recvs:
        buf = torch.empty(size, dtype=torch.uint8)
        if size:
            ops.append(dist.P2POp(dist.irecv, buf, peer, group))  # type: ignore[arg-type]
        landing.append((path, buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for path, buf in landing:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(buf.numpy().tobytes())
        tmp.replace(path)


def share_from_rank0(root: Path, rank: int, world: int, group: object) -> int:
    """Make rank 0's tree under ``root`` whole on every rank (collective): a rank that
    already sees every file at its size (a filesystem they share) receives nothing, the
    others get the files from rank 0. Returns the files this rank received."""
    box: list[object] = [_listing(root) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)  # type: ignore[arg-type]
    files: list[tuple[str, int]] = box[0]  # type: ignore[assignment]
    sees = all(_has(root / name, size) for name, size in files)
    seen: list[object] = [None] * world
    dist.all_gather_object(seen, sees, group=group)
    sends = []
    if rank == 0:
        sends = [(root / name, peer) for peer, ok in enumerate(seen) if not ok for name, _ in files]
    recvs = [] if sees else [(root / name, 0, size) for name, size in files]
    send_recv(sends, recvs, group)
    return len(recvs)


def _listing(root: Path) -> list[tuple[str, int]]:
    return sorted(
        (str(path.relative_to(root)), path.stat().st_size)
        for path in root.rglob("*")
        if path.is_file()
    )


def _has(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False
