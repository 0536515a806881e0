"""The hang watch against two real trainer ranks (``python -m trainer.worker`` over gloo,
launched by the real supervisor): one is stopped mid-training; the watch names it, with
its stacks, and the peer it holds in a collective is a victim, not reported."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import msgspec
import pytest

from nodeagent.hangwatch_loop import HangWatch
from nodeagent.rankprobe import proc_stat
from nodeagent.supervisor import Supervisor
from proto.commands import Launch, RankSpec
from proto.events import EventBase, WorkerHung
from proto.job import JobSpec
from proto.progress import Progress
from ringmaster import rankbeat
from ringmaster.memory_store import remove_job_ram
from ringmaster.rundir import JobDir

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_a_stopped_trainer_rank_is_named_and_its_peer_is_a_victim(tmp_path: Path) -> None:
    events: list[EventBase] = []

    async def on_event(event: EventBase) -> None:
        events.append(event)

    async def on_progress(_job: str, _message: Progress) -> None:
        pass

    supervisor = Supervisor("node-a", tmp_path / "run", on_event, on_progress)
    watch = HangWatch(supervisor, on_event, "node-a", interval_s=0.1)
    spec = msgspec.convert(
        {
            "job": {"name": "hang"},
            "train": {
                "engine": "ddp",
                "model": "tiny",
                "steps": 100_000,
                "precision": "fp32",
                "micro_batch_size": 2,
                "seq_len": 32,
                "preflight_bandwidth": False,
            },
            "checkpoint": {"every_steps": 100_000, "dir": "ckpt"},
            "policy": {"grad_norm_spike": 1e9},
        },
        JobSpec,
    )
    env = {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    cmd = Launch(
        job="hang-1",
        attempt=1,
        ranks=[RankSpec(rank=r, local_rank=r) for r in (0, 1)],
        spec=spec,
        env=env,
        workdir=str(tmp_path),
    )
    jobdir = JobDir(supervisor.run_dir, "hang-1")
    task: asyncio.Task[None] | None = None
    try:
        pids = await supervisor.launch(cmd)
        task = asyncio.create_task(watch.run())
        deadline = time.monotonic() + 90
        while not all(
            (b := rankbeat.read(jobdir.rank_beat(r))) is not None and b.step >= 20 for r in (0, 1)
        ):
            assert time.monotonic() < deadline, jobdir.rank_log(0).read_text()[-2000:]
            await asyncio.sleep(0.05)
        os.kill(pids[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        while not any(isinstance(e, WorkerHung) for e in events):
            assert time.monotonic() - stopped_at < 15, events
            await asyncio.sleep(0.01)
        latency = time.monotonic() - stopped_at
        print(f"stopped trainer rank reported {latency:.2f} s after SIGSTOP")
        await asyncio.sleep(4.0)  # twice the threshold and more: still one event
        hung = [e for e in events if isinstance(e, WorkerHung)]
        assert len(hung) == 1
        (event,) = hung
        assert (event.rank, event.pid, event.node, event.job) == (1, pids[1], "node-a", "hang-1")
        assert event.evidence.startswith("process stopped")
        assert event.threshold_s == 3.0  # tiny steps: the default floor
        assert "trainer/loop.py" in event.stacks
        state = proc_stat(pids[1])
        assert state is not None and state.state in ("T", "t")
        # the peer was asked for its stacks (once it too stalled past its threshold) and
        # found waiting in a collective
        asked_by = time.monotonic() + 15
        while "(most recent call first)" not in (peer_log := jobdir.rank_log(0).read_text()):
            assert time.monotonic() < asked_by, peer_log[-2000:]
            await asyncio.sleep(0.1)
        assert "torch/distributed/" in peer_log or "torch/autograd/" in peer_log
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await supervisor.stop("hang-1", force=True, grace_s=0)  # SIGKILL ends stopped ranks too
        await supervisor.close()
        # killed ranks leave their memory tier (the agent's sweep drops it much later)
        remove_job_ram("hang-1")
