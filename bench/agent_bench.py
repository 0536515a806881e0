"""Node agent cost and detection latency on a simulated node (8 stub GPUs, 4 NVMe).

    .venv/bin/python bench/agent_bench.py [--duration 300] [--trials 40]

1. Cost: the real agent at its default intervals (only its roots point at the simulated
   node) runs for ``--duration`` seconds against a real nats-server with JetStream and a
   clock responder; its CPU time (utime + stime from /proc) and RSS are read at the end.
   The simulator runs in its own process and is not counted.
2. Detection latency, sysfs: ``/sys/block/nvme2n1/ro`` is flipped at a random moment and
   the time until ``nvme.readonly`` arrives on the bus is measured (``--trials`` times
   each way). The NVMe collector's interval is 0.5 s: the target is 0.52 s.
3. Detection latency, NVML: ``gpu-temp`` is injected through the simulator (the stub
   library's state file changes) and the time until ``gpu.thermal`` arrives is measured;
   the GPU collector's interval is 1 s, so the target is 1.02 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.embedded_nats import start_nats_server  # noqa: E402
from nodeagent.sim.agent_config import to_toml  # noqa: E402
from proto import subjects  # noqa: E402
from proto.api import InjectFault  # noqa: E402
from proto.codec import encode  # noqa: E402
from ringmaster.clock_responder import serve  # noqa: E402

CLUSTER, NODE = "bench", "node-0"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def default_config(tree: Path) -> str:
    """The simulated node's pointers (roots, stub NVML, SMART logs, skew file, metadata
    service) from its agent.toml, every interval and threshold left at the defaults."""
    sim = msgspec.toml.decode((tree / "agent.toml").read_bytes())
    return to_toml(
        {
            "sysfs": sim["sysfs"],
            "procfs": sim["procfs"],
            "dev": sim["dev"],
            "gpus": 8,
            "nvme": {"udev": False, "smart_command": sim["nvme"]["smart_command"]},
            "gpu": {"nvml_library": sim["gpu"]["nvml_library"]},
            "clock": {
                "adjtimex": False,
                "chronyc": [],
                "skew_file": sim["clock"]["skew_file"],
                "step_command": sim["clock"]["step_command"],
            },
            "preemption": {"provider": "aws", "aws_url": sim["preemption"]["aws_url"]},
            "preflight": sim["preflight"],
        }
    )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def memory_mb(pid: int) -> dict[str, float]:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Bus:
    def __init__(self) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.news = asyncio.Event()

    async def on_event(self, msg: Msg) -> None:
        self.events.append((time.monotonic(), json.loads(msg.data)))
        self.news.set()

    async def first_after(self, start: int, kind: str, **fields: Any) -> float:
        while True:
            for at, event in self.events[start:]:
                if event["kind"] == kind and all(event.get(k) == v for k, v in fields.items()):
                    return at
            self.news.clear()
            await asyncio.wait_for(self.news.wait(), 30)


async def detection(bus: Bus, tree: Path, nc: nats.NATS, trials: int) -> dict[str, Any]:
    ro = tree / "sys" / "block" / "nvme2n1" / "ro"
    sysfs: list[float] = []
    for i in range(trials * 2):
        readonly = i % 2 == 0
        await asyncio.sleep(random.uniform(0.6, 1.6))  # any phase of the sampling interval
        mark = len(bus.events)
        partial = ro.with_name(".ro.bench")
        partial.write_text("1\n" if readonly else "0\n")
        start = time.monotonic()
        partial.replace(ro)
        arrived = await bus.first_after(mark, "nvme.readonly", readonly=readonly)
        sysfs.append(arrived - start)
    nvml: list[float] = []
    inject = subjects.sim(CLUSTER, NODE)
    while len(nvml) < trials:  # each GPU heats once a round; cooling takes the 10 s hold
        for gpu in range(8):
            await asyncio.sleep(random.uniform(0.6, 1.6))
            mark = len(bus.events)
            start = time.monotonic()
            fault = encode(InjectFault(fault=f"gpu-temp=96@{gpu}"))
            await nc.request(inject, fault, timeout=5)
            arrived = await bus.first_after(mark, "gpu.thermal", gpu=gpu, level="critical")
            nvml.append(arrived - start)
        mark = len(bus.events)
        await nc.request(inject, encode(InjectFault(fault="clear")), timeout=5)
        for gpu in range(8):
            await bus.first_after(mark, "gpu.thermal", gpu=gpu, level="normal")
    summary = {}
    for name, values in (("sysfs_ro_to_event_s", sysfs), ("nvml_temp_to_event_s", nvml)):
        summary[name] = {
            "n": len(values),
            "median": round(statistics.median(values), 4),
            "p99": round(percentile(values, 0.99), 4),
            "max": round(max(values), 4),
        }
    return summary


async def create_stream(url: str) -> None:
    nc = await nats.connect(url)
    stream = StreamConfig(
        name=subjects.events_stream(CLUSTER), subjects=subjects.events_all(CLUSTER)
    )
    await nc.jetstream().add_stream(stream)
    await nc.close()


async def measure(url: str, tree: Path, agent: int, args: argparse.Namespace) -> dict[str, Any]:
    nc = await nats.connect(url)
    bus = Bus()
    for subject in subjects.events_all(CLUSTER):
        await nc.subscribe(subject, cb=bus.on_event)
    await serve(nc, CLUSTER)  # the coordinator's side of the clock offset
    await asyncio.sleep(args.warmup)  # imports, first samples, NVML start-up
    load0 = os.getloadavg()[1]
    cpu0, wall0 = cpu_seconds(agent), time.monotonic()
    await asyncio.sleep(args.duration)
    cpu, wall = cpu_seconds(agent) - cpu0, time.monotonic() - wall0
    load = (load0 + os.getloadavg()[1]) / 2  # others' work inflates CPU time (cache, switches)
    memory = memory_mb(agent)
    latency = await detection(bus, tree, nc, args.trials)
    await nc.close()
    return {
        "node": "simulated: 8 stub GPUs, 4 NVMe, default intervals",
        "duration_s": round(wall, 1),
        "cpu_pct_of_one_core": round(100 * cpu / wall, 3),
        "machine_load_5min": round(load, 2),
        "machine_cores": os.cpu_count(),
        "rss_mb": round(memory["VmRSS"], 1),
        "peak_rss_mb": round(memory["VmHWM"], 1),
        **latency,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    server = start_nats_server(work / "nats")
    nodes, tree = work / "nodes", work / "nodes" / NODE
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "nodeagent.sim", "--root", str(nodes), "--nodes", NODE,
                 "--nats", server.url, "--cluster", CLUSTER, "--gpus", "8", "--nvme-devices", "4"],
                cwd=REPO, stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        while not (tree / ".ready").exists():
            time.sleep(0.05)
        (work / "agent.toml").write_text(default_config(tree))
        asyncio.run(create_stream(server.url))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "nodeagent.cli", "--config", str(work / "agent.toml"),
                 "--node", NODE, "--cluster", CLUSTER, "--nats", server.url, "--log-json",
                 "--run-dir", str(work / "agent"), "--advertise-addr", "127.0.0.1"],
                cwd=REPO, stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        return asyncio.run(measure(server.url, tree, procs[-1].pid, args))
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=10)
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="cost window, seconds")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before it")
    parser.add_argument("--trials", type=int, default=40, help="latency samples per path")
    print(json.dumps(main(parser.parse_args()), indent=2))
