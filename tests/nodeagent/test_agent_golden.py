"""The real agent, end to end, against fixture trees, the stub NVML library, a stand-in
chronyc and a local metadata service: the events it publishes in a scripted scenario
match ``tests/fixtures/golden/agent_events.json``.

Regenerate the golden file after an intended change with::

    RINGMASTER_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/nodeagent/test_agent_golden.py

Events are compared per step, sorted, without what changes from run to run (times, the
host name, free space, deadlines). The heartbeats' active conditions are checked against
what each step opened and closed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import pytest
from agent_harness import NotifySocket, Tap, agent, free_port, health_gate, kind
from gpu_stub import GpuNode

from coordinator.embedded_nats import NatsServer
from nodeagent.sim.agent_config import to_toml
from nodeagent.sim.metadata import MetadataServer
from proto.conditions import ConditionKind, condition_key
from proto.node import Heartbeat
from ringmaster.procs import wait_until_async

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden" / "agent_events.json"
SMART = GOLDEN.parent.parent / "smart"
CHRONY = GOLDEN.parent.parent / "chrony"
SYNCED = (CHRONY / "tracking_synced.csv").read_text()
UNSYNCED = (CHRONY / "tracking_unsynced.csv").read_text()
CLUSTER, NODE = "golden", "node-7"
Tree = Callable[[str], Path]
VOLATILE = [
    (r"\d\d:\d\d:\d\d UTC", "HH:MM:SS UTC"),
    (r"in \d+ s", "in N s"),
    (r"for [\d.]+ s", "for N s"),
]


def normalize(event: dict[str, Any], root: Path) -> dict[str, Any]:
    text = json.dumps({k: v for k, v in event.items() if k not in ("time", "hostname")})
    out: dict[str, Any] = json.loads(text.replace(str(root), "<root>"))
    for key in ("deadline", "held_s"):
        if key in out:
            out[key] = f"<{key}>"
    condition = out.get("condition")
    if condition is not None:
        condition["since"] = "<since>"
    for pattern, fixed in VOLATILE:
        out["message"] = re.sub(pattern, fixed, out["message"])
        if condition is not None:
            condition["reason"] = re.sub(pattern, fixed, condition["reason"])
    for check in out.get("checks", []):
        if check["name"] != "somaxconn":
            check["value"] = "<measured>"
    return out


def settings(root: Path, gpus: GpuNode, metadata: MetadataServer) -> dict[str, Any]:
    chronyc = root / "chronyc"
    chronyc.write_text(f"#!/bin/sh\ncat {root}/tracking.csv\n")
    chronyc.chmod(0o755)
    (root / "tracking.csv").write_text(SYNCED)
    return {
        "sysfs": str(root / "sys"),
        "procfs": str(root / "proc"),
        "dev": str(root / "dev"),
        "gpus": 2,
        "heartbeat_s": 0.2,
        "nvme": {
            "interval_s": 0.2,
            "hold_s": 0.6,
            "udev": False,
            "smart_command": ["cat", f"{root}/smart/{{device}}.json"],
            "smart_interval_s": 0.3,
        },
        "gpu": {
            "nvml_library": str(gpus.library),
            "interval_s": 0.2,
            "topology_interval_s": 0.3,
            "thermal_hold_s": 0.6,
            "topology_confirm": 1,
            "expect_nvlink": "all",
        },
        "clock": {
            "interval_s": 0.2,
            "adjtimex": False,
            "chronyc": [str(chronyc)],
            "chrony_interval_s": 0.1,
            "hold_s": 0.6,
            "step_command": ["true"],
        },
        "preemption": {
            "provider": "aws",
            "aws_url": metadata.url,
            "interval_s": 0.2,
            "sigterm_notice": "always",
        },
        "preflight": {
            "interval_s": 0.5,
            "data_dir": str(root),
            "checkpoint_dir": str(root / "ckpt"),
            "shm_min_gb": 0.001,
        },
    }


def _async(predicate: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return predicate()

    return check


def keys(beat: Heartbeat) -> list[str]:
    return [c.key for c in beat.conditions]


def set_in_flight(root: Path, device: str, count: int) -> None:
    """A device's I/Os in flight: the fixtures have some, and a device with I/O in flight
    whose counters stand still is stalled."""
    stat = root / "sys" / "block" / device / "stat"
    fields = stat.read_text().split()
    fields[8] = str(count)
    stat.write_text(" ".join(fields) + "\n")


def set_smart(root: Path, device: str, log: str) -> None:
    shutil.copy(SMART / f"{log}.json", root / "smart" / f"{device}.json")


@pytest.mark.slow
@pytest.mark.anyio
async def test_published_events_match_the_golden_file(
    tree: Tree, gpu_node: GpuNode, nats_server: NatsServer, tmp_path: Path
) -> None:
    root = tree("sysfs_nvme")
    tree("procfs_tuned")
    set_in_flight(root, "nvme1n1", 0)
    (root / "smart").mkdir()
    for device in ("nvme0n1", "nvme1n1"):
        set_smart(root, device, "healthy")
    gpu_node.state.gpus = gpu_node.state.gpus[:2]
    gpu_node.state.topo = {(0, 1): gpu_node.state.topo[(0, 1)]}
    for gpu in gpu_node.state.gpus:
        gpu.links = [
            link for link in gpu.links if link.remote_bus in {g.bus_id for g in gpu_node.state.gpus}
        ]
    gpu_node.write()
    metadata = MetadataServer(("aws",)).start()
    config = root / "agent.toml"
    config.write_text(to_toml(settings(root, gpu_node, metadata)))
    notify = NotifySocket(tmp_path / "notify")
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"}
    tap = await Tap.open(nats_server.url, CLUSTER)
    steps: dict[str, list[dict[str, Any]]] = {}
    mark = 0

    regen = bool(os.environ.get("RINGMASTER_REGEN_GOLDEN"))
    expected: dict[str, list[dict[str, Any]]] = {} if regen else json.loads(GOLDEN.read_text())

    def so_far() -> list[dict[str, Any]]:
        return sorted(
            (normalize(e, root) for e in tap.events[mark:]),
            key=lambda e: json.dumps(e, sort_keys=True),
        )

    async def step(name: str, *matches: Callable[[dict[str, Any]], bool]) -> None:
        """The step's events: once its matches arrived, everything else it causes (the
        golden file's list; regenerating it, what arrives before two more heartbeats). An
        event too many is counted in the next step, so it still fails the comparison."""
        nonlocal mark
        await tap.wait(*matches, since=mark)
        if regen:
            beats = len(tap.beats)
            await wait_until_async(_async(lambda: len(tap.beats) >= beats + 2), timeout=30)
        else:
            with suppress(TimeoutError):  # what differs is reported below, step by step
                await wait_until_async(_async(lambda: so_far() == expected[name]), timeout=15)
        steps[name] = so_far()
        mark = len(tap.events)

    run_dir = tmp_path / "agent"
    port = free_port()
    try:
        with agent(
            config,
            node=NODE,
            cluster=CLUSTER,
            nats_url=nats_server.url,
            run_dir=run_dir,
            env=env,
            metrics_port=port,
        ) as proc:
            await step("start", kind("node.registered"), kind("node.preflight"), kind("topology"))
            beat = await tap.beat(lambda b: len(b.telemetry.gpus) == 2 and len(b.collectors) >= 7)
            assert beat.conditions == ()
            gate = health_gate(config, NODE, port)  # the scheduler's check: a healthy node
            assert (gate.returncode, gate.stderr) == (0, ""), gate
            assert gate.stdout.startswith(f"ringmaster: {NODE} may take work"), gate
            assert beat.telemetry.clock_offset_ms == pytest.approx(0.812345)

            tree("sysfs_nvme_t1")  # nvme1n1: 500 µs over the window, read-only, 3 in flight
            set_in_flight(root, "nvme0n1", 0)  # nvme0n1 just goes idle
            set_smart(root, "nvme0n1", "readonly")
            hot = gpu_node.state.gpus[1]
            hot.temp_c, hot.reasons = 95, 0x40
            gpu_node.state.xids.append((1, 48))
            for a, b in ((0, 1), (1, 0)):
                for link in gpu_node.state.links_between(a, b):
                    link.active = False
            gpu_node.state.set_level(0, 1, 30)  # PHB
            gpu_node.write()
            (root / "tracking.csv").write_text(UNSYNCED)
            metadata.preempt(120)
            await step(
                "faults",
                kind("nvme.latency_spike"),
                kind("nvme.readonly", device="nvme1n1"),
                kind("nvme.readonly", device="nvme0n1"),
                kind("gpu.thermal"),
                kind("gpu.xid"),
                kind("topology.degraded"),
                kind("clock.drift"),
                kind("spot.notice"),
            )
            faults = sorted(
                [
                    condition_key(ConditionKind.NVME_LATENCY, NODE, "nvme1n1"),
                    condition_key(ConditionKind.NVME_READONLY, NODE, "nvme0n1"),
                    condition_key(ConditionKind.NVME_READONLY, NODE, "nvme1n1"),
                    condition_key(ConditionKind.GPU_THERMAL, NODE, "1"),
                    condition_key(ConditionKind.TOPOLOGY, NODE, "0-1"),
                    condition_key(ConditionKind.CLOCK, NODE),
                    condition_key(ConditionKind.PREEMPTION, NODE, "aws"),
                ]
            )
            beat = await tap.beat(lambda b: keys(b) == faults)
            thermal = next(c for c in beat.conditions if c.kind is ConditionKind.GPU_THERMAL)
            assert (thermal.severity, thermal.value) == ("critical", 95.0)
            gate = health_gate(config, NODE, port)  # refused, naming what is open, one line
            assert gate.returncode == 1 and len(gate.stdout.splitlines()) == 1, gate
            for named in ("nvme.readonly nvme0n1 (critical)", "gpu.thermal 1 (critical)"):
                assert named in gate.stdout, gate

            set_in_flight(root, "nvme1n1", 0)  # its stalled I/Os drain: idle now
            (root / "sys" / "block" / "nvme1n1" / "ro").write_text("0\n")
            set_smart(root, "nvme0n1", "healthy")
            hot.temp_c, hot.reasons = 60, 0
            for gpu in gpu_node.state.gpus:
                for link in gpu.links:
                    link.active = True
            gpu_node.write()
            (root / "tracking.csv").write_text(SYNCED)
            await step(
                "recovery",
                kind("nvme.latency_recovered"),
                kind("nvme.readonly", device="nvme1n1", readonly=False),
                kind("nvme.readonly", device="nvme0n1", readonly=False),
                kind("gpu.thermal", level="normal"),
                kind("topology.degraded", recovered=True),
                kind("clock.drift", recovered=True),
            )
            notice = condition_key(ConditionKind.PREEMPTION, NODE, "aws")
            await tap.beat(lambda b: keys(b) == [notice])
            await notify.said(f"collectors ok; conditions: {notice}")  # its next watchdog ping

            proc.send_signal(signal.SIGTERM)
            await step("sigterm", kind("spot.notice", provider="sigterm"))
            assert await anyio.to_thread.run_sync(proc.wait, 10) == 0
        gate = health_gate(config, NODE, port)  # a stopped agent drains nothing
        assert gate.returncode == 0 and gate.stdout == "", gate
        assert gate.stderr.startswith(f"warning: ringmaster: cannot ask {NODE}'s agent"), gate
    finally:
        await tap.close()
        metadata.stop()
    said = notify.close()
    assert said[0] == f"READY=1\nSTATUS={NODE} up at 127.0.0.1"
    assert any(m.startswith("WATCHDOG=1\nSTATUS=") for m in said)
    assert any(m.endswith(f"collectors ok; conditions: {notice}") for m in said)
    assert said[-1] == "STOPPING=1\nSTATUS=stopping"

    if regen:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(steps, indent=1, ensure_ascii=False) + "\n")
        expected = steps
    for name in expected:
        assert steps[name] == expected[name], f"step {name!r} differs from {GOLDEN.name}"
    assert list(steps) == list(expected)
