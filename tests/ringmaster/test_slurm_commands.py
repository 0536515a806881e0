"""Slurm through its commands: the allocation from the environment, Slurm's own message
on failure, and ``start``'s checks inside an allocation. The commands here are small
executables standing in for ``scontrol`` on ``PATH`` (the real ones run in
tests/e2e/test_slurm.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.ctl.follow import _requeue
from coordinator.ctl.main import main
from ringmaster import slurm

JOB = Path(__file__).resolve().parents[2] / "examples" / "tiny.toml"


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``scontrol`` that expands ``show hostnames`` like Slurm's and logs its calls;
    ``fail`` in its directory makes it fail as Slurm does when the controller is away."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {bin_dir}/calls\n'
        f'if [ -e {bin_dir}/fail ]; then echo "slurm_load_jobs error: Unable to contact '
        'slurm controller (connect failure)" >&2; exit 1; fi\n'
        'if [ "$1 $2" = "show hostnames" ]; then\n'
        '  case "$3" in gpu-\\[01-03\\]) printf "gpu-01\\ngpu-02\\ngpu-03\\n";;\n'
        '  *) echo "$3";; esac\n'
        "fi\n"
    )
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_outside_an_allocation_there_is_none(scontrol: Path) -> None:
    assert slurm.allocation({"PATH": os.environ["PATH"]}) is None
    assert not (scontrol / "calls").exists()


def test_the_allocation_is_its_expanded_node_list(scontrol: Path) -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu-[01-03]", "SLURM_RESTART_COUNT": "2"}
    assert slurm.allocation(env) == slurm.Allocation("42", ["gpu-01", "gpu-02", "gpu-03"], 2)


def test_a_failing_command_is_retried_then_says_slurms_own_words(scontrol: Path) -> None:
    (scontrol / "fail").touch()
    with pytest.raises(slurm.SlurmError, match="Unable to contact slurm controller"):
        slurm.drain("gpu-01", "ringmaster: x: y")
    assert len((scontrol / "calls").read_text().splitlines()) == slurm.ATTEMPTS


def test_start_refuses_an_allocation_smaller_than_the_job(
    scontrol: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-01")
    assert main(["start", str(JOB), "--nats", "nats://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "coordinatorctl: Slurm job 42 has 1 nodes (gpu-01); the job needs 2 (job.nodes = 2)"
    ]


def test_start_says_why_when_the_allocation_cannot_be_read(
    scontrol: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (scontrol / "fail").touch()
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-[01-03]")
    assert main(["start", str(JOB), "--nats", "nats://127.0.0.1:1"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "its nodes are unknown" in line and "Unable to contact slurm controller" in line


def test_a_requeue_slurm_already_made_is_said_as_such_and_a_refused_one_warned(
    scontrol: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A preemption with ``PreemptMode=REQUEUE`` requeues the job before ``start`` asks, and
    Slurm would refuse the ask: the job is back in the queue all the same."""
    (scontrol / "scontrol").write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {scontrol}/calls\n'
        'if [ "$1" = requeue ]; then echo "Requested operation is presently disabled for '
        'job $2" >&2; exit 1; fi\n'
        f'echo "JobId=42 JobState=PENDING Restarts=$(cat {scontrol}/restarts) Reboot=0"\n'
    )
    (scontrol / "restarts").write_text("1")  # Slurm's count, past this run's 0
    assert _requeue(slurm.Allocation("42", ["gpu-01"], 0)) == slurm.REQUEUE_EXIT
    assert capsys.readouterr().err.strip() == (
        "Slurm job 42 already requeued by Slurm; exit 75 (requeue me)"
    )
    assert "requeue 42" not in (scontrol / "calls").read_text()  # not asked twice
    # this run is Slurm's second: a refused requeue is a warning in Slurm's own words
    assert _requeue(slurm.Allocation("42", ["gpu-01"], 1)) == slurm.REQUEUE_EXIT
    assert capsys.readouterr().err.strip() == (
        "warning: Slurm job 42 not requeued: scontrol requeue 42: Requested operation is "
        "presently disabled for job 42; exit 75 (requeue me)"
    )


@pytest.mark.parametrize(
    ("signal", "fields", "expected"),
    [
        # as slurm-wlm 22.05 showed them at the moment the batch step got its signal
        ("SIGUSR1", {"JobState": "RUNNING", "Reason": "None"}, slurm.END),
        ("SIGTERM", {"JobState": "COMPLETING", "Reason": "None", "Restarts": "0"}, slurm.CANCEL),
        ("SIGTERM", {"JobState": "CANCELLED", "Reason": "None", "Restarts": "0"}, slurm.CANCEL),
        ("SIGTERM", {"JobState": "COMPLETING", "Reason": "TimeLimit"}, slurm.END),
        ("SIGTERM", {"JobState": "TIMEOUT", "Reason": "None"}, slurm.END),
        ("SIGTERM", {"JobState": "COMPLETING", "Reason": "None", "Restarts": "1"}, slurm.END),
        ("SIGTERM", {"JobState": "PREEMPTED", "Reason": "None", "Restarts": "0"}, slurm.END),
        ("SIGTERM", {"JobState": "COMPLETING", "PreemptTime": "2026-12-07T18:16:35"}, slurm.END),
        ("SIGTERM", {"JobState": "RUNNING", "Reason": "None", "Restarts": "0"}, slurm.END),
        ("SIGTERM", {}, slurm.END),  # Slurm did not answer: the allocation ends, as before
    ],
)
def test_slurms_record_tells_a_cancel_from_an_end(
    signal: str, fields: dict[str, str], expected: str
) -> None:
    kind, why = slurm.ending(signal, fields, run_restarts=0)
    assert kind == expected and why.startswith(f"Slurm sent {signal}: "), why
    if kind == slurm.CANCEL:
        assert why == "Slurm sent SIGTERM: the job was cancelled (scancel)"


def test_a_job_is_read_in_one_call(scontrol: Path) -> None:
    (scontrol / "scontrol").write_text(
        "#!/bin/sh\necho 'JobId=42 JobName=x JobState=COMPLETING Reason=None Restarts=0'\n"
    )
    fields = slurm.job_fields("42")
    assert (fields["JobState"], fields["Reason"], fields["Restarts"]) == ("COMPLETING", "None", "0")
    assert slurm.restarts("42") == 0
