"""A user's own training script — a Hugging Face ``Trainer`` (examples/hf_trainer.py), a
Lightning ``Trainer`` (examples/lightning_module.py), an accelerate loop
(examples/accelerate_loop.py) — as a job on a local cluster, with its integration lines and
without them.

With them, one job of each goes through every reaction the built-in trainer gets: an NVMe
spike pauses it (within a step, or a quarter second where steps are shorter) and its
recovery resumes it; ``checkpoint`` writes the framework's own checkpoint at a step every
rank agrees on; a killed rank and a lost node are back from the memory tier a few steps
back; a stopped rank is found as hung with the culprit named; a spot notice checkpoints
before its deadline and the next attempt loses no step; ``stop`` stops after a
checkpoint; and the ledger agrees with the ranks' own step stamps.

Without them, the job says it has no reactions; ``pause`` and ``checkpoint`` are refused
with the reason; a spike is said to go unheeded while the job trains on; and ``status``
says the step and the ledger's split are unknown.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cli_harness import EXAMPLES, Ctl, eventually, first_event, restarted
from ledger_truth import attempts, check_ledger

pytestmark = pytest.mark.slow
MARK = "# ringmaster"


def entry(script: str, out: Path, *extra: str) -> str:
    argv = [script, "--out", str(out), "--steps", "100000", "--save-steps", "100000", *extra]
    return f"job.entry={json.dumps(argv)}"


def events(ctl: Ctl, job: str, kind: str) -> list[dict[str, object]]:
    return [e for e in ctl.events("--job", job) if e["kind"] == kind]


def start_own(
    ctl: Ctl, tmp_path: Path, name: str, argv: list[str], more: str = ""
) -> tuple[str, str]:
    """A 2-node cluster up and a job of ``argv`` (its ``entry``) started from a job file of
    its own; the job's id and what ``start`` said on stderr."""
    job_file = tmp_path / f"{name}.toml"
    job_file.write_text(
        f'[job]\nname = "{name}"\nnodes = 2\nentry = {json.dumps(argv)}\n'
        f'[checkpoint]\ndir = "{tmp_path / "ckpt"}"\n{more}'
    )
    ctl("up", "--nodes", "2")
    started = ctl.run("start", str(job_file))
    assert started.returncode == 0, started.stderr
    return started.stdout.strip(), started.stderr


def culprit(ctl: Ctl, job: str) -> dict[str, object]:
    """The job's first ``worker.hung`` that names its culprit."""
    return eventually(
        lambda: [e for e in events(ctl, job, "worker.hung") if not e["culprit_unknown"]] or None,
        120,
        lambda: "no worker.hung naming a culprit",
        0.5,
    )[0]


def hf_saved(out: Path, step: int) -> bool:
    return (out / f"checkpoint-{step}" / "trainer_state.json").exists()


def lightning_saved(out: Path, step: int) -> bool:
    last = out / "checkpoints" / "last.ckpt"
    return last.exists() and torch.load(last, weights_only=False)["global_step"] == step


def accelerate_saved(out: Path, step: int) -> bool:
    return (out / f"checkpoint-{step}" / "model.safetensors").exists()


@dataclass(frozen=True)
class Script:
    framework: str
    file: str
    path: Callable[[Path, int], Path]  # where the event says the checkpoint of a step is
    saved: Callable[[Path, int], bool]  # whether that checkpoint holds the step


SCRIPTS = [
    Script("hf", "hf_trainer.py", lambda out, s: out / f"checkpoint-{s}", hf_saved),
    Script(
        "lightning",
        "lightning_module.py",
        lambda out, s: out / "checkpoints" / "last.ckpt",
        lightning_saved,
    ),
    Script(
        "accelerate",
        "accelerate_loop.py",
        lambda out, s: out / f"checkpoint-{s}",
        accelerate_saved,
    ),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.framework for s in SCRIPTS])
def test_a_framework_loop_gets_every_reaction(ctl: Ctl, tmp_path: Path, script: Script) -> None:
    out = tmp_path / "out"
    ctl("up", "--nodes", "4")
    job = ctl.start(
        "hf_trainer.toml",
        f"job.name={script.framework}-loop",
        entry(script.file, out),
        "job.min_nodes=1",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    status = ctl.wait(
        job, lambda s: s["state"] == "running" and (s["step"] or 0) >= 10, timeout=300
    )
    assert status["framework"] == script.framework and status["lacks"] == [], status
    [said] = events(ctl, job, "job.loop")
    assert said["reactions"] == ["pause", "checkpoint", "memory tier", "hang by beat"]

    # an NVMe spike on a job node pauses the ranks, and its recovery resumes them
    node = status["nodes"][1]
    ctl("inject", node, "nvme-latency=500")
    paused = ctl.wait(job, lambda s: s["state"] == "paused")
    spike = first_event(ctl, job, "job.paused")
    ctl("inject", node, "clear")
    resumed = ctl.wait(job, lambda s: s["state"] == "running" and s["step"] > paused["step"])
    assert resumed["pause_reasons"] == []
    assert spike["step"] == paused["step"]

    # the operator's checkpoint is the framework's own, at a step every rank agreed on
    ctl("checkpoint", job)
    saved = eventually(
        lambda: events(ctl, job, "job.checkpointed") or None, 60, lambda: "no checkpoint", 0.5
    )[0]
    step = int(str(saved["step"]))
    assert saved["path"] == str(script.path(out, step)), saved
    assert script.saved(out, step), f"no checkpoint of step {step} in {out}"

    # a killed rank, then a lost node, are back from the memory tier a few steps back
    for restarts, fault in enumerate(("kill-worker", "lose-node"), 1):
        before = ctl.wait(
            job, lambda s, at=step: s["state"] == "running" and (s["memory_step"] or 0) > at
        )
        victim = before["nodes"][1]
        ctl("inject", victim, fault)
        back = restarted(ctl, job, restarts)
        ctl.wait(job, lambda s, n=restarts: s["state"] == "running" and s["restarts"] == n)
        loop = events(ctl, job, "job.loop")[-1]
        assert loop["resumed_from"] == "memory", (fault, loop)
        # the ranks resume from the newest snapshot every rank can use; the coordinator's
        # forecast is the newest it had heard of, which a loaded bus can leave behind
        assert loop["step"] >= back["from_step"] - 1, (fault, back, loop)
        assert loop["step"] > step, (fault, loop)
        step = int(str(loop["step"]))
    assert victim not in back["nodes"]

    # a stopped rank is found as hung, its culprit named
    status = ctl.wait(job, lambda s: s["state"] == "running" and s["restarts"] == 2)
    victim = status["nodes"][1]
    ctl("inject", victim, "hang")
    hung = culprit(ctl, job)
    assert hung["node"] == victim and hung["rank"] == 1 and hung["stacks"]
    restarted(ctl, job, 3)
    status = ctl.wait(job, lambda s: s["state"] == "running" and s["restarts"] == 3)

    # a spot notice: the framework checkpoints at the next step, and nothing is lost
    noticed = status["nodes"][0]
    ctl("inject", noticed, "spot-notice=20")
    fourth = restarted(ctl, job, 4)
    assert noticed not in fourth["nodes"]
    recovering = events(ctl, job, "job.recovering")[3]
    assert "preemption" in str(recovering["reason"]) and "no checkpoint" not in str(
        recovering["reason"]
    )
    stopped_at = [
        e["step"] for e in events(ctl, job, "job.checkpointed") if e["time"] > recovering["time"]
    ]
    ctl.wait(job, lambda s: s["state"] == "running" and s["restarts"] == 4)
    loop = events(ctl, job, "job.loop")[-1]
    assert stopped_at and loop["resumed_from"] == "loop" and loop["step"] == stopped_at[-1]

    ctl("stop", job)
    final = ctl.wait(job, lambda s: s["state"] == "stopped")
    assert final["restarts"] == 4
    assert script.saved(out, final["step"]), f"no checkpoint of step {final['step']}"

    # the ledger against the ranks' own account
    check_ledger(final, attempts(ctl.home, job), ctl.events("--job", job))


@pytest.mark.shared_cluster(nodes=2)
@pytest.mark.timeout(600)
def test_an_unmodified_script_is_refused_what_it_cannot_do_and_its_ledger_says_so(
    ctl: Ctl, tmp_path: Path
) -> None:
    source = (EXAMPLES / "hf_trainer.py").read_text().splitlines()
    plain = tmp_path / "hf_plain.py"
    plain.write_text("\n".join(line for line in source if not line.rstrip().endswith(MARK)))
    argv = ["hf_plain.py", "--out", str(tmp_path / "out"), "--steps", "100000"]
    job, said = start_own(ctl, tmp_path, "hf-plain", argv)
    assert "reactions (its script's): none" in said, said
    status = ctl.wait(job, lambda s: s["state"] == "running")
    assert status["step"] is None and status["reactions"] == [] and not status["reports_steps"]
    for verb in ("pause", "checkpoint"):
        refused = ctl.run(verb, job)
        assert refused.returncode == 1, refused.stderr
        [line] = refused.stderr.strip().splitlines()
        assert f"cannot {verb}" in line and "rank API" in line, line
    spiked = status["nodes"][1]
    ctl("inject", spiked, "nvme-latency=500")
    unheeded = first_event(ctl, job, "job.unheeded")
    assert "trains on" in str(unheeded["message"])
    # the record says so too once it is written (the event may come first)
    status = ctl.wait(job, lambda s: unheeded["condition_key"] in s["unheeded"], timeout=30)
    assert status["state"] == "running" and status["pause_reasons"] == []
    text = ctl("status", job)
    assert "unknown" in text and "reports no steps" in text
    assert status["goodput"]["productive"] == 0.0 and status["goodput"]["unknown"] > 0
    done = ctl.run("stop", job)
    assert done.returncode == 0 and "no checkpoint at a step first" in done.stderr
    ctl.wait(job, lambda s: s["state"] == "stopped")
    ctl("inject", spiked, "clear")


STRAY = """
import os, runpy, sys
from ringmaster import rank

boundary = rank.step


def step(step, **kw):
    # the first attempt's rank 1 stops calling the boundary at step 30 and spins in its
    # own code, as a loop with a bug would: no collective, no stopped process
    if step >= 30 and os.environ["RANK"] == "1" and os.environ["RINGMASTER_ATTEMPT"] == "1":
        while True:
            sum(range(10_000))
    return boundary(step, **kw)


rank.step = step
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


@pytest.mark.shared_cluster(nodes=2)
@pytest.mark.timeout(600)
def test_a_rank_that_stops_calling_the_boundary_is_found_hung_not_a_deadlock(
    ctl: Ctl, tmp_path: Path
) -> None:
    (tmp_path / "stray.py").write_text(STRAY)
    argv = ["stray.py", str(EXAMPLES / "rank_api_loop.py"), "--steps", "100000"]
    job, _ = start_own(ctl, tmp_path, "stray", argv, "[policy]\nhang_floor_s = 3.0\n")
    hung = culprit(ctl, job)
    # the spinning rank is named from its stacks, running; its peer waits in the API's
    # all-reduce, which its beat says
    assert hung["rank"] == 1 and "outside any collective" in str(hung["evidence"]), hung
    assert "stray.py" in str(hung["stacks"]), hung["stacks"]
    restarted(ctl, job, 1)
    status = ctl.wait(job, lambda s: s["state"] == "running" and s["step"] > 31)
    assert status["restarts"] == 1
    ctl("stop", job)
    ctl.wait(job, lambda s: s["state"] == "stopped")
