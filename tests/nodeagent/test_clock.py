"""The clock collector on this machine's kernel, a stand-in chronyc, a real nats-server for
the offset to the coordinator, the resync command, and the drift detector."""

from __future__ import annotations

import asyncio
import ctypes
import time
from pathlib import Path
from typing import Any

import nats
import pytest

from nodeagent.collectors.base import Sample
from nodeagent.collectors.clock import STATES, ClockCollector, Timex, parse_tracking, read_adjtimex
from nodeagent.collectors.clock_peer import PeerClock, serve
from nodeagent.detectors.clock import ClockDriftDetector
from nodeagent.sim.node import SimulatedNode
from proto.events import ClockDrift

# chronyc -c tracking on a synchronised EC2 node and on one whose chronyd lost its sources.
CHRONY = Path(__file__).resolve().parent.parent / "fixtures" / "chrony"
SYNCED = (CHRONY / "tracking_synced.csv").read_text()
UNSYNCED = (CHRONY / "tracking_unsynced.csv").read_text()


def fake_chronyc(tmp_path: Path, output: str, code: int = 0) -> list[str]:
    script = tmp_path / "chronyc"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\nprintf %s "{output.strip()}"\n'
        f'[ {code} -eq 0 ] || echo "506 Cannot talk to daemon" >&2\nexit {code}\n'
    )
    script.chmod(0o755)
    return [str(script), "-c", "tracking"]


def test_adjtimex_reads_this_kernel_unprivileged_layout() -> None:
    assert ctypes.sizeof(Timex) == 208  # the kernel's struct timex on 64-bit Linux
    reading = read_adjtimex()
    assert reading["state"] in STATES
    assert reading["synced"] == (reading["state"] != "TIME_ERROR" and not reading["status"] & 0x40)
    assert reading["max_error_ms"] >= 0


def test_chrony_tracking_lines() -> None:
    synced = parse_tracking(SYNCED)
    assert synced["offset_ms"] == pytest.approx(0.812345)  # the clock is fast: chrony slews back
    assert synced["bound_ms"] == pytest.approx(0.234567 / 2 + 0.123456)
    assert (synced["reference"], synced["stratum"], synced["synced"]) == (
        "169.254.169.123",
        4,
        True,
    )
    unsynced = parse_tracking(UNSYNCED)
    assert unsynced["synced"] is False and unsynced["reference"] == "00000000"
    with pytest.raises(ValueError, match="expected 14 fields"):
        parse_tracking("506 Cannot talk to daemon")


def test_chrony_is_the_source_and_is_read_at_its_own_pace(tmp_path: Path) -> None:
    clock = ClockCollector(
        peer=PeerClock(), use_adjtimex=False, chronyc=fake_chronyc(tmp_path, SYNCED)
    )
    first = clock.collect(0.0).values
    assert (first["source"], first["synced"]) == ("chrony", True)
    assert first["offset_ms"] == pytest.approx(0.812345)
    clock.collect(1.0)
    assert (tmp_path / "calls").read_text() == "-c tracking\n", "reused for chrony_interval_s"


def test_chronyd_down_or_unsynchronised(tmp_path: Path) -> None:
    down = ClockCollector(
        peer=PeerClock(), use_adjtimex=False, chronyc=fake_chronyc(tmp_path, "", code=1)
    )
    values = down.collect(0.0).values
    assert values["chrony"] is None and values["chrony_error"] == "506 Cannot talk to daemon"
    assert (values["source"], values["offset_ms"], values["synced"]) == ("none", None, True)
    lost = ClockCollector(
        peer=PeerClock(), use_adjtimex=False, chronyc=fake_chronyc(tmp_path, UNSYNCED)
    )
    assert lost.collect(0.0).values["synced"] is False
    absent = ClockCollector(peer=PeerClock(), use_adjtimex=False, chronyc=["no-chronyc-here"])
    assert absent.collect(0.0).values["chrony_error"] == "no no-chronyc-here"


def test_skew_file_of_a_simulated_node(tmp_path: Path) -> None:
    node = SimulatedNode(tmp_path / "node-0", "node-0", nvme_devices=1)
    clock = ClockCollector(peer=PeerClock(), use_adjtimex=False, skew_file=node.skew_file)
    assert clock.collect(0.0).values["offset_ms"] == 0.0
    node.apply("clock-offset=-12.5")
    assert node.faults() == ["clock-offset=-12.5"]
    values = clock.collect(1.0).values
    assert (values["offset_ms"], values["source"], values["skew_ms"]) == (-12.5, "skew_file", -12.5)
    node.skew_file.unlink()  # what the resync command does on a simulated node
    node.tick(0.1)
    assert node.faults() == []


async def probe(url: str, server_skew_s: float, local_skew_file: Path | None) -> dict[str, Any]:
    """An agent's PeerClock against a responder whose clock is ``server_skew_s`` ahead."""
    responder, agent = await nats.connect(url), await nats.connect(url)
    try:
        await serve(responder, "c1", clock=lambda: time.time() + server_skew_s)
        await responder.flush()
        clock = ClockCollector(
            peer=PeerClock(interval_s=60.0), use_adjtimex=False, skew_file=local_skew_file
        )
        task = asyncio.create_task(clock.attach(agent, "c1"))
        for _ in range(100):
            if clock.peer.latest() is not None:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        return clock.collect(time.time()).values
    finally:
        await responder.close()
        await agent.close()


def test_offset_to_the_coordinator_over_nats(nats_url: str, tmp_path: Path) -> None:
    behind = asyncio.run(probe(nats_url, 0.250, None))
    assert behind["source"] == "peer"
    assert behind["offset_ms"] == pytest.approx(-250.0, abs=behind["bound_ms"] + 1.0)
    assert 0 <= behind["bound_ms"] < 20 and behind["peer"]["rtt_ms"] == pytest.approx(
        2 * behind["bound_ms"], abs=0.01
    )
    skew = tmp_path / "skew_ms"
    skew.write_text("40\n")
    ahead = asyncio.run(probe(nats_url, 0.0, skew))
    assert ahead["offset_ms"] == pytest.approx(40.0, abs=ahead["bound_ms"] + 1.0)


def test_no_responder_means_no_peer_offset(nats_url: str) -> None:
    async def run() -> PeerClock:
        nc = await nats.connect(nats_url)
        peer = PeerClock(timeout_s=0.2, probes=2)
        task = asyncio.create_task(peer.run(nc, "nobody"))
        await asyncio.sleep(0.3)
        task.cancel()
        await nc.close()
        return peer

    peer = asyncio.run(run())
    assert peer.attached and peer.latest() is None


def test_resync_runs_the_step_command_and_measures_again(tmp_path: Path) -> None:
    skew = tmp_path / "skew_ms"
    skew.write_text("25\n")
    clock = ClockCollector(
        peer=PeerClock(), use_adjtimex=False, skew_file=skew, step_command=["rm", "-f", str(skew)]
    )
    clock.collect(0.0)
    done = asyncio.run(clock.resync())
    assert (done.ok, done.offset_before_ms, done.offset_after_ms) == (True, 25.0, 0.0)
    assert done.severity == "info" and done.message == "clock resync done: +25.00 ms → +0.00 ms"
    failing = ClockCollector(peer=PeerClock(), use_adjtimex=False, step_command=["false"])
    result = asyncio.run(failing.resync())
    assert not result.ok and result.severity == "warning"
    assert result.message == "clock resync failed: n/a → n/a (false exited with 1: )"
    unset = ClockCollector(peer=PeerClock(), use_adjtimex=False, step_command=[])
    assert "no step command configured" in asyncio.run(unset.resync()).message


def drift(detector: ClockDriftDetector, readings: list[tuple[float | None, bool]]) -> list[Any]:
    out = []
    for t, (offset, synced) in enumerate(readings):
        values = {"offset_ms": offset, "bound_ms": 0.5, "synced": synced, "source": "peer"}
        out += [(t, e) for e in detector.observe(Sample(collector="clock", time=t, values=values))]
    return out


def test_drift_with_hysteresis_and_the_bound() -> None:
    detector = ClockDriftDetector("n", confirm=2, hold_s=2.0)
    trace = [(0.1, True), (5.4, True), (5.4, True), (7.0, True), (7.0, True), (3.0, True)]
    trace += [(1.0, True), (1.0, True), (3.0, True), (1.0, True), (0.5, True), (0.2, True)]
    events = drift(detector, trace)
    assert [(t, e.recovered) for t, e in events] == [(4, False), (11, True)]
    raised = events[0][1]
    assert isinstance(raised, ClockDrift) and raised.severity == "warning"
    assert (raised.offset_ms, raised.synced, raised.source) == (7.0, True, "peer")
    assert raised.message == "clock offset +7.00 ms (±0.50) beyond 5 ms"
    assert events[1][1].message == "clock back in bounds: offset +0.20 ms, synchronised"


def test_unsynchronised_is_drift_whatever_the_offset() -> None:
    events = drift(ClockDriftDetector("n", confirm=1, hold_s=0.0), [(None, False), (None, True)])
    assert [(e.synced, e.recovered, e.message) for _, e in events] == [
        (False, False, "clock unsynchronised (no offset source)"),
        (True, True, "clock back in bounds: no offset source, synchronised"),
    ]
    with pytest.raises(ValueError):
        ClockDriftDetector("n", recover_ms=10.0)
