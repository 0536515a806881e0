"""``python -m nodeagent.sim`` as a real process, injected over a real nats-server."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import pytest

from nodeagent.collectors.base import Roots
from nodeagent.collectors.nvme import NvmeLatencyCollector
from proto import subjects
from proto.api import InjectFault, InjectReply
from tests.waits import until

CLUSTER = "simtest"
NODES = ["node-0", "node-1"]


@dataclass
class Sim:
    root: Path
    proc: subprocess.Popen[bytes]
    pidfile: Path
    log: Path


@pytest.fixture
def sim(tmp_path: Path, nats_url: str) -> Iterator[Sim]:
    root, pidfile, log = tmp_path / "nodes", tmp_path / "sim.pid", tmp_path / "sim.log"
    argv = [sys.executable, "-m", "nodeagent.sim", "--root", str(root), "--nodes", ",".join(NODES)]
    argv += ["--nats", nats_url, "--cluster", CLUSTER, "--tick", "0.05", "--pidfile", str(pidfile)]
    with log.open("wb") as stderr:
        proc = subprocess.Popen(argv, stderr=stderr)
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            return all((root / n / ".ready").exists() for n in NODES)

        until(ready, 20, "the simulator's nodes ready", lambda: sorted(root.glob("*/.ready")))
        yield Sim(root, proc, pidfile, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def requests(url: str, payloads: list[tuple[str, bytes]]) -> list[InjectReply]:
    nc = await nats.connect(url)
    try:
        replies = []
        for node, payload in payloads:
            msg = await nc.request(subjects.sim(CLUSTER, node), payload, timeout=5)
            replies.append(msgspec.json.decode(msg.data, type=InjectReply))
        return replies
    finally:
        await nc.close()


def inject(node: str, fault: str) -> tuple[str, bytes]:
    return node, msgspec.json.encode(InjectFault(fault=fault))


@pytest.mark.slow
def test_inject_over_nats_changes_what_the_collector_reads(sim: Sim, nats_url: str) -> None:
    assert sim.pidfile.read_text().strip() == str(sim.proc.pid)
    first = asyncio.run(requests(nats_url, [inject("node-1", "nvme-latency=500@nvme1n1")]))
    assert first == [InjectReply(ok=True, faults=["nvme-latency=500@nvme1n1"])]

    collector = NvmeLatencyCollector(Roots(sysfs=sim.root / "node-1" / "sys"))
    collector.collect(time.monotonic())
    time.sleep(0.5)
    devices = collector.collect(time.monotonic()).devices
    assert devices["nvme0n1"].latency_us == pytest.approx(20.0, abs=3)
    assert devices["nvme1n1"].latency_us == pytest.approx(500.0, abs=3)
    assert 3000 <= devices["nvme1n1"].iops <= 6000

    replies = asyncio.run(
        requests(
            nats_url,
            [
                inject("node-1", "nvme-readonly=on"),
                inject("node-1", "gpu-temp=hot"),
                ("node-1", b'{"fault": 5}'),
                ("node-1", b"not json"),
                inject("node-0", "clear"),
            ],
        )
    )
    both = ["nvme-latency=500@nvme1n1", "nvme-readonly=on"]
    assert replies[0] == InjectReply(ok=True, faults=both)
    assert not replies[1].ok and "'hot' is not a number" in replies[1].error
    assert replies[1].faults == both, "a refused fault leaves the active ones as they were"
    assert not replies[2].ok and replies[2].error.startswith("bad InjectFault payload: ")
    assert not replies[3].ok and replies[3].error.startswith("bad InjectFault payload: ")
    assert replies[4] == InjectReply(ok=True, faults=[]), "node-0 has its own faults"
    assert (sim.root / "node-1" / "sys" / "block" / "nvme0n1" / "ro").read_text() == "1\n"
    assert (sim.root / "node-0" / "sys" / "block" / "nvme0n1" / "ro").read_text() == "0\n"

    sim.proc.send_signal(signal.SIGTERM)
    assert sim.proc.wait(timeout=10) == 0
    assert not sim.pidfile.exists()
    events = [json.loads(line)["event"] for line in sim.log.read_text().splitlines()]
    assert events[0] == "serving" and events[-2:] == ["stopping", "stopped"]
    assert events.count("inject_applied") == 3 and events.count("inject_refused") == 1


@pytest.mark.slow
def test_sigint_stops_cleanly_too(sim: Sim) -> None:
    sim.proc.send_signal(signal.SIGINT)
    assert sim.proc.wait(timeout=10) == 0
    assert not sim.pidfile.exists()
