"""A rank leaves its exit status beside its PID file as it exits (SIGTERM, a bad spec), for
an agent that is not its parent; the record is written whole or not at all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from ringmaster.rundir import ExitRecord, JobDir, exit_beside, read_exit, write_exit

ROOT = Path(__file__).resolve().parents[2]


def test_exit_records_round_trip_and_garbage_reads_as_none(tmp_path: Path) -> None:
    record = JobDir(tmp_path, "j").rank_exit(3)
    assert record == exit_beside(JobDir(tmp_path, "j").spec, 3) == tmp_path / "jobs/j/rank-3.exit"
    record.parent.mkdir(parents=True)
    assert read_exit(record) is None
    write_exit(record, 1234, 143)
    assert read_exit(record) == ExitRecord(1234, 143)
    assert [p.name for p in record.parent.iterdir()] == ["rank-3.exit"]  # no temp file left
    for garbage in ("", "1234", "1234 x", "1 2 3"):
        record.write_text(garbage)
        assert read_exit(record) is None


def test_sigterm_leaves_the_termination_status_in_the_record(tmp_path: Path) -> None:
    record = tmp_path / "rank-0.exit"
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from ringmaster.rank import termination
        termination.install()
        termination.record_exit_in(Path({str(record)!r}))
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 143
    finally:
        proc.kill()
        proc.wait()
    assert read_exit(record) == ExitRecord(proc.pid, 143)


def test_a_worker_refusing_its_spec_leaves_status_2_in_the_record(tmp_path: Path) -> None:
    job = JobDir(tmp_path, "j")
    job.path.mkdir(parents=True)
    job.spec.write_text("not a spec")
    env = {**os.environ, "RINGMASTER_JOB_SPEC": str(job.spec), "RANK": "1", "WORLD_SIZE": "2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.worker"], env=env, cwd=ROOT, stderr=subprocess.PIPE
    )
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    assert read_exit(job.rank_exit(1)) == ExitRecord(proc.pid, 2)
