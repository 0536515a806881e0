"""The clock collector on this machine's kernel, a stand-in chronyc, a real nats-server for
the offset to the coordinator, the resync command, and the drift detector."""

from __future__ import annotations

import asyncio
import ctypes
import struct
from pathlib import Path
from typing import Any

import nats
import pytest

from nodeagent.collectors.clock import (
    STATES,
    ClockCollector,
    ClockSample,
    Timex,
    parse_tracking,
    read_adjtimex,
)
from nodeagent.collectors.clock_peer import PeerClock
from nodeagent.config import ClockSettings
from nodeagent.detectors.clock import ClockDriftDetector
from nodeagent.sim.node import SimulatedNode
from proto.conditions import ConditionKind, Severity, condition_key
from proto.events import ClockDrift, ClockResynced, ClockResyncFailed, kind_of
from ringmaster.clock import ManualClock
from ringmaster.clock_responder import serve
from ringmaster.procs import wait_until_async

LEG_S = 0.005  # each way of a probe's trip, on the manual clock both sides read

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


def collector(**settings: Any) -> ClockCollector:
    """A clock collector without the kernel's state (this host's may be unsynchronised)."""
    return ClockCollector(
        peer=settings.pop("peer", PeerClock()), use_adjtimex=False, max_offset_ms=5.0, **settings
    )


def raw_adjtimex() -> tuple[int, int, int]:
    """(state, status, maxerror in µs) read without :class:`Timex`: a zeroed buffer (modes
    = 0: only read) and the fields at their offsets in 64-bit Linux's ``struct timex``."""
    buffer = ctypes.create_string_buffer(208)
    state = ctypes.CDLL(None, use_errno=True).adjtimex(buffer)
    assert state >= 0, ctypes.get_errno()
    (maxerror,) = struct.unpack_from("q", buffer, 24)
    (status,) = struct.unpack_from("i", buffer, 40)
    return state, status, maxerror


def test_adjtimex_reads_this_kernel_unprivileged_layout() -> None:
    assert ctypes.sizeof(Timex) == 208  # the kernel's struct timex on 64-bit Linux
    reading = read_adjtimex()
    state, status, maxerror = raw_adjtimex()
    assert (reading.state, reading.status) == (STATES[state], status)
    # maxerror grows by at most 500 µs a second between the two reads
    assert reading.max_error_ms == pytest.approx(maxerror / 1000, abs=1.0)
    assert reading.synced == (state != 5 and not status & 0x40)


def test_chrony_tracking_lines() -> None:
    synced = parse_tracking(SYNCED)
    assert synced.offset_ms == pytest.approx(0.812345)  # the clock is fast: chrony slews back
    assert synced.bound_ms == pytest.approx(0.234567 / 2 + 0.123456)
    assert (synced.reference, synced.stratum, synced.synced) == ("169.254.169.123", 4, True)
    unsynced = parse_tracking(UNSYNCED)
    assert unsynced.synced is False and unsynced.reference == "00000000"
    with pytest.raises(ValueError, match="expected 14 fields"):
        parse_tracking("506 Cannot talk to daemon")


def test_chrony_is_the_source_and_is_read_at_its_own_pace(tmp_path: Path) -> None:
    manual = ManualClock()
    chronyc = fake_chronyc(tmp_path, SYNCED)
    clock = collector(chronyc=chronyc, chrony_interval_s=16.0, peer=PeerClock(clock=manual))
    first = clock.collect(0.0)
    assert (first.source, first.synced) == ("chrony", True)
    assert first.offset_ms == pytest.approx(0.812345)
    manual.advance(15.9)
    clock.collect(1.0)
    assert (tmp_path / "calls").read_text() == "-c tracking\n", "reused for chrony_interval_s"
    manual.advance(0.1)
    clock.collect(2.0)
    assert (tmp_path / "calls").read_text() == "-c tracking\n" * 2, "read again after it"


def test_chronyd_down_or_unsynchronised(tmp_path: Path) -> None:
    down = collector(chronyc=fake_chronyc(tmp_path, "", code=1)).collect(0.0)
    assert down.chrony is None and down.chrony_error == "506 Cannot talk to daemon"
    assert (down.source, down.offset_ms, down.synced) == ("none", None, True)
    lost = collector(chronyc=fake_chronyc(tmp_path, UNSYNCED))
    assert lost.collect(0.0).synced is False
    absent = collector(chronyc=["no-chronyc-here"])
    assert absent.collect(0.0).chrony_error == "no no-chronyc-here"


def test_skew_file_of_a_simulated_node(tmp_path: Path) -> None:
    node = SimulatedNode(tmp_path / "node-0", "node-0", nvme_devices=1)
    clock = collector(skew_file=node.skew_file)
    assert clock.collect(0.0).offset_ms == 0.0
    node.apply("clock-offset=-12.5")
    assert node.faults() == ["clock-offset=-12.5"]
    sample = clock.collect(1.0)
    assert (sample.offset_ms, sample.source, sample.skew_ms) == (-12.5, "skew_file", -12.5)
    node.skew_file.unlink()  # what the resync command does on a simulated node
    node.tick(0.1)
    assert node.faults() == []


async def probe(url: str, server_skew_s: float, local_skew_file: Path | None) -> ClockSample:
    """An agent's PeerClock against a responder whose clock is ``server_skew_s`` ahead; both
    read one manual clock, which a probe moves by :data:`LEG_S` on its way to the
    responder and again on its way back."""
    clock = ManualClock()
    readings = 0

    def responder_clock() -> float:
        nonlocal readings
        readings += 1
        if readings % 2:  # t2: the probe arrived
            clock.advance(LEG_S)
            return clock.time() + server_skew_s
        t3 = clock.time() + server_skew_s  # the reply leaves, and takes as long
        clock.advance(LEG_S)
        return t3

    responder, agent = await nats.connect(url), await nats.connect(url)
    try:
        await serve(responder, "c1", clock=responder_clock)
        await responder.flush()
        peer = PeerClock(interval_s=60.0, clock=clock)
        collecting = collector(peer=peer, skew_file=local_skew_file)
        task = asyncio.create_task(collecting.attach(agent, "c1"))

        async def measured() -> bool:
            return peer.latest() is not None

        try:
            await wait_until_async(measured, timeout=10)
        except TimeoutError:
            raise AssertionError(f"no offset measured; {readings} responder readings") from None
        finally:
            task.cancel()
        return collecting.collect(clock.time())
    finally:
        await responder.close()
        await agent.close()


def test_offset_to_the_coordinator_over_nats(nats_url: str, tmp_path: Path) -> None:
    behind = asyncio.run(probe(nats_url, 0.250, None))
    assert behind.source == "peer" and behind.peer is not None and behind.bound_ms is not None
    assert behind.offset_ms == pytest.approx(-250.0)
    assert behind.bound_ms == pytest.approx(LEG_S * 1000)  # half the round trip
    assert behind.peer.rtt_ms == pytest.approx(2 * behind.bound_ms, abs=0.01)
    skew = tmp_path / "skew_ms"
    skew.write_text("40\n")
    ahead = asyncio.run(probe(nats_url, 0.0, skew))
    assert ahead.bound_ms == pytest.approx(LEG_S * 1000)
    assert ahead.offset_ms == pytest.approx(40.0)


def test_no_responder_means_no_peer_offset(nats_url: str) -> None:
    async def run() -> PeerClock:
        nc = await nats.connect(nats_url)
        peer = PeerClock(timeout_s=0.2, probes=2)
        task = asyncio.create_task(peer.run(nc, "nobody"))

        async def attached() -> bool:
            return peer.attached

        await wait_until_async(attached, timeout=10)
        await peer.measure()  # a whole burst of probes, none answered
        task.cancel()
        await nc.close()
        return peer

    peer = asyncio.run(run())
    assert peer.attached and peer.latest() is None


def test_resync_runs_the_step_command_and_measures_again(tmp_path: Path) -> None:
    skew = tmp_path / "skew_ms"
    skew.write_text("25\n")
    clock = collector(skew_file=skew, step_command=["rm", "-f", str(skew)])
    clock.collect(0.0)
    done = asyncio.run(clock.resync())
    assert isinstance(done, ClockResynced)
    assert (done.offset_before_ms, done.offset_after_ms) == (25.0, 0.0)
    assert done.severity == "info" and done.message == "clock resync done: +25.00 ms → +0.00 ms"
    failing = collector(step_command=["false"])
    result = asyncio.run(failing.resync())
    assert isinstance(result, ClockResyncFailed) and result.severity == "warning"
    assert result.message == "clock resync failed: n/a → n/a (false exited with 1: )"
    assert result.reason == "false exited with 1: "


def test_a_resync_that_cannot_run_is_a_failure_never_a_resync(tmp_path: Path) -> None:
    """Seen on nodes without chrony: the step command is not installed. The event's kind
    says what its message says."""
    missing = collector(step_command=["chronyc-not-installed", "makestep"])
    result = asyncio.run(missing.resync())
    assert isinstance(result, ClockResyncFailed), result
    assert kind_of(result) == "clock.resync_failed" and "chronyc-not-installed" in result.reason
    unset = collector(step_command=[])
    assert isinstance(unset_result := asyncio.run(unset.resync()), ClockResyncFailed)
    assert "no step command configured" in unset_result.message


def drift(detector: ClockDriftDetector, readings: list[tuple[float | None, bool]]) -> list[Any]:
    out = []
    for t, (offset, synced) in enumerate(readings):
        sample = ClockSample(time=t, offset_ms=offset, bound_ms=0.5, synced=synced, source="peer")
        out += [(t, e) for e in detector.observe(sample)]
    return out


def test_drift_with_hysteresis_and_the_bound() -> None:
    detector = ClockDriftDetector("n", ClockSettings(confirm=2, hold_s=2.0))
    trace = [(0.1, True), (5.4, True), (5.4, True), (7.0, True), (7.0, True), (3.0, True)]
    trace += [(1.0, True), (1.0, True), (3.0, True), (1.0, True), (0.5, True), (0.2, True)]
    events = drift(detector, trace)
    assert [(t, e.recovered) for t, e in events] == [(4, False), (11, True)]
    raised = events[0][1]
    assert isinstance(raised, ClockDrift) and raised.severity == "warning"
    assert (raised.offset_ms, raised.synced, raised.source) == (7.0, True, "peer")
    assert raised.message == "clock offset +7.00 ms (±0.50) beyond 5 ms"
    assert events[1][1].message == "clock back in bounds: offset +0.20 ms, synchronised"
    opened, closed = (e.condition for _, e in events)
    assert opened.key == closed.key == condition_key(ConditionKind.CLOCK, "n")
    assert (opened.active, opened.value, opened.threshold, opened.reason) == (
        True,
        7.0,
        5.0,
        raised.message,
    )
    assert (closed.active, closed.since, closed.value, closed.threshold) == (False, 11, 0.2, 2.0)


def test_settings_change_the_bound() -> None:
    loose = ClockDriftDetector("n", ClockSettings(max_offset_ms=50.0, confirm=1, hold_s=0.0))
    assert drift(loose, [(7.0, True), (30.0, True)]) == []
    tight = ClockDriftDetector("n", ClockSettings(confirm=1, hold_s=0.0))
    assert [e.recovered for _, e in drift(tight, [(7.0, True), (1.0, True)])] == [False, True]


def test_unsynchronised_is_an_advisory_drift() -> None:
    """Unsynchronised with no offset, or one in bounds: the condition opens at info (the
    node stays eligible; status shows why), never at warning."""
    detector = ClockDriftDetector("n", ClockSettings(confirm=1, hold_s=0.0))
    events = drift(detector, [(None, False), (None, True), (0.1, False), (0.1, False)])
    assert [(e.synced, e.recovered, e.message) for _, e in events] == [
        (False, False, "clock unsynchronised (no offset source)"),
        (True, True, "clock back in bounds: no offset source, synchronised"),
        (False, False, "clock unsynchronised (offset +0.10 ms)"),
    ]
    opened = events[0][1].condition
    assert opened.value is None and opened.reason == "clock unsynchronised (no offset source)"
    assert opened.severity is Severity.INFO
    small = events[2][1].condition
    assert (small.active, small.severity, small.value) == (True, Severity.INFO, None)


def test_only_an_offset_measured_out_of_bounds_is_a_warning() -> None:
    """An unsynchronised clock's condition turns to warning once its offset is measured out
    of bounds (confirmed like any drift), and back to info once it is within
    ``recover_ms`` for ``hold_s``, still unsynchronised; then it closes when synced."""
    detector = ClockDriftDetector("n", ClockSettings(confirm=2, hold_s=2.0))
    trace: list[tuple[float | None, bool]] = [(0.1, False), (0.1, False), (9.0, False)]
    trace += [(9.0, False), (9.0, False)]
    trace += [(1.0, False), (1.0, False), (1.0, False), (1.0, False), (1.0, True), (1.0, True)]
    trace += [(1.0, True)]
    events = drift(detector, trace)
    states = [(t, e.recovered, e.condition.active, e.condition.severity) for t, e in events]
    assert states == [
        (1, False, True, Severity.INFO),
        (3, False, True, Severity.WARNING),
        (7, False, True, Severity.INFO),
        (11, True, False, Severity.INFO),
    ]
    escalated = events[1][1]
    assert escalated.message == "clock offset +9.00 ms (±0.50) beyond 5 ms, unsynchronised"
    assert escalated.condition.value == 9.0
    assert events[2][1].message == "clock unsynchronised (offset +1.00 ms)"
