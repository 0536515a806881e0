"""Coordinator capacity: one real coordinator under 1 Hz heartbeats from N simulated nodes,
measured for CPU, memory and event → decision latency, and against a floor consumer of the
same beats (not a test).

    .venv/bin/python bench/coordinator_capacity.py [--nodes 1000 10000] [--seconds 60]
        [--warmup 10] [--event-rate 2] [--publishers 2] [--profile] [--json OUT.json]

For each size the script starts a fresh nats-server (``start_nats_server``), one
coordinator process (``python -m coordinator.cli --cluster bench --id c0``), the floor
consumer and ``--publishers`` publisher processes that send every node's heartbeat once a
second (``bench/capacity_load.py`` describes both); each publisher reports how many beats
it sent and how far behind its schedule it fell.

This process plays the node agent of every node (it answers ``cmd.*`` like
``nodeagent.commands``: ok, ReservePort → 12345; a launch's ranks reach that node's beats
together with the attempt, which names them as launched, as a real agent's beats do once it
has carried the launch out), submits a two-node job, sends rank 0's first ``StepDone``
through JetStream so the job is running, then, for ``--seconds``, publishes with JetStream
``nvme.latency_spike`` / ``nvme.latency_recovered`` alternately for the job's master node
(a fresh device per pair, so each spike opens the only pause reason and its recovery
closes it). Decision latency runs from just before ``js.publish`` to the moment the fake
agent receives the resulting Pause / Resume command.

**What it leads with**, because it holds on any machine: the coordinator's CPU per beat
divided by the floor's (utime+stime from ``/proc/<pid>/stat`` of each process over the
same window, each divided by the beats it took), and decision latency with whether the
machine had a whole core idle meanwhile. Targets: within 3× the floor at 25,000 nodes,
p99 ≤ 50 ms whenever a core is spare. Then the absolute figures: the coordinator's % of
one core (and this machine's 60 % target), RSS, nats-server's and the publishers' CPU,
the machine's busy share, a silenced node found within 5 s, leadership held.

**Valid or not.** A run whose publishers did not keep the schedule over the window (under
98 % of N beats a second, or one of them more than 500 ms behind it), or whose floor
decoded under 98 % of the beats, measured the machine rather than the coordinator: it is
marked INVALID in the output and in the JSON (``valid``, ``invalid_because``), and gets no
verdict.

Exit code: 0 every size ran and is valid; 3 a size's run is INVALID (its figures are
printed, not to be quoted as the coordinator's); 1 a size failed to run; 2 bad usage.
Targets missed are printed as FAIL and leave the exit code alone.

``--profile`` samples the coordinator with py-spy during the window where py-spy is
installed, else runs it under cProfile (which slows it: read shares, not times), and
prints its hottest functions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.capacity_load import AgentSays, node_name
from bench.capacity_report import (
    exit_code,
    invalid_because,
    report,
    summarize_cprofile,
    summarize_pyspy,
    verdict,
)
from coordinator.embedded_nats import NatsServer, start_nats_server
from proto import subjects
from proto.api import SubmitJob
from proto.codec import api_reply_decoder, command_decoder, encode, job_decoder
from proto.commands import CommandReply, Launch, Pause, ReservePort, Resume
from proto.conditions import Condition, ConditionKind, condition_key
from proto.events import NvmeLatencyRecovered, NvmeLatencySpike, Severity
from proto.job import JobRecord, JobSection, JobSpec, JobState
from proto.node import RankReport
from proto.progress import StepDone
from ringmaster.bus import event_subject

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]
COORDINATOR = [sys.executable, "-m", "coordinator.cli"]
LOAD = [sys.executable, "-m", "bench.capacity_load"]
CLUSTER = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
MASTER_PORT = 12345


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


def loadavg() -> str:
    """The load averages and run queue as the kernel has them (``/proc/loadavg``)."""
    return Path("/proc/loadavg").read_text().strip()


def pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


# -- the measuring side ---------------------------------------------------------------


@dataclass
class LoadView:
    """What one load process (a publisher, or the floor) said about itself, line by line."""

    lines: list[dict[str, Any]] = field(default_factory=list)
    beat_bytes: int = 0

    def count(self) -> tuple[int, float]:
        """Beats sent (or decoded) so far, and the process's own time of that count."""
        last = self.lines[-1] if self.lines else {"t": time.time()}
        return int(last.get("sent", last.get("got", 0))), float(last["t"])


@dataclass
class FakeAgents:
    """Answers every node's commands like ``nodeagent.commands`` would, and times the
    Pause/Resume commands that the measured events cause. What a node's agent reports in
    its beats (its ranks, the launches it carried out, its open conditions) is kept here
    and handed to its publisher by ``tell``: a launch's ranks and its attempt together,
    before the launch is answered, as an agent's own table has them."""

    job: str = ""
    launched: dict[str, dict[str, int]] = field(default_factory=dict)  # node → job → attempt
    ranks: dict[str, list[RankReport]] = field(default_factory=dict)  # by node
    conditions: dict[str, dict[str, Condition]] = field(default_factory=dict)  # node → open
    tell: Callable[[str], Awaitable[None]] | None = None  # a node's beats from now on
    pending: dict[tuple[str, str], float] = field(default_factory=dict)
    latencies: list[tuple[float, str, float]] = field(default_factory=list)  # (sent, kind, s)
    unmatched: int = 0
    commands: Counter[str] = field(default_factory=Counter)

    def says(self, node: str) -> AgentSays:
        return AgentSays(
            ranks=self.ranks.get(node, []),
            jobs=[self.job] if node in self.ranks else [],
            conditions=list(self.conditions.get(node, {}).values()),
            launched=self.launched.get(node, {}),
        )

    async def on_command(self, msg: Msg) -> None:
        received = time.monotonic()
        node = msg.subject.rsplit(".", 1)[-1]
        cmd = command_decoder.decode(msg.data)
        kind = str(type(cmd).__struct_config__.tag)
        self.commands[kind] += 1
        reply = CommandReply(
            ok=True, node=node, epoch_seen=cmd.epoch, sent_at=time.time(), started_at=1.0
        )
        if isinstance(cmd, ReservePort):
            reply.port = MASTER_PORT
        elif isinstance(cmd, Launch):
            reply.pids = [100000 + r.rank for r in cmd.ranks]
            self.ranks[node] = [
                RankReport(job=cmd.job, rank=r.rank, attempt=cmd.attempt, pid=pid, alive=True)
                for r, pid in zip(cmd.ranks, reply.pids, strict=True)
            ]
            self.launched.setdefault(node, {})[cmd.job] = cmd.attempt
            if self.tell is not None:
                await self.tell(node)
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
    wall: float
    coord_cpu: float
    nats_cpu: float
    pub_cpu: float  # all the publishers'
    floor_cpu: float
    self_cpu: float
    busy: tuple[float, float]
    beats: tuple[tuple[int, float], ...]  # each publisher's count, on its own clock
    floor: tuple[int, float]

    @classmethod
    def take(cls, coord: int, server: int, pubs: list[int], floor: int, load: Load) -> Sample:
        return cls(
            t=time.monotonic(),
            wall=time.time(),
            coord_cpu=cpu_seconds(coord),
            nats_cpu=cpu_seconds(server),
            pub_cpu=sum(cpu_seconds(p) for p in pubs),
            floor_cpu=cpu_seconds(floor),
            self_cpu=cpu_seconds(os.getpid()),
            busy=machine_busy(),
            beats=tuple(v.count() for v in load.publishers),
            floor=load.floor.count(),
        )


def _rate(a: tuple[int, float], b: tuple[int, float]) -> float:
    return (b[0] - a[0]) / max(b[1] - a[1], 1e-9)


def beat_rate(a: Sample, b: Sample) -> float:
    """Heartbeats a second between two samples, each publisher on its own clock."""
    return sum(_rate(x, y) for x, y in zip(a.beats, b.beats, strict=True))


def floor_rate(a: Sample, b: Sample) -> float:
    return _rate(a.floor, b.floor)


def share(a: Sample, b: Sample, attr: str) -> float:
    """% of one core between two samples."""
    return 100.0 * (getattr(b, attr) - getattr(a, attr)) / max(b.t - a.t, 1e-9)


def per_beat_us(a: Sample, b: Sample, attr: str, rate: float) -> float:
    """CPU µs a beat between two samples, of beats taken at ``rate`` a second."""
    return 1e6 * (getattr(b, attr) - getattr(a, attr)) / max(rate * (b.t - a.t), 1e-9)


async def read_lines(stream: asyncio.StreamReader, view: LoadView) -> None:
    while line := await stream.readline():
        with contextlib.suppress(ValueError):
            data = json.loads(line)
            if "bytes" in data:
                view.beat_bytes = int(data["bytes"])
            view.lines.append(data)


@dataclass
class Load:
    """The publisher processes and the floor consumer, as started for one size."""

    publishers: list[LoadView] = field(default_factory=list)
    floor: LoadView = field(default_factory=LoadView)
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)  # floor last
    readers: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def start(cls, url: str, n: int, parts: int) -> Load:
        load = cls()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for argv, view in [
            *[
                (["--publisher", str(n), "--part", f"{k}/{parts}"], LoadView())
                for k in range(parts)
            ],
            (["--floor"], load.floor),
        ]:
            proc = await asyncio.create_subprocess_exec(
                *LOAD,
                *argv,
                "--nats",
                url,
                "--cluster",
                CLUSTER,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                cwd=REPO,
                env=env,
            )
            assert proc.stdout is not None
            load.procs.append(proc)
            load.readers.append(asyncio.create_task(read_lines(proc.stdout, view)))
            if view is not load.floor:
                load.publishers.append(view)
        return load

    @property
    def publisher_pids(self) -> list[int]:
        return [p.pid for p in self.procs[:-1]]

    @property
    def floor_pid(self) -> int:
        return self.procs[-1].pid

    @property
    def beat_bytes(self) -> int:
        return max((v.beat_bytes for v in self.publishers), default=0)

    def ready(self) -> bool:
        return all(v.beat_bytes > 0 for v in self.publishers) and bool(self.floor.lines)

    def died(self) -> bool:
        return any(r.done() for r in self.readers)

    async def to(self, node: int | None, line: bytes) -> None:
        """A line to the publisher of node index ``node`` (None: to every publisher)."""
        parts = self.procs[:-1]
        for proc in parts if node is None else [parts[node % len(parts)]]:
            assert proc.stdin is not None
            proc.stdin.write(line)
            await proc.stdin.drain()

    def late_ms_max(self, since: float, until: float) -> float:
        """The worst lateness any publisher reported for the seconds between two wall
        times (each line tells of the second before it)."""
        return max(
            (
                float(line["late_ms"])
                for v in self.publishers
                for line in v.lines[2:]
                if since < line["t"] <= until + 1.0
            ),
            default=0.0,
        )

    async def stop(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                if proc.stdin is not None:
                    proc.stdin.close()  # ends a publisher's stdin reader thread
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


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


def start_pyspy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        found = shutil.which("py-spy")
        if not found:
            return None
        spy = Path(found)
    args = [str(spy), "record", "--pid", str(pid), "--duration", str(int(seconds))]
    args += ["--rate", "100", "--format", "raw", "--nonblocking", "--output", str(out)]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


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
    load_at_start = loadavg()
    server: NatsServer = start_nats_server(home / "nats")
    coord_log = home / "coordinator.log"
    coord_out = coord_log.open("wb")
    result: dict[str, Any] = {"nodes": n, "seconds": args.seconds, "load_at_start": load_at_start}
    nc: Client | None = None
    load: Load | None = None
    coord: subprocess.Popen[bytes] | None = None
    cprofile = home / "coordinator.cprofile"
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

        load = await Load.start(server.url, n, args.publishers)
        await wait_for(load.ready, 120, "publishers and floor ready")

        async def tell(node: str) -> None:
            """Node ``node``'s beats from now on say what its agent does."""
            assert load is not None
            said = msgspec.json.encode(agents.says(node))
            index = int(node.rsplit("-", 1)[1])
            await load.to(index, f"set {index} ".encode() + said + b"\n")

        agents.tell = tell
        spy = shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists()
        under = ["-m", "cProfile", "-o", str(cprofile)] if args.profile and not spy else []
        argv = [COORDINATOR[0], *under, *COORDINATOR[1:], "--nats", server.url]
        coord = spawn([*argv, "--cluster", CLUSTER, "--id", "c0"], coord_out)
        await asyncio.wait_for(leader_seen.wait(), 30)
        js = nc.jetstream()
        jobs_kv = await js.key_value(subjects.bucket(CLUSTER, "jobs"))
        # Every node beats once at once, right after the coordinator's first node-record
        # pass (see ``TickerDied``), then once a second.
        await load.to(None, b"go\n")
        await wait_for(
            lambda: all(len(v.lines) >= 3 for v in load.publishers), 60, "publishers' first second"
        )
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
        print(f"[{n}] publishers running ({load.beat_bytes} B a beat); warm-up", file=sys.stderr)
        await asyncio.sleep(args.warmup)
        if load.died():
            raise RuntimeError("a publisher or the floor exited early")

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
        prof = start_pyspy(coord.pid, args.seconds, prof_out) if args.profile and spy else None
        lost_before = sum(lost.values())

        def take() -> Sample:
            assert coord is not None and load is not None
            return Sample.take(coord.pid, server.pid, load.publisher_pids, load.floor_pid, load)

        first = take()
        samples = [first]
        period = 1.0 / args.event_rate
        k = 0
        next_sample = first.t + 5.0
        end = first.t + args.seconds
        open_on_master = agents.conditions.setdefault(master, {})
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
            await tell(master)
            data, subject = encode(event), event_subject(CLUSTER, event)
            agents.pending[key] = time.monotonic()
            await js.publish(subject, data, timeout=10)
            k += 1
            if time.monotonic() >= next_sample:
                samples.append(take())
                next_sample += 5.0
        with contextlib.suppress(TimeoutError):
            await wait_for(lambda: not agents.pending, 5, "outstanding commands")
        undecided = classify(agents.pending, master, await job_record())
        last = take()
        samples.append(last)
        result["coordinator_rss_mib"] = rss_mib(coord.pid)
        window_lost = sum(lost.values()) - lost_before
        # More than one coordinator.leader event from a lone coordinator: it lost its
        # lease (renewals starved) and took it again.
        result["leader_events"] = len(leader_events)
        # Node-lost probe: one node (not the job's) stops beating; it is found (away, no
        # new work) after 3 missed beats, so ~3 s after its last beat.
        victim = node_name(n - 1, n)
        await load.to(n - 1, f"mute {n - 1}\n".encode())
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
        rate, floor = beat_rate(first, last), floor_rate(first, last)
        coordinator_us = per_beat_us(first, last, "coord_cpu", rate)
        floor_us = per_beat_us(first, last, "floor_cpu", floor)
        result.update(
            window_s=span,
            coordinator_cpu_pct=share(first, last, "coord_cpu"),
            nats_cpu_pct=share(first, last, "nats_cpu"),
            publisher_cpu_pct=share(first, last, "pub_cpu"),
            floor_cpu_pct=share(first, last, "floor_cpu"),
            bench_cpu_pct=share(first, last, "self_cpu"),
            machine_busy_pct=100.0
            * (last.busy[0] - first.busy[0])
            / max(last.busy[1] - first.busy[1], 1),
            cores=os.cpu_count(),
            publishers=args.publishers,
            beats_per_s=rate,
            floor_beats_per_s=floor,
            coordinator_us_per_beat=coordinator_us,
            floor_us_per_beat=floor_us,
            ratio_to_floor=coordinator_us / max(floor_us, 1e-9),
            publisher_us_per_beat=per_beat_us(first, last, "pub_cpu", rate),
            beat_bytes=load.beat_bytes,
            publisher_late_ms_max=load.late_ms_max(first.wall, last.wall),
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
        result["invalid_because"] = invalid_because(result)
        result["valid"] = not result["invalid_because"]
        if prof is not None and prof_out.exists():
            result["profile"] = summarize_pyspy(prof_out, REPO)
        return result
    finally:
        if load is not None:
            await load.stop()
        if coord is not None and coord.poll() is None:
            coord.send_signal(signal.SIGTERM)
            try:
                coord.wait(30)
            except subprocess.TimeoutExpired:
                coord.kill()
                coord.wait()
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        server.stop()
        coord_out.close()
        if cprofile.exists() and "nodes" in result:
            result["profile"] = summarize_cprofile(cprofile)
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
    return exit_code(results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, nargs="+", default=[1000, 10_000])
    p.add_argument("--seconds", type=float, default=60.0, help="measurement window per size")
    p.add_argument("--warmup", type=float, default=10.0, help="heartbeats before the job")
    p.add_argument("--event-rate", type=float, default=2.0, help="NVMe events a second")
    p.add_argument("--publishers", type=int, default=2, help="publisher processes")
    p.add_argument("--profile", action="store_true", help="profile the coordinator")
    p.add_argument("--lost-timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    p.add_argument("--attempts", type=int, default=3, help="tries when the ticker dies")
    p.add_argument("--node-write-timeout", type=float, default=90.0, help=argparse.SUPPRESS)
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if min(args.nodes) < 2 or args.publishers < 1 or args.seconds <= 0:
        p.error("--nodes must be at least 2, --publishers at least 1, --seconds positive")
    return asyncio.run(orchestrate(args))


if __name__ == "__main__":
    sys.exit(main())
