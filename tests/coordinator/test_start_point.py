"""Where ``coordinatorctl start`` says a job begins: fresh, resuming, refused, ``--resume``,
``--fresh``. The checkpoints are written by the trainer's own (torch-free) sealing code;
the decision needs no bus, so neither do these tests."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from coordinator.ctl.errors import CtlError
from coordinator.ctl.main import main
from coordinator.ctl.start_point import decide, in_use, sharing, sibling
from proto.job import JobRecord, JobSection, JobSpec, JobState
from ringmaster.checkpoints import Manifest, newest_sealed, read_manifest
from ringmaster.rank import durable

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 11, 3, 3, 59, 2, tzinfo=UTC)


def spec(steps: int, directory: str = "checkpoints/tiny-gpt") -> JobSpec:
    s = JobSpec(job=JobSection(name="tiny-gpt"))
    s.train.steps = steps
    s.checkpoint.dir = directory
    return s


def seal(root: Path, step: int, job: str) -> Path:
    """A sealed checkpoint of ``step`` written by ``job``, through the trainer's commit."""
    (root / durable.step_dir_name(step)).mkdir(parents=True)
    return durable.commit(root, step, 1, "ddp", {}, {}, job)


def test_the_manifest_records_the_job_that_wrote_it(tmp_path: Path) -> None:
    step_dir = seal(tmp_path, 50, "tiny-gpt-38f912")
    manifest = read_manifest(step_dir)
    assert manifest is not None and (manifest.step, manifest.job) == (50, "tiny-gpt-38f912")
    assert durable.read_manifest(step_dir) == manifest  # the trainer reads the same type
    # a manifest written before job ids were recorded still reads, with no job
    old = msgspec.json.decode(msgspec.json.encode(manifest), type=dict)
    del old["job"]
    (step_dir / durable.MANIFEST).write_bytes(msgspec.json.encode(old))
    legacy = read_manifest(step_dir)
    assert isinstance(legacy, Manifest) and legacy.job == "" and legacy.step == 50


def test_newest_sealed_skips_unsealed_and_unnamed_dirs(tmp_path: Path) -> None:
    assert newest_sealed(tmp_path / "nothing-here") is None
    seal(tmp_path, 10, "a-000001")
    seal(tmp_path, 20, "a-000001")
    (tmp_path / "step-30").mkdir()  # a persist that died before its manifest
    found = newest_sealed(tmp_path)
    assert found is not None and (found.step, found.job) == (20, "a-000001")
    (tmp_path / "step-20" / durable.MANIFEST).write_text("{torn")
    found = newest_sealed(tmp_path)
    assert found is not None and found.path == tmp_path / "step-10"


def test_no_checkpoint_starts_fresh_in_the_dir_relative_to_the_workdir(tmp_path: Path) -> None:
    point = decide(spec(2500), tmp_path)
    root = tmp_path / "checkpoints" / "tiny-gpt"
    assert point.checkpoint_dir == str(root)
    assert (point.resume_step, point.resume_job) == (None, "")
    assert point.note == f"starting fresh (no checkpoint in {root})"


def test_a_checkpoint_short_of_the_target_resumes_and_names_its_job(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints" / "tiny-gpt"
    seal(root, 200, "tiny-gpt-38f912")
    point = decide(spec(2500), tmp_path)
    assert (point.resume_step, point.resume_job) == (200, "tiny-gpt-38f912")
    assert point.checkpoint_dir == str(root)
    assert point.note.startswith("resuming from step 200 of 2500 (written by job tiny-gpt-38f912")
    assert str(root / "step-200") in point.note


def test_a_finished_checkpoint_is_refused_with_both_ways_out(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    seal(root, 6000, "tiny-gpt-0a1b2c")
    with pytest.raises(CtlError) as refused:
        decide(spec(2500, str(root)), Path("/elsewhere"))  # an absolute dir is used as is
    message = str(refused.value)
    assert refused.value.code == 2 and "\n" not in message
    for part in (str(root), "step 6000", "job tiny-gpt-0a1b2c", "2500", "--resume", "--fresh"):
        assert part in message, message
    # exactly at the target counts as finished too
    with pytest.raises(CtlError):
        decide(spec(6000, str(root)), tmp_path)


def test_an_unusable_checkpoint_dir_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(CtlError) as bad:
        decide(spec(10, "ckpt\0x"), tmp_path)
    assert bad.value.code == 2 and "checkpoint.dir" in str(bad.value)


def test_resume_submits_a_finished_checkpoint_anyway_and_says_so(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    seal(root, 6000, "")
    point = decide(spec(2500, "ckpt"), tmp_path, resume=True)
    assert (point.checkpoint_dir, point.resume_step, point.resume_job) == (str(root), 6000, "")
    assert "a job that did not record its id" in point.note and "--resume" in point.note


def test_fresh_starts_beside_the_old_dir_and_leaves_it_alone(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints" / "tiny-gpt"
    seal(root, 6000, "tiny-gpt-0a1b2c")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    point = decide(spec(2500), tmp_path, fresh=True, now=NOW)
    beside = tmp_path / "checkpoints" / "tiny-gpt-20261103T035902Z"
    assert (point.checkpoint_dir, point.resume_step) == (str(beside), None)
    assert str(beside) in point.note and not beside.exists()
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    # a second --fresh in the same second gets its own name
    beside.mkdir()
    assert sibling(root, NOW) == beside.with_name(beside.name + "-2")
    # with nothing to start beside, --fresh just starts fresh in the dir
    assert decide(spec(2500, "other"), tmp_path, fresh=True).checkpoint_dir == str(
        tmp_path / "other"
    )


def test_resume_and_fresh_together_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(CtlError) as both:
        decide(spec(10), tmp_path, resume=True, fresh=True)
    assert both.value.code == 2
    with pytest.raises(SystemExit) as exited:
        main(["start", str(tmp_path / "job.toml"), "--resume", "--fresh"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--fresh" in err[0] and "--resume" in err[0], err


def test_a_dir_a_job_still_writes_is_refused_and_an_ended_ones_is_not() -> None:
    def record(job_id: str, directory: str, state: JobState) -> JobRecord:
        return JobRecord(id=job_id, name="t", spec=spec(10, directory), state=state)

    jobs = [
        record("t-000001", "/w/ckpt", JobState.COMPLETED),
        record("t-000002", "/w/other", JobState.RUNNING),
    ]
    assert sharing(jobs, "/w/ckpt") is None
    jobs.append(record("t-000003", "/w/ckpt/", JobState.PAUSED))
    busy = sharing(jobs, "/w/./ckpt")
    assert busy is not None and busy.id == "t-000003"
    refusal = in_use(busy)
    assert refusal.code == 2 and "\n" not in str(refusal)
    assert "job t-000003, still paused" in str(refusal) and "--fresh" in str(refusal)


def ctl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # nothing listens on port 1: a command that reaches for the bus fails with exit 1
    env = {
        **os.environ,
        "RINGMASTER_NATS": "nats://127.0.0.1:1",
        "RINGMASTER_HOME": str(cwd / "home"),
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        [sys.executable, "-m", "coordinator.ctl.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
        check=False,
    )


def test_start_refuses_a_finished_checkpoint_dir_before_touching_the_bus(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        '[job]\nname = "tiny-gpt"\nnodes = 1\n[train]\nsteps = 200\n'
        '[checkpoint]\ndir = "checkpoints/tiny-gpt"\n'
    )
    seal(tmp_path / "checkpoints" / "tiny-gpt", 200, "tiny-gpt-38f912")
    done = ctl(tmp_path, "start", str(job), "--set", "train.steps=150")
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coordinatorctl: "), done.stderr
    assert "step 200" in lines[0] and "job tiny-gpt-38f912" in lines[0]
    # past the check, the same start goes on to submit (and finds no bus here)
    done = ctl(tmp_path, "start", str(job), "--resume")
    assert done.returncode == 1 and "NATS" in done.stderr, done.stderr
