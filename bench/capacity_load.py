"""The load of ``bench/coordinator_capacity.py``, each part its own process: heartbeat
publishers that play the nodes' agents, and the floor consumer the coordinator's cost is
divided by. Not run by hand; the bench starts them (``--publisher`` / ``--floor``).

**Publisher** (part ``k`` of ``parts``: the nodes ``i`` with ``i % parts == k``): a
``proto.node.Heartbeat`` with realistic telemetry (2–4 NVMe latencies, 8 GPU samples,
9 collector statuses) for each of its nodes every second, spread over 100 slots of 10 ms.
Each node's beat is encoded once, its sequence number and send time in fixed-width slots
padded with blanks (JSON allows blanks after a value); a beat then costs patching those
bytes and nats-py's ``publish``, whose buffer reaches the socket once a slot, when the
publisher sleeps. What an agent's beats say that changes during a run (its ranks, the
launches it carried out, its open conditions) re-encodes that node's beat when the bench
says so on stdin. The telemetry's values stay those of the first beat: the coordinator
keeps a beat's telemetry as raw JSON until a node record is written (``NodeBeat``), so its
cost does not depend on them. Several parts keep the schedule on a small machine where
one process alone is descheduled long enough to fall behind.

Stdin: ``go`` (send every node's beat at once, then keep the schedule), ``mute I`` (node
I's agent is dead), ``set I {json}`` (:class:`AgentSays`: node I's beats from now on).
Stdout, one JSON line a second: beats sent so far, the worst lateness in that second.

**Floor**: a plain subscriber to every heartbeat that decodes each one as the coordinator
does (``proto.codec.node_beat_decoder``) and does nothing else. Its CPU per beat is the
least any Python consumer of these beats on nats-py can spend; the coordinator's is
reported as a multiple of it. Stdout, one JSON line a second: beats decoded so far.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time

import msgspec
import nats
from nats.aio.msg import Msg

from proto import subjects
from proto.codec import encode, node_beat_decoder
from proto.conditions import Condition
from proto.node import CollectorStatus, GpuSample, Heartbeat, RankReport, Telemetry

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
WIDTH = 20  # bytes of the sequence number's and of the send time's slots


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
            gpus=tuple(
                GpuSample(
                    index=g,
                    temp_c=round(50 + 20 * rng.random(), 1),
                    util_pct=round(100 * rng.random(), 1),
                    mem_used_mb=round(60000 + 20000 * rng.random(), 0),
                )
                for g in range(8)
            ),
            clock_offset_ms=round(rng.random(), 3),
        ),
        collectors=tuple(
            CollectorStatus(name=c, ok=True, duration_s=round(0.01 * rng.random(), 4))
            for c in COLLECTORS
        ),
        launched={},
        started_at=1.0,
    )


class AgentSays(msgspec.Struct):
    """The part of a node's beats that follows what happens to it during the run."""

    ranks: list[RankReport] = msgspec.field(default_factory=list)
    jobs: list[str] = msgspec.field(default_factory=list)
    conditions: list[Condition] = msgspec.field(default_factory=list)
    launched: dict[str, int] = msgspec.field(default_factory=dict)


class Encoded:
    """One node's beat as bytes, patched in place for each send."""

    __slots__ = ("beat", "data", "sent_at", "seq", "seq_at")

    def __init__(self, beat: Heartbeat) -> None:
        self.beat, self.seq = beat, 0
        self.encode()

    def encode(self) -> None:
        self.beat.seq, self.beat.sent_at = 0, 0.0
        raw = encode(self.beat)
        raw = raw.replace(b'"seq":0,', b'"seq":' + b"0".ljust(WIDTH) + b",", 1)
        raw = raw.replace(b'"sent_at":0.0,', b'"sent_at":' + b"0".ljust(WIDTH) + b",", 1)
        self.data = bytearray(raw)
        self.seq_at = raw.index(b'"seq":') + 6
        self.sent_at = raw.index(b'"sent_at":') + 10

    def next(self, stamp: bytes) -> bytes:
        """The next beat, sent at ``stamp`` (``WIDTH`` bytes)."""
        self.seq += 1
        self.data[self.seq_at : self.seq_at + WIDTH] = b"%-20d" % self.seq
        self.data[self.sent_at : self.sent_at + WIDTH] = stamp
        return bytes(self.data)


def stamp_now() -> bytes:
    return b"%-20.6f" % time.time()


def say(line: dict[str, object]) -> None:
    print(json.dumps({"t": time.time(), **line}), flush=True)


async def publisher(url: str, cluster: str, n: int, part: int, parts: int) -> None:
    """Heartbeats for this part's nodes at 1 Hz each, evenly over the second, until
    SIGTERM (see the module's doc)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rng = random.Random(7 + part)
    mine = range(part, n, parts)
    beats = {i: Encoded(make_beat(i, n, rng)) for i in mine}
    subs = {i: subjects.heartbeat(cluster, node_name(i, n)) for i in mine}
    slots = [
        [i for i in range(n * s // SLOTS, n * (s + 1) // SLOTS) if i % parts == part]
        for s in range(SLOTS)
    ]
    nc = await nats.connect(
        url,
        name=f"bench-publisher-{part}",
        max_reconnect_attempts=-1,
        skip_subject_validation=True,
    )
    size = max((len(b.data) for b in beats.values()), default=0)
    say({"sent": 0, "late_ms": 0.0, "bytes": size})
    await loop.run_in_executor(None, sys.stdin.readline)
    start = time.monotonic() + 1.0
    stamp = stamp_now()
    for i, beat in beats.items():
        await nc.publish(subs[i], beat.next(stamp))
    await nc.flush(timeout=30)
    sent, late_max, k = len(beats), 0.0, 0
    muted: set[int] = set()

    async def commands() -> None:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.startswith("mute "):
                muted.add(int(line.split()[1]))
            elif line.startswith("set "):
                _, index, payload = line.split(" ", 2)
                said = msgspec.json.decode(payload, type=AgentSays)
                beat = beats[int(index)]
                b = beat.beat
                b.ranks, b.jobs = tuple(said.ranks), tuple(said.jobs)
                b.conditions, b.launched = tuple(said.conditions), said.launched
                beat.encode()

    listener = asyncio.create_task(commands())
    say({"sent": sent, "late_ms": 0.0, "burst": True})
    while not stop.is_set():
        due = start + k / SLOTS
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
        else:
            late_max = max(late_max, now - due)
        stamp = stamp_now()
        for i in slots[k % SLOTS]:
            if i not in muted:
                await nc.publish(subs[i], beats[i].next(stamp))
                sent += 1
        k += 1
        if k % SLOTS == 0:
            say({"sent": sent, "late_ms": round(late_max * 1000, 1)})
            late_max = 0.0
    listener.cancel()
    await nc.flush(timeout=5)
    await nc.close()


async def floor(url: str, cluster: str) -> None:
    """Decode every heartbeat, nothing else, until SIGTERM; count them once a second."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    got = 0

    async def on_beat(msg: Msg) -> None:
        nonlocal got
        node_beat_decoder.decode(msg.data)
        got += 1

    nc = await nats.connect(url, name="bench-floor", max_reconnect_attempts=-1)
    await nc.subscribe(subjects.heartbeats(cluster), cb=on_beat)
    await nc.flush()
    say({"got": 0})
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            say({"got": got})
    await nc.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nats", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--publisher", type=int, metavar="N", help="nodes in all")
    p.add_argument("--part", default="0/1", help="K/PARTS: this publisher's share")
    p.add_argument("--floor", action="store_true")
    args = p.parse_args()
    if args.floor:
        asyncio.run(floor(args.nats, args.cluster))
        return 0
    part, parts = (int(x) for x in args.part.split("/"))
    asyncio.run(publisher(args.nats, args.cluster, args.publisher, part, parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
