"""The capacity bench's own judgement and load, without a cluster: a run whose publishers
did not keep the schedule, or whose floor did not take every beat, is INVALID (and the
exit code says so); a publisher's pre-encoded beat, patched for each send, is the beat an
agent would send."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bench.capacity_load import AgentSays, Encoded, make_beat
from bench.capacity_report import EXIT_FAILED, EXIT_INVALID, EXIT_OK, core_spare, exit_code
from bench.capacity_report import invalid_because as why
from proto.codec import node_beat_decoder
from proto.node import RankReport


def run(**kw: Any) -> dict[str, Any]:
    r: dict[str, Any] = dict(
        nodes=25_000, beats_per_s=25_000.0, publisher_late_ms_max=40.0,
        floor_beats_per_s=25_000.0, machine_busy_pct=45.0, cores=2,
    )  # fmt: skip
    r.update(kw)
    r["invalid_because"] = why(r)
    r["valid"] = not r["invalid_because"]
    return r


def test_a_run_that_kept_its_schedule_is_valid() -> None:
    assert run()["valid"] and exit_code([run(), run(nodes=10_000, beats_per_s=9_900.0)]) == 0


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"beats_per_s": 20_330.0}, "20,330 beats/s, under 98% of 25,000"),
        ({"publisher_late_ms_max": 14_000.0}, "14,000 ms behind its schedule"),
        ({"floor_beats_per_s": 24_000.0}, "not a floor"),
    ],
)
def test_a_run_that_measured_the_machine_is_invalid(fields: dict[str, float], said: str) -> None:
    r = run(**fields)
    assert not r["valid"] and said in r["invalid_because"][0]
    assert exit_code([run(), r]) == EXIT_INVALID
    assert exit_code([r, {"nodes": 10, "error": "boom"}]) == EXIT_FAILED
    assert exit_code([run()]) == EXIT_OK


def test_a_core_to_spare_is_a_whole_idle_core() -> None:
    assert core_spare(run(machine_busy_pct=50.0))
    assert not core_spare(run(machine_busy_pct=51.0))
    assert core_spare(run(machine_busy_pct=74.0, cores=4))


def test_a_patched_beat_is_the_beat_an_agent_sends() -> None:
    beat = Encoded(make_beat(7, 25_000, random.Random(1)))
    first = node_beat_decoder.decode(beat.next(b"%-20.6f" % 1_765_000_000.25))
    second = node_beat_decoder.decode(beat.next(b"%-20.6f" % 1_765_000_001.5))
    assert (first.node, first.seq, first.sent_at) == ("sim-00007", 1, 1_765_000_000.25)
    assert (second.seq, second.sent_at, second.launched) == (2, 1_765_000_001.5, {})
    rank = RankReport(job="j", rank=1, attempt=3, pid=9, alive=True)
    said = AgentSays(ranks=[rank], jobs=["j"], launched={"j": 3})
    b = beat.beat
    b.ranks, b.jobs, b.launched = tuple(said.ranks), tuple(said.jobs), said.launched
    beat.encode()
    third = node_beat_decoder.decode(beat.next(b"%-20.6f" % 1_765_000_002.0))
    assert (third.seq, third.ranks, third.launched) == (3, (rank,), {"j": 3})
