"""Every `coordinatorctl inject` fault on a simulated node, read by the real agent:
each produces its event once, and its recovery event once (a spot notice has none: the
machine is going away). The clock is recovered with the agent's resync_clock command."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from agent_harness import Tap, agent, kind

from coordinator.embedded_nats import NatsServer
from nodeagent.sim import agent_config
from nodeagent.sim.metadata import MetadataServer
from nodeagent.sim.node import SimulatedNode
from proto import subjects
from proto.codec import encode, reply_decoder
from proto.commands import ResyncClock
from proto.conditions import ConditionKind, Severity
from proto.node import Heartbeat
from ringmaster.clock_responder import serve

CLUSTER = "faults"
NODE = "node-0"
FAST = {  # tighter than a simulated node's defaults, to keep the test short
    "heartbeat_s": 0.25,
    "nvme": {"hold_s": 1.0},
    "gpu": {"interval_s": 0.5, "topology_interval_s": 0.5, "thermal_hold_s": 1.0},
    "clock": {"interval_s": 0.5, "peer_interval_s": 0.5, "hold_s": 1.0},
    "preemption": {"interval_s": 0.5},
}


class Ticking:
    """A simulated node advanced every 0.1 s in a thread, faults applied under its lock."""

    def __init__(self, node: SimulatedNode) -> None:
        self.node = node
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            with self.lock:
                self.node.tick(0.1)

    def apply(self, *faults: str) -> None:
        with self.lock:
            for fault in faults:
                self.node.apply(fault)


@pytest.fixture
def sim(tmp_path: Path, nvml_cache: Path) -> Iterator[Ticking]:
    metadata = MetadataServer(("aws",)).start()
    node = SimulatedNode(
        tmp_path / NODE, NODE, 2, gpus=4, seed=11, nvml_cache=nvml_cache, metadata=metadata
    )
    node.tick(0.1)
    ticking = Ticking(node)
    try:
        yield ticking
    finally:
        ticking.stop.set()
        ticking.thread.join()
        metadata.stop()


FAULTS = [
    "nvme-latency=500@nvme0n1",
    "nvme-readonly=on",
    "gpu-temp=95@1",
    "pcie-bw=3@2",
    "link=0-1:PHB",
    "clock-offset=50",
    "spot-notice=60",
]
RAISED: list[Any] = [
    kind("nvme.latency_spike", device="nvme0n1"),
    kind("nvme.readonly", device="nvme0n1", readonly=True),
    kind("nvme.readonly", device="nvme1n1", readonly=True),
    kind("gpu.thermal", gpu=1, level="critical"),
    kind("pcie.degraded", gpu=2, recovered=False),
    kind("topology.degraded", gpu_a=0, gpu_b=1, found="PHB", recovered=False),
    kind("clock.drift", recovered=False, source="peer"),
    kind("spot.notice", provider="aws", action="terminate"),
]
RECOVERED: list[Any] = [
    kind("nvme.latency_recovered", device="nvme0n1"),
    kind("nvme.readonly", device="nvme0n1", readonly=False),
    kind("nvme.readonly", device="nvme1n1", readonly=False),
    kind("gpu.thermal", gpu=1, level="normal"),
    kind("pcie.degraded", gpu=2, recovered=True),
    kind("topology.degraded", gpu_a=0, gpu_b=1, recovered=True),
    kind("clock.resynced"),
    kind("clock.drift", recovered=True),
]


def open_(beat: Heartbeat) -> list[str]:
    """The beat's active conditions, as ``kind:subject``."""
    return sorted(f"{c.kind}:{c.subject}" for c in beat.conditions if c.active)


@pytest.mark.slow
@pytest.mark.anyio
async def test_every_fault_once_and_its_recovery(
    sim: Ticking, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = agent_config.write(sim.node, FAST)
    tap = await Tap.open(nats_server.url, CLUSTER)
    coordinator = await nats.connect(nats_server.url)
    await serve(coordinator, CLUSTER)  # the coordinator's clock, for the offset over NATS
    run = tmp_path / "agent"
    try:
        with agent(config, node=NODE, cluster=CLUSTER, nats_url=nats_server.url, run_dir=run):
            await tap.wait(kind("node.preflight", ok=True), kind("topology"))
            await tap.beat(lambda b: len(b.telemetry.gpus) == 4 and not b.conditions)
            clean = len(tap.events)
            assert [e for e in tap.events if e["severity"] != "info"] == []

            sim.apply(*FAULTS)
            await tap.wait(*RAISED, since=clean)
            beat = await tap.beat(
                lambda b: "topology.degraded:0-1" in open_(b) and len(open_(b)) >= 8
            )
            [hot] = [c for c in beat.conditions if c.kind == ConditionKind.GPU_THERMAL]
            assert hot.subject == "1" and hot.severity == Severity.CRITICAL
            drift = next(e for e in tap.events[clean:] if RAISED[6](e))
            assert drift["offset_ms"] == pytest.approx(50.0, abs=5.0)
            spot = next(e for e in tap.events[clean:] if RAISED[7](e))
            assert spot["severity"] == "critical" and spot["deadline"]

            request = ResyncClock(epoch=1, issued_by="test")
            msg = await coordinator.request(
                subjects.command(CLUSTER, NODE), encode(request), timeout=15
            )
            reply = reply_decoder.decode(msg.data)
            assert reply.ok, reply.error
            sim.apply("clear")
            await tap.wait(*RECOVERED, since=clean)
            # a withdrawn spot notice closes its condition without an event
            await tap.beat(lambda b: not b.conditions)
            # six beats are 1.5 s of the agent's own time: anything flapping would show
            await tap.beats_after(6)
            resynced = next(e for e in tap.events[clean:] if RECOVERED[6](e))
            assert resynced["offset_before_ms"] == pytest.approx(50.0, abs=5.0)
            assert abs(resynced["offset_after_ms"]) < 5.0
            for match in RAISED + RECOVERED:
                assert tap.count(match, clean) == 1, [e for e in tap.events[clean:] if match(e)]
            assert sim.node.faults() == []
    finally:
        await coordinator.close()
        await tap.close()
    log = (run / "agent.log").read_text()
    assert '"level": "error"' not in log and "Traceback" not in log, log[-3000:]
