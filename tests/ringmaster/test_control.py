"""The control word riding in the step's loss all-reduce, on two real gloo ranks: every
rank gets the mean loss and rank 0's decision from one collective."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from proto.progress import ControlWord
from ringmaster.rank.agent_link import AgentLink
from ringmaster.rank.control import UNKNOWN_NORM, StepControl

pytestmark = pytest.mark.slow


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        link = AgentLink(Path(out) / "unused.sock", "job") if rank == 0 else None  # not started
        control = StepControl(rank, torch.device("cpu"), link)
        silent = StepControl(rank, torch.device("cpu"), link, enabled=False)
        if link is not None:  # words that arrived during the step
            link.controls.put(ControlWord(action="pause", seq=7))
            link.controls.put(ControlWord(action="checkpoint", seq=8))
        # losses 1 and 2; rank 0's gradient norm alone counts; each rank's seconds its own
        norm = torch.tensor(4.0 + rank)
        results = [control.reduce_step(torch.tensor(1.0 + rank), 2, norm, 0.25 * (rank + 1))]
        results.append(control.reduce_step(torch.tensor(3.0), 2))  # nothing pending
        if link is not None:
            link.controls.put(ControlWord(action="stop", seq=9))
        results.append(silent.reduce_step(torch.tensor(0.5), 2, 2.0))  # no word is carried
        report = [
            [t.loss, d.action.name, d.checkpoint, d.seq, t.grad_norm, t.compute_s]
            for t in results
            for d in [t.decision]
        ]
        Path(f"{out}/rank-{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_mean_loss_and_rank_0s_decision(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text()) == [
            [1.5, "PAUSE", True, 8, 4.0, [0.25, 0.5]],
            [3.0, "NONE", False, 0, UNKNOWN_NORM, [0.0, 0.0]],
            [0.5, "NONE", False, 0, 2.0, [0.0, 0.0]],
        ]
