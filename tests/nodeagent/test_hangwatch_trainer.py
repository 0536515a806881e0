"""The hang watch against two real trainer ranks (``python -m trainer.worker`` over gloo,
launched by the real supervisor): one is stopped mid-training; the watch names it, with
its stacks, and the peer it holds in a collective is a victim, not reported. The ranks'
timing is real: every wait is for what can be seen, bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import msgspec
import pytest

from nodeagent.hangwatch import FALLBACK_FACTOR
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
from tests.waits import until_async

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

        def beat(rank: int) -> rankbeat.RankBeat | None:
            return rankbeat.read(jobdir.rank_beat(rank))

        await until_async(
            lambda: all((b := beat(r)) is not None and b.step >= 20 for r in (0, 1)),
            90,
            "step 20 on both ranks",
            lambda: jobdir.rank_log(0).read_text()[-2000:],
        )
        os.kill(pids[1], signal.SIGSTOP)
        await until_async(  # reported within 15 s of SIGSTOP
            lambda: any(isinstance(e, WorkerHung) for e in events),
            15,
            "worker.hung",
            lambda: events,
        )

        def peer_stalled_s() -> float | None:  # on the watch's clock, as the watch judges
            peer = beat(0)
            if peer is None or peer.step_at is None:
                return None
            return watch.clock.monotonic() - max(peer.step_at, peer.phase_since)

        # twice the threshold and more: still one event
        await until_async(
            lambda: (s := peer_stalled_s()) is not None and s > FALLBACK_FACTOR * 3.0,
            30,
            "the peer stalled for twice the threshold",
            peer_stalled_s,
        )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await watch.check() == [], "one last pass reports nothing more"
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
        def peer_stacks() -> str | None:
            log = jobdir.rank_log(0).read_text()
            return log if "(most recent call first)" in log else None

        peer_log = await until_async(
            peer_stacks,
            15,
            "the peer's stacks in its log",
            lambda: jobdir.rank_log(0).read_text()[-2000:],
            interval=0.1,
        )
        assert "torch/distributed/" in peer_log or "torch/autograd/" in peer_log
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await supervisor.stop("hang-1", force=True, grace_s=0)  # SIGKILL ends stopped ranks too
        await supervisor.close()
        # killed ranks leave their memory tier (the agent's sweep drops it much later)
        remove_job_ram("hang-1")
