"""What ``bench/recovery.py`` reads off the ranks' own log lines for one fault: the
seconds to the next step (and from the new ranks' start to it), the steps redone, and the
memory tier's spacing the ranks had set by the fault (the bound the steps redone are held
to). No cluster: log files written in the ranks' own format."""

from __future__ import annotations

from pathlib import Path

from bench.cluster_harness import read_records
from bench.recovery import Result, _restart_cell, cadence_at, measure, table
from ringmaster.logfmt import render


def _line(wall: float, event: str, **fields: object) -> str:
    head = {"trainer": True, "t": "0.00", "wall": f"{wall:.3f}", "rank": 0, "attempt": 0}
    return render({**head, "event": event, **fields})


def _write(path: Path, lines: list[str]) -> list[Path]:
    path.write_text("\n".join([*lines, "an unrelated line a rank printed"]) + "\n")
    return [path]


def test_a_fault_reads_its_seconds_steps_redone_and_the_spacing_set_before_it(
    tmp_path: Path,
) -> None:
    lines = [_line(100.0 + s, "step", step=s) for s in range(1, 41)]
    lines.insert(5, _line(105.5, "memory_tier", step=5, every_steps=12))
    lines.insert(20, _line(120.5, "memory_tier", step=20, every_steps=8))
    lines += [  # the fault at 150.2; the next attempt resumes at 36 from memory
        _line(160.0, "memory_tier", step=44, every_steps=30),  # set after the fault
        _line(150.9, "started", pid=7),
        _line(151.0, "start", step=36),
        _line(151.6, "resumed_from", step=36, tier="memory", took_s=0.41, transfer_s=0.2),
        _line(151.7, "resumed_from", step=36, tier="memory", took_s=0.52, transfer_s=0.3),
        _line(152.7, "step", step=37),
    ]
    logs = _write(tmp_path / "rank-0.log", lines)
    result = measure(lambda: logs, 150.2, cap=5.0)
    assert result.seconds == 2.5
    assert result.redone == 40 - 36
    assert result.every == 8
    assert result.started_to_step == 1.8
    assert result.to_started == 0.7  # from the fault to the new rank process
    assert result.restore_s == 0.52  # the slowest rank's resume
    assert _restart_cell(result) == "0.70 + 1.80 s (resume 0.52)"


def test_no_tier_line_is_no_spacing(tmp_path: Path) -> None:
    logs = _write(tmp_path / "rank-0.log", [_line(100.0, "step", step=1)])
    assert cadence_at(read_records(logs), 200.0) is None


def test_a_repeated_fault_has_a_row_of_its_own_in_the_order_run() -> None:
    def ran(fault: str, seconds: float) -> Result:
        return Result(fault, seconds, 3, every=5)

    on = [ran("rank stopped", 4.5), ran("rank stopped #2", 5.0)]
    off = [ran("rank stopped", 4.0), ran("rank stopped #2", 6.0)]
    rows = table({"on": on, "off": off}).splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == ["| rank stopped", "| rank stopped #2"]
    assert rows[1].endswith("| 1.2× |")  # off over on, this repeat's own figures
