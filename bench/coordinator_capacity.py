"""Coordinator capacity: one real coordinator under 1 Hz heartbeats from N simulated nodes,
measured for CPU, memory and event → decision latency (not a test).

    .venv/bin/python bench/coordinator_capacity.py [--nodes 1000 10000] [--seconds 60]
        [--warmup 10] [--event-rate 2] [--profile] [--json OUT.json]

For each size the script starts a fresh nats-server (``start_nats_server``) and one
coordinator process (``python -m coordinator.cli --cluster bench --id c0``). A separate
publisher process (this script with ``--publisher N``) sends a ``proto.node.Heartbeat``
with realistic telemetry (2–4 NVMe latencies, 8 GPU samples, 9 collector statuses) for
every node every second, spread over 100 slots of 10 ms, and reports how many it really
sent and how far behind its schedule it fell.

This process plays the node agent of every node (it answers ``cmd.*`` like
``nodeagent.commands``: ok, ReservePort → 12345), submits a two-node job, sends rank 0's
first ``StepDone`` through JetStream so the job is running, then, for ``--seconds``,
publishes with JetStream ``nvme.latency_spike`` / ``nvme.latency_recovered`` alternately
for the job's master node (a fresh device per pair, so each spike opens the only pause
reason and its recovery closes it). Decision latency runs from just before ``js.publish``
to the moment the fake agent receives the resulting Pause / Resume command.

Coordinator CPU is utime+stime from ``/proc/<pid>/stat`` over the window, as % of one core;
RSS is ``VmRSS``. nats-server's and the publisher's CPU and the whole machine's busy share
are reported beside it, because on a small machine they compete for the same cores.
``--profile`` additionally samples the coordinator with py-spy during the window (it costs
the coordinator a little) and prints its hottest functions.

Targets: the coordinator under 60 % of one core (``CPU_TARGET_PCT``) at 25,000 nodes, decision
p99 ≤ 50 ms, every event decided or held by policy, a silenced node lost within 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from coordinator.embedded_nats import NatsServer, start_nats_server
from proto import subjects
from proto.api import SubmitJob
from proto.codec import api_reply_decoder, command_decoder, encode, job_decoder
from proto.commands import CommandReply, Launch, Pause, ReservePort, Resume
from proto.conditions import Condition, ConditionKind, condition_key
from proto.events import NvmeLatencyRecovered, NvmeLatencySpike, Severity
from proto.job import JobRecord, JobSection, JobSpec, JobState
from proto.node import CollectorStatus, GpuSample, Heartbeat, RankReport, Telemetry
from proto.progress import StepDone
from ringmaster.bus import event_subject

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]
COORDINATOR = [sys.executable, "-m", "coordinator.cli"]
CLUSTER = "bench"
SLOTS = 100  # publisher slots per second
COLLECTORS = (
    "clock",
    "clock_peer",
    "gpu",
    "gpu_topology",
    "nvme",
    "nvme_smart",
    "nvme_udev",
    "preemption",
    "preflight",
)
CLK_TCK = os.sysconf("SC_CLK_TCK")
MASTER_PORT = 12345
CPU_TARGET_PCT = 60.0  # of one core, at every size up to 25,000 nodes


# -- /proc readings -------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(parts[:8])
    idle = parts[3] + parts[4]
    return total - idle, total


def pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


# -- the publisher process ------------------------------------------------------------


def node_name(i: int, n: int) -> str:
    return f"sim-{i:0{max(5, len(str(n - 1)))}d}"


def make_beat(i: int, n: int, rng: random.Random) -> Heartbeat:
    devices = [f"nvme{d}n1" for d in range(2 + i % 3)]
    return Heartbeat(
        node=node_name(i, n),
        seq=0,
        sent_at=0.0,
        addr=f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}",
        hostname=f"gpu-host-{i:05d}.bench.internal",
        gpus=8,
        cpus=96,
        simulated=True,
        interval_s=1.0,
        telemetry=Telemetry(
            nvme_latency_us={d: round(20 + 5 * rng.random(), 1) for d in devices},
            gpus=[
                GpuSample(
                    index=g,
                    temp_c=round(50 + 20 * rng.random(), 1),
                    util_pct=round(100 * rng.random(), 1),
                    mem_used_mb=round(60000 + 20000 * rng.random(), 0),
                )
                for g in range(8)
            ],
            clock_offset_ms=round(rng.random(), 3),
        ),
        collectors=[
            CollectorStatus(name=c, ok=True, duration_s=round(0.01 * rng.random(), 4))
            for c in COLLECTORS
        ],
    )


class AgentSays(msgspec.Struct):
    """The part of a node's beats that follows what happens to it during the run."""

    ranks: list[RankReport] = msgspec.field(default_factory=list)
    jobs: list[str] = msgspec.field(default_factory=list)
    conditions: list[Condition] = msgspec.field(default_factory=list)


def refresh(beat: Heartbeat, rng: random.Random, now: float) -> None:
    """New sequence, send time and samples, the way an agent's next beat differs."""
    beat.seq += 1
    beat.sent_at = now
    tel = beat.telemetry
    for dev in tel.nvme_latency_us:
        tel.nvme_latency_us[dev] = round(20 + 5 * rng.random(), 1)
    for gpu in tel.gpus:
        gpu.temp_c = round(50 + 20 * rng.random(), 1)
        gpu.util_pct = round(100 * rng.random(), 1)
    tel.clock_offset_ms = round(rng.random(), 3)


async def publisher(url: str, cluster: str, n: int) -> None:
    """Heartbeats for n nodes at 1 Hz each, spread evenly over the second, until SIGTERM.

    Prints a ready line, waits for a line on stdin, sends one beat of every node at once
    (agents that were already running when the coordinator started), then keeps the even
    schedule. One JSON line a second on stdout: cumulative beats sent, worst lateness."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rng = random.Random(7)
    beats = [make_beat(i, n, rng) for i in range(n)]
    subs = [subjects.heartbeat(cluster, b.node) for b in beats]
    size = len(encode(beats[-1]))
    nc = await nats.connect(url, name="bench-publisher", max_reconnect_attempts=-1)
    ranges = [(n * s // SLOTS, n * (s + 1) // SLOTS) for s in range(SLOTS)]
    sent, late_max, k = 0, 0.0, 0
    print(json.dumps({"t": time.time(), "sent": 0, "late_ms": 0.0, "bytes": size}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    start = time.monotonic() + 1.0
    wall = time.time()
    for i, beat in enumerate(beats):
        refresh(beat, rng, wall)
        await nc.publish(subs[i], encode(beat))
    await nc.flush(timeout=30)
    sent = n
    muted: set[int] = set()

    async def commands() -> None:
        # "mute I": node I stops beating (a dead agent), for the node-lost probe.
        # "set I {json}": what node I's agent reports from now on (the ranks it runs, its
        # open conditions), as a real agent's every beat does
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.startswith("mute "):
                muted.add(int(line.split()[1]))
            elif line.startswith("set "):
                _, index, payload = line.split(" ", 2)
                said = msgspec.json.decode(payload, type=AgentSays)
                beat = beats[int(index)]
                beat.ranks, beat.jobs, beat.conditions = said.ranks, said.jobs, said.conditions

    listener = asyncio.create_task(commands())
    print(json.dumps({"t": time.time(), "sent": sent, "late_ms": 0.0, "burst": True}), flush=True)
    while not stop.is_set():
        due = start + k / SLOTS
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
        else:
            late_max = max(late_max, now - due)
        lo, hi = ranges[k % SLOTS]
        wall = time.time()
        for i in range(lo, hi):
            if i in muted:
                continue
            beat = beats[i]
            refresh(beat, rng, wall)
            await nc.publish(subs[i], encode(beat))
            sent += 1
        k += 1
        if k % SLOTS == 0:
            line = {"t": time.time(), "sent": sent, "late_ms": round(late_max * 1000, 1)}
            print(json.dumps(line), flush=True)
            late_max = 0.0
    listener.cancel()
    await nc.flush(timeout=5)
    await nc.close()


# -- the measuring side ---------------------------------------------------------------


@dataclass
class PublisherView:
    """What the publisher said about itself, line by line."""

    lines: list[dict[str, Any]] = field(default_factory=list)
    beat_bytes: int = 0

    def latest(self) -> dict[str, Any]:
        return self.lines[-1] if self.lines else {"t": time.time(), "sent": 0, "late_ms": 0.0}


@dataclass
class FakeAgents:
    """Answers every node's commands like ``nodeagent.commands`` would, and times the
    Pause/Resume commands that the measured events cause."""

    job: str = ""
    launched: set[str] = field(default_factory=set)
    ranks: dict[str, list[RankReport]] = field(default_factory=dict)  # by node
    pending: dict[tuple[str, str], float] = field(default_factory=dict)
    latencies: list[tuple[float, str, float]] = field(default_factory=list)  # (sent, kind, s)
    unmatched: int = 0
    commands: Counter[str] = field(default_factory=Counter)

    async def on_command(self, msg: Msg) -> None:
        received = time.monotonic()
        node = msg.subject.rsplit(".", 1)[-1]
        cmd = command_decoder.decode(msg.data)
        kind = str(type(cmd).__struct_config__.tag)
        self.commands[kind] += 1
        reply = CommandReply(ok=True, node=node, epoch_seen=cmd.epoch)
        if isinstance(cmd, ReservePort):
            reply.port = MASTER_PORT
        elif isinstance(cmd, Launch):
            reply.pids = [100000 + r.rank for r in cmd.ranks]
            self.launched.add(node)
            self.ranks[node] = [
                RankReport(job=cmd.job, rank=r.rank, attempt=cmd.attempt, pid=pid, alive=True)
                for r, pid in zip(cmd.ranks, reply.pids, strict=True)
            ]
        elif isinstance(cmd, Pause | Resume) and cmd.job == self.job:
            # "NVMe <dev> on <node> at … µs" / "NVMe <dev> on <node> back to … µs"
            words = cmd.reason.split()
            device = words[1] if len(words) > 1 else ""
            sent = self.pending.pop((kind, device), None)
            if sent is None:
                self.unmatched += 1
            else:
                self.latencies.append((sent, kind, received - sent))
        await msg.respond(encode(reply))


def classify(
    pending: dict[tuple[str, str], float], master: str, job: JobRecord | None
) -> dict[str, list[str]]:
    """Each event that got no command, as held by the policy (a pause while another reason
    already holds the job paused, a resume while one still does) or lost (a decision never
    made), with the job's state at the end."""
    found: dict[str, list[str]] = {"held": [], "lost": []}
    reasons = list(job.pause_reasons) if job is not None else []
    state = f"{job.state.value}: {job.reason}" if job is not None else "no record"
    for kind, device in sorted(pending, key=lambda k: pending[k]):
        key = condition_key(ConditionKind.NVME_LATENCY, node=master, subject=device)
        others = [r for r in reasons if r != key]
        if kind == "pause" and key in reasons and others:
            found["held"].append(f"pause for {key}: already paused by {others[0]}")
        elif kind == "resume" and key not in reasons and others:
            found["held"].append(f"resume for {key}: still paused by {others[0]}")
        else:
            found["lost"].append(f"{kind} for {key} (job {state}; reasons {reasons})")
    return found


def spike_condition(node: str, device: str, latency_us: float, active: bool) -> Condition:
    """What a real agent's NVMe latch attaches to the spike and recovery events."""
    return Condition(
        kind=ConditionKind.NVME_LATENCY,
        node=node,
        subject=device,
        active=active,
        value=latency_us,
        threshold=100.0 if active else 50.0,
        reason=f"NVMe {device} on {node} at {latency_us:.0f} µs",  # FakeAgents reads the device
    )


@dataclass
class Sample:
    """Readings at one moment of the window."""

    t: float
    coord_cpu: float
    nats_cpu: float
    pub_cpu: float
    self_cpu: float
    busy: tuple[float, float]
    beats: int
    beats_at: float  # the publisher's own time of that count

    @classmethod
    def take(cls, coord: int, server: int, pub: int, view: PublisherView) -> Sample:
        return cls(
            t=time.monotonic(),
            coord_cpu=cpu_seconds(coord),
            nats_cpu=cpu_seconds(server),
            pub_cpu=cpu_seconds(pub),
            self_cpu=cpu_seconds(os.getpid()),
            busy=machine_busy(),
            beats=int(view.latest()["sent"]),
            beats_at=float(view.latest()["t"]),
        )


def beat_rate(a: Sample, b: Sample) -> float:
    """Heartbeats a second between two samples, on the publisher's own clock."""
    return (b.beats - a.beats) / max(b.beats_at - a.beats_at, 1e-9)


def share(a: Sample, b: Sample, attr: str) -> float:
    """% of one core between two samples."""
    return 100.0 * (getattr(b, attr) - getattr(a, attr)) / max(b.t - a.t, 1e-9)


async def read_publisher(stream: asyncio.StreamReader, view: PublisherView) -> None:
    while line := await stream.readline():
        with contextlib.suppress(ValueError):
            data = json.loads(line)
            if "bytes" in data:
                view.beat_bytes = int(data["bytes"])
            view.lines.append(data)


async def wait_for(pred: Any, timeout: float, what: str, step: float = 0.05) -> float:
    """Poll an async or sync predicate; return how long it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        ok = pred()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return time.monotonic() - start
        await asyncio.sleep(step)
    raise TimeoutError(f"{what} not within {timeout:.0f} s")


def warning_lines(path: Path, limit: int = 6) -> list[str]:
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    return [x[:300] for x in lines if "[warning" in x or "[error" in x][:limit]


def grep_count(path: Path, *needles: str) -> int:
    if not path.exists():
        return 0
    text = path.read_text(errors="replace").lower()
    return sum(text.count(n.lower()) for n in needles)


def start_profiler(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        found = shutil.which("py-spy")
        if not found:
            print("  (--profile: py-spy not found; pip install py-spy)", file=sys.stderr)
            return None
        spy = Path(found)
    args = [str(spy), "record", "--pid", str(pid), "--duration", str(int(seconds))]
    args += ["--rate", "100", "--format", "raw", "--nonblocking", "--output", str(out)]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def summarize_profile(path: Path, top: int = 18) -> list[str]:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " " + _where(f) for f in stack.split(";")]
        own[frames[-1]] += n
        # Inclusive time per function (its line numbers folded together).
        for frame in {f.rsplit(":", 1)[0] + ")" for f in frames}:
            incl[frame] += n
    if not total:
        return ["  (no samples)"]
    lines = [f"  {total} samples; self %  inclusive %  function"]
    for frame, n in own.most_common(top):
        whole = incl[frame.rsplit(":", 1)[0] + ")"]
        lines.append(f"  {100 * n / total:6.1f} {100 * whole / total:11.1f}   {frame}")
    lines.append("  -- inclusive, top functions of the coordinator and nats-py:")
    shown = 0
    for frame, n in incl.most_common():
        if any(f"({p}/" in frame or f"/{p}/" in frame for p in ("nats", "coordinator", "proto")):
            lines.append(f"  {'':6} {100 * n / total:11.1f}   {frame}")
            shown += 1
            if shown >= top:
                break
    return lines


def _where(frame: str) -> str:
    inside = frame.split(" (", 1)[1].rstrip(")") if " (" in frame else ""
    inside = inside.replace(str(REPO) + "/", "")
    if "site-packages/" in inside:
        inside = "site-packages/" + inside.split("site-packages/", 1)[1]
    return f"({inside})"


def spawn(argv: list[str], out: Any) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def git_describe() -> str:
    args = ["git", "describe", "--always", "--dirty"]
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO).stdout.strip()


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, default=str))


class TickerDied(RuntimeError):
    """The coordinator stopped writing node records. Seen when nodes register while its
    node-record pass awaits KV writes: ``Coordinator._write_nodes`` iterates
    ``registry.nodes.values()`` across awaits, a new node changes the dict's size, the
    RuntimeError ends ``_ticker`` (unguarded) and with it job ticks and node-lost sweeps.
    The publisher's one-off burst of every node right after the leader's first pass
    avoids the window; a run that still hits it is retried from scratch."""


async def run_size(n: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One full measurement at n nodes; returns the figures."""
    home = root / f"n{n}"
    home.mkdir(parents=True)
    print(f"[{n}] scratch {home}", file=sys.stderr)
    server: NatsServer = start_nats_server(home / "nats")
    coord_log = home / "coordinator.log"
    coord_out = coord_log.open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result: dict[str, Any] = {"nodes": n, "seconds": args.seconds}
    nc: Client | None = None
    pub: asyncio.subprocess.Process | None = None
    coord: subprocess.Popen[bytes] | None = None
    try:
        nc = await nats.connect(server.url, name="bench-capacity")
        leader_seen = asyncio.Event()
        leader_events: list[float] = []

        async def on_leader(msg: Msg) -> None:
            leader_events.append(time.monotonic())
            leader_seen.set()

        lost: Counter[str] = Counter()
        lost_at: dict[str, float] = {}

        async def on_lost(msg: Msg) -> None:
            node = msg.subject.split(".")[3]
            lost[node] += 1
            lost_at.setdefault(node, time.monotonic())

        await nc.subscribe(
            subjects.event(CLUSTER, "cluster", "-", "coordinator.leader"), cb=on_leader
        )
        # a silent node is away after 3 missed beats (found: no new work), lost later
        for kind in ("node.away", "node.lost"):
            await nc.subscribe(subjects.events_filter(CLUSTER, kind=kind), cb=on_lost)
        agents = FakeAgents()
        await nc.subscribe(subjects.command(CLUSTER, "*"), cb=agents.on_command)
        await nc.flush()

        view = PublisherView()
        pub = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SCRIPT),
            "--publisher",
            str(n),
            "--nats",
            server.url,
            "--cluster",
            CLUSTER,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=REPO,
            env=env,
        )
        assert pub.stdout is not None and pub.stdin is not None
        reader = asyncio.create_task(read_publisher(pub.stdout, view))
        await wait_for(lambda: view.beat_bytes > 0, 120, "publisher ready")

        coord = spawn(
            [*COORDINATOR, "--nats", server.url, "--cluster", CLUSTER, "--id", "c0"], coord_out
        )
        await asyncio.wait_for(leader_seen.wait(), 30)
        js = nc.jetstream()
        jobs_kv = await js.key_value(subjects.bucket(CLUSTER, "jobs"))
        # Every node beats once at once, right after the coordinator's first node-record
        # pass (see ``TickerDied``), then once a second.
        pub.stdin.write(b"go\n")
        await pub.stdin.drain()
        await wait_for(lambda: len(view.lines) >= 3, 60, "publisher's first second")
        nodes_stream = "KV_" + subjects.bucket(CLUSTER, "nodes")

        async def all_written() -> bool:
            info = await js.stream_info(nodes_stream)
            return (info.state.messages or 0) >= n

        try:
            took = await wait_for(all_written, args.node_write_timeout, "node records", 0.5)
        except TimeoutError as exc:
            info = await js.stream_info(nodes_stream)
            raise TickerDied(
                f"{info.state.messages} of {n} node records in KV after "
                f"{args.node_write_timeout:.0f} s: the coordinator's ticker is dead or stuck "
                "(job ticks, node-lost sweeps and node records stop with it)"
            ) from exc
        result["all_node_records_s"] = took
        print(f"[{n}] publisher running ({view.beat_bytes} B a beat); warm-up", file=sys.stderr)
        await asyncio.sleep(args.warmup)
        if reader.done():
            raise RuntimeError(f"publisher exited early ({pub.returncode})")

        # A running two-node job: submit, answer ReservePort/Launch, then rank 0's step 1.
        spec = JobSpec(job=JobSection(name="bench", nodes=2))
        t0 = time.monotonic()
        msg = await nc.request(
            subjects.api(CLUSTER, "submit"),
            encode(SubmitJob(spec=spec, workdir=str(home), source="bench")),
            timeout=30,
        )
        reply = api_reply_decoder.decode(msg.data)
        if not reply.ok:
            raise RuntimeError(f"submit refused: {reply.error}")
        agents.job = reply.job
        result["submit_rtt_ms"] = (time.monotonic() - t0) * 1000

        async def job_record() -> Any:
            entry = await jobs_kv.get(agents.job)
            return job_decoder.decode(entry.value) if entry.value else None

        async def launched() -> bool:
            rec = await job_record()
            return rec is not None and rec.state is JobState.STARTING and len(agents.launched) >= 2

        try:
            await wait_for(launched, 120, "job launch", step=0.1)
        except TimeoutError as exc:
            rec = await job_record()
            state = f"{rec.state.value}: {rec.reason}" if rec else "no record"
            raise TimeoutError(f"{exc} (job {state}; commands {dict(agents.commands)})") from exc
        result["submit_to_launch_s"] = time.monotonic() - t0
        record = await job_record()
        master = record.nodes[0]
        open_on_master: dict[str, Condition] = {}

        async def agent_says(node: str) -> None:
            """Node ``node``'s beats from now on report its ranks (alive) and its open
            conditions, as a real agent's do: the coordinator reconciles against them."""
            said = AgentSays(
                ranks=agents.ranks.get(node, []),
                jobs=[agents.job] if node in agents.ranks else [],
                conditions=list(open_on_master.values()) if node == master else [],
            )
            assert pub is not None and pub.stdin is not None
            index = int(node.rsplit("-", 1)[1])
            pub.stdin.write(f"set {index} ".encode() + msgspec.json.encode(said) + b"\n")
            await pub.stdin.drain()

        for node in record.nodes:
            await agent_says(node)
        await js.publish(
            subjects.progress(CLUSTER, agents.job, master),
            encode(
                StepDone(
                    job=agents.job,
                    step=1,
                    time=time.time(),
                    target_steps=200,
                    attempt=record.attempt,
                )
            ),
        )

        async def running() -> bool:
            rec = await job_record()
            return rec is not None and rec.state is JobState.RUNNING

        await wait_for(running, 120, "job running", step=0.1)
        result["submit_to_running_s"] = time.monotonic() - t0
        print(
            f"[{n}] job {agents.job} running on {record.nodes} after "
            f"{result['submit_to_running_s']:.1f} s; measuring {args.seconds:.0f} s",
            file=sys.stderr,
        )

        # The window.
        prof_out = home / "coordinator.pyspy.txt"
        prof = start_profiler(coord.pid, args.seconds, prof_out) if args.profile else None
        lost_before = sum(lost.values())
        first = Sample.take(coord.pid, server.pid, pub.pid, view)
        samples = [first]
        period = 1.0 / args.event_rate
        k = 0
        next_sample = first.t + 5.0
        end = first.t + args.seconds
        while True:
            due = first.t + k * period
            if due >= end:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if coord.poll() is not None:
                raise RuntimeError(f"coordinator exited with {coord.returncode}; see {coord_log}")
            device = f"nvme{100 + k // 2}n1"
            if k % 2 == 0:
                event: NvmeLatencySpike | NvmeLatencyRecovered = NvmeLatencySpike(
                    node=master,
                    severity=Severity.WARNING,
                    device=device,
                    latency_us=850.0,
                    threshold_us=100.0,
                    message=f"{device} at 850 µs",
                    condition=spike_condition(master, device, 850.0, active=True),
                )
                key = ("pause", device)
            else:
                event = NvmeLatencyRecovered(
                    node=master,
                    device=device,
                    latency_us=22.0,
                    threshold_us=50.0,
                    held_s=3.0,
                    message=f"{device} back to 22 µs",
                    condition=spike_condition(master, device, 22.0, active=False),
                )
                key = ("resume", device)
            # the agent's beats carry its latch as it stands, as the event does
            assert event.condition is not None
            if event.condition.active:
                open_on_master[event.condition.key] = event.condition
            else:
                open_on_master.pop(event.condition.key, None)
            await agent_says(master)
            data, subject = encode(event), event_subject(CLUSTER, event)
            agents.pending[key] = time.monotonic()
            await js.publish(subject, data, timeout=10)
            k += 1
            if time.monotonic() >= next_sample:
                samples.append(Sample.take(coord.pid, server.pid, pub.pid, view))
                next_sample += 5.0
        with contextlib.suppress(TimeoutError):
            await wait_for(lambda: not agents.pending, 5, "outstanding commands")
        undecided = classify(agents.pending, master, await job_record())
        last = Sample.take(coord.pid, server.pid, pub.pid, view)
        samples.append(last)
        result["coordinator_rss_mib"] = rss_mib(coord.pid)
        window_lost = sum(lost.values()) - lost_before
        # More than one coordinator.leader event from a lone coordinator: it lost its
        # lease (renewals starved) and took it again.
        result["leader_events"] = len(leader_events)
        # Node-lost probe: one node (not the job's) stops beating; it is found (away, no
        # new work) after 3 missed beats, so ~3 s after its last beat.
        victim = node_name(n - 1, n)
        pub.stdin.write(f"mute {n - 1}\n".encode())
        await pub.stdin.drain()
        muted_at = time.monotonic()
        try:
            await wait_for(lambda: victim in lost_at, args.lost_timeout, "node.away", 0.05)
            result["node_lost_detect_s"] = lost_at[victim] - muted_at
        except TimeoutError:
            result["node_lost_detect_s"] = None
        result["nats_rss_mib"] = rss_mib(server.pid)
        if prof is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                prof.wait(30)
            if prof.poll() is None:
                prof.terminate()

        span = last.t - first.t
        lats = [s for _, _, s in agents.latencies]
        result.update(
            window_s=span,
            coordinator_cpu_pct=share(first, last, "coord_cpu"),
            nats_cpu_pct=share(first, last, "nats_cpu"),
            publisher_cpu_pct=share(first, last, "pub_cpu"),
            bench_cpu_pct=share(first, last, "self_cpu"),
            machine_busy_pct=100.0
            * (last.busy[0] - first.busy[0])
            / max(last.busy[1] - first.busy[1], 1),
            cores=os.cpu_count(),
            beats_per_s=beat_rate(first, last),
            beat_bytes=view.beat_bytes,
            publisher_late_ms_max=max(
                (float(line["late_ms"]) for line in view.lines[2:]), default=0.0
            ),
            events_sent=k,
            decisions=len(lats),
            missing=len(undecided["lost"]),
            held_by_policy=len(undecided["held"]),
            undecided=undecided,
            unmatched=agents.unmatched,
            latency_ms_median=statistics.median(lats) * 1000 if lats else None,
            latency_ms_p99=pct(lats, 99) * 1000 if lats else None,
            latency_ms_max=max(lats) * 1000 if lats else None,
            slowest=[
                f"{kind} {1000 * took:.0f} ms at {sent - first.t:.1f} s"
                for sent, kind, took in sorted(agents.latencies, key=lambda x: -x[2])[:3]
            ],
            node_lost_events=window_lost,
            timeline=[
                {
                    "t_s": round(b.t - first.t, 1),
                    "coordinator_cpu_pct": round(share(a, b, "coord_cpu"), 1),
                    "beats_per_s": round(beat_rate(a, b)),
                    "latency_ms_median": _median_ms(agents.latencies, a.t, b.t),
                    "latency_ms_max": _max_ms(agents.latencies, a.t, b.t),
                }
                for a, b in itertools.pairwise(samples)
            ],
        )
        if prof is not None and prof_out.exists():
            result["profile"] = summarize_profile(prof_out)
        return result
    finally:
        if pub is not None and pub.returncode is None:
            if pub.stdin is not None:
                pub.stdin.close()  # ends the publisher's stdin reader thread
            with contextlib.suppress(ProcessLookupError):
                pub.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pub.wait(), 10)
            if pub.returncode is None:
                pub.kill()
                await pub.wait()
        if coord is not None and coord.poll() is None:
            coord.send_signal(signal.SIGTERM)
            try:
                coord.wait(15)
            except subprocess.TimeoutExpired:
                coord.kill()
                coord.wait()
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        server.stop()
        coord_out.close()
        result["coordinator_log_warnings"] = grep_count(coord_log, "[warning", "[error")
        result["coordinator_slow_consumer"] = grep_count(coord_log, "slow consumer")
        result["nats_slow_consumer"] = grep_count(
            home / "nats" / "nats-server.log", "slow consumer"
        )
        result["coordinator_log"] = str(coord_log)
        result["coordinator_log_lines"] = warning_lines(coord_log)


def _window(lat: list[tuple[float, str, float]], lo: float, hi: float) -> list[float]:
    return [s * 1000 for sent, _, s in lat if lo <= sent < hi]


def _median_ms(lat: list[tuple[float, str, float]], lo: float, hi: float) -> float | None:
    inside = _window(lat, lo, hi)
    return round(statistics.median(inside), 2) if inside else None


def _max_ms(lat: list[tuple[float, str, float]], lo: float, hi: float) -> float | None:
    inside = _window(lat, lo, hi)
    return round(max(inside), 2) if inside else None


def _fmt(value: float | None, unit: str = "ms") -> str:
    return "—" if value is None else f"{value:.1f} {unit}"


def report(r: dict[str, Any]) -> None:
    n = r["nodes"]
    print(f"\n== {n:,} nodes, {r.get('window_s', 0):.0f} s window ==")
    if "error" in r:
        print(f"  FAILED: {r['error']}  (coordinator log: {r['coordinator_log']})")
        return
    rate = r["beats_per_s"]
    rows = [
        ("heartbeats", f"{rate:,.0f}/s of {n:,}/s ({100 * rate / n:.1f} %), {r['beat_bytes']} B"),
        ("publisher lateness", f"max {r['publisher_late_ms_max']:.0f} ms behind its schedule"),
        ("coordinator CPU", f"{r['coordinator_cpu_pct']:.1f} % of one core"),
        ("coordinator RSS", f"{r['coordinator_rss_mib']:.0f} MiB"),
        (
            "event → decision",
            f"median {_fmt(r['latency_ms_median'])}, p99 {_fmt(r['latency_ms_p99'])}, "
            f"max {_fmt(r['latency_ms_max'])} (n={r['decisions']} of {r['events_sent']}, "
            f"held by policy {r['held_by_policy']}, lost {r['missing']}, "
            f"unmatched {r['unmatched']})",
        ),
        ("  slowest", "; ".join(r.get("slowest", [])) or "none"),
        *[("  not decided", line) for line in (r["undecided"]["lost"][:5])],
        (
            "node records",
            f"all {n:,} in KV {r['all_node_records_s']:.1f} s after the burst "
            f"(attempt {r.get('attempts', 1)})",
        ),
        (
            "job start",
            f"submit→launch {r['submit_to_launch_s']:.1f} s, →running "
            f"{r['submit_to_running_s']:.1f} s (submit RTT {r['submit_rtt_ms']:.0f} ms)",
        ),
        ("nats-server", f"{r['nats_cpu_pct']:.1f} % CPU, {r['nats_rss_mib']:.0f} MiB"),
        ("publisher", f"{r['publisher_cpu_pct']:.1f} % CPU"),
        ("this script", f"{r['bench_cpu_pct']:.1f} % CPU"),
        ("machine", f"{r['machine_busy_pct']:.0f} % busy of {r['cores']} cores (all users)"),
        ("node.away/lost events", f"{r['node_lost_events']} during the window"),
        (
            "leadership",
            f"{r['leader_events']} coordinator.leader events for one coordinator"
            + (" (it lost its lease and retook it)" if r["leader_events"] > 1 else ""),
        ),
        (
            "node-lost probe",
            "a silenced node found (node.away) "
            + (
                f"{r['node_lost_detect_s']:.1f} s after its agent stopped (spec: ~3 s)"
                if r.get("node_lost_detect_s") is not None
                else "NEVER within the probe timeout"
            ),
        ),
        (
            "log warnings",
            f"coordinator {r['coordinator_log_warnings']} "
            f"(slow consumer {r['coordinator_slow_consumer']}), "
            f"nats slow consumer {r['nats_slow_consumer']}",
        ),
    ]
    for name, value in rows:
        print(f"  {name:<20} {value}")
    for line in r.get("coordinator_log_lines", []):
        print(f"    log: {line}")
    print("  timeline:  t(s)  coord CPU %   beats/s   lat median   lat max")
    for row in r["timeline"]:
        print(
            f"           {row['t_s']:5.0f}  {row['coordinator_cpu_pct']:10.1f}  "
            f"{row['beats_per_s']:8,d}  {_fmt(row['latency_ms_median']):>11}  "
            f"{_fmt(row['latency_ms_max']):>9}"
        )
    if "profile" in r:
        print("  py-spy profile of the coordinator during the window:")
        print("\n".join(r["profile"]))


def verdict(results: list[dict[str, Any]]) -> None:
    print("\n== summary ==")
    print("  nodes    beats/s   coord CPU %   RSS MiB   p50 ms   p99 ms   machine busy %")
    for r in results:
        if "error" in r:
            print(f"  {r['nodes']:>6,}   failed: {r['error']}")
            continue
        print(
            f"  {r['nodes']:>6,}  {r['beats_per_s']:8,.0f}  {r['coordinator_cpu_pct']:11.1f}  "
            f"{r['coordinator_rss_mib']:8.0f}  {r['latency_ms_median'] or 0:7.1f}  "
            f"{r['latency_ms_p99'] or 0:7.1f}  {r['machine_busy_pct']:14.0f}"
        )
    for r in results:
        if "error" in r or r["nodes"] < 10_000:
            continue
        checks = {
            "publisher sustained N/s (≥ 99 %)": r["beats_per_s"] >= 0.99 * r["nodes"],
            "coordinator CPU < 60 % of one core": r["coordinator_cpu_pct"] < CPU_TARGET_PCT,
            "p99 ≤ 50 ms": (r["latency_ms_p99"] or 1e9) <= 50.0 and r["missing"] == 0,
            "silenced node lost within 5 s": (r.get("node_lost_detect_s") or 1e9) <= 5.0,
            "leadership held throughout": r["leader_events"] == 1,
        }
        for name, ok in checks.items():
            print(f"  {r['nodes']:,} nodes: {name}: {'PASS' if ok else 'FAIL'}")


async def orchestrate(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="rm-capacity-"))
    describe = git_describe()
    print(
        f"coordinator capacity on {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
        f"tree {describe}, scratch {root}",
        file=sys.stderr,
    )
    results = []
    for n in args.nodes:
        r: dict[str, Any] = {}
        for attempt in range(1, args.attempts + 1):
            try:
                r = await run_size(n, args, root / f"try{attempt}")
                r["attempts"] = attempt
                break
            except TickerDied as exc:
                r = {"nodes": n, "error": repr(exc), "coordinator_log": str(root)}
                print(f"[{n}] attempt {attempt}: {exc}", file=sys.stderr)
            except Exception as exc:
                r = {"nodes": n, "error": repr(exc), "coordinator_log": str(root)}
                break
        results.append(r)
        report(r)
    verdict(results)
    if args.json:
        write_json(Path(args.json), results)
    if args.keep or any("error" in r for r in results):
        print(f"kept {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all("error" not in r for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, nargs="+", default=[1000, 10_000])
    p.add_argument("--seconds", type=float, default=60.0, help="measurement window per size")
    p.add_argument("--warmup", type=float, default=10.0, help="heartbeats before the job")
    p.add_argument("--event-rate", type=float, default=2.0, help="NVMe events a second")
    p.add_argument("--profile", action="store_true", help="py-spy the coordinator")
    p.add_argument("--lost-timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    p.add_argument("--attempts", type=int, default=3, help="tries when the ticker dies")
    p.add_argument("--node-write-timeout", type=float, default=90.0, help=argparse.SUPPRESS)
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--publisher", type=int, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--nats", help=argparse.SUPPRESS)
    p.add_argument("--cluster", default=CLUSTER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.publisher:
        asyncio.run(publisher(args.nats, args.cluster, args.publisher))
        return 0
    return asyncio.run(orchestrate(args))


if __name__ == "__main__":
    sys.exit(main())
