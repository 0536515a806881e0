"""Numeric faults and stragglers in one process: the simulated-node knob reader, the
fault detector, the data-skip bookkeeping, rank 0's straggler window, and the step probe
on a real (tiny) model."""

from __future__ import annotations

import math
import time
from pathlib import Path

import msgspec
import pytest
import torch

from proto.faults import SimKnobs
from ringmaster.rundir import SIM_KNOBS_ENV
from trainer.model import GPT, lm_loss
from trainer.numeric import NumericFault, NumericGuard, Rewinds, plan
from trainer.presets import get_preset
from trainer.probe import StepProbe, StragglerWindow
from trainer.sim_knobs import SimKnobsReader


def write_knobs(path: Path, **knobs: float) -> None:
    """As ``coordinatorctl inject`` does: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(SimKnobs(**knobs)))  # type: ignore[arg-type]
    tmp.replace(path)


def reader(path: Path) -> tuple[SimKnobsReader, list[str]]:
    warnings: list[str] = []
    return SimKnobsReader(path, warnings.append), warnings


def test_knobs_apply_only_on_simulated_nodes(tmp_path: Path) -> None:
    path = str(tmp_path / "knobs.json")
    assert SimKnobsReader.from_env({SIM_KNOBS_ENV: path}, print) is None
    assert SimKnobsReader.from_env({"RINGMASTER_SIMULATED": "1"}, print) is None
    assert (
        SimKnobsReader.from_env({"RINGMASTER_SIMULATED": "0", SIM_KNOBS_ENV: path}, print) is None
    )
    first = SimKnobsReader.from_env({"RINGMASTER_SIMULATED": "1", SIM_KNOBS_ENV: path}, print)
    assert first is not None and first.poisons
    env = {"RINGMASTER_SIMULATED": "1", SIM_KNOBS_ENV: path, "LOCAL_RANK": "1"}
    other = SimKnobsReader.from_env(env, print)
    assert other is not None and not other.poisons


def test_a_missing_file_is_the_defaults_without_a_warning(tmp_path: Path) -> None:
    """No fault injected is the normal state of every simulated node: nothing to say."""
    knobs, warnings = reader(tmp_path / "knobs.json")
    for _ in range(3):
        assert knobs.poll() == SimKnobs()
        assert not knobs.take_nan()
    assert warnings == []


def test_a_nan_request_made_before_the_rank_started_does_not_fire(tmp_path: Path) -> None:
    path = tmp_path / "knobs.json"
    write_knobs(path, nan_loss=2)
    knobs, warnings = reader(path)
    knobs.poll()
    assert not knobs.take_nan()
    write_knobs(path, nan_loss=3)
    knobs.poll()
    assert knobs.take_nan()  # one increase: one poisoned step
    assert not knobs.take_nan()
    write_knobs(path, nan_loss=5)
    knobs.poll()
    assert [knobs.take_nan() for _ in range(3)] == [True, True, False]
    assert warnings == []


def test_a_changed_file_is_reread_and_clear_restarts_the_count(tmp_path: Path) -> None:
    path = tmp_path / "knobs.json"
    knobs, warnings = reader(path)
    write_knobs(path, slow=3.0)
    assert knobs.poll().slow == 3.0 and knobs.slow == 3.0
    write_knobs(path, slow=2.0, nan_loss=1)
    assert knobs.poll().slow == 2.0 and knobs.take_nan()
    path.unlink()  # ``clear``
    assert knobs.poll() == SimKnobs()
    write_knobs(path, nan_loss=1)  # the next request after a clear counts from 0 again
    knobs.poll()
    assert knobs.take_nan()
    assert warnings == []  # missing at the start and after the clear: nothing wrong


def test_a_malformed_file_is_normal_speed_and_does_not_replay_requests(tmp_path: Path) -> None:
    path = tmp_path / "knobs.json"
    write_knobs(path, slow=4.0, nan_loss=1)
    knobs, warnings = reader(path)
    path.write_text("{not json")
    assert knobs.poll().slow == 1.0
    knobs.poll()
    assert len(warnings) == 1 and "malformed" in warnings[0]
    write_knobs(path, slow=4.0, nan_loss=1)  # the same request as before: not a new one
    knobs.poll()
    assert knobs.slow == 4.0 and not knobs.take_nan()
    write_knobs(path, slow=0.5)  # out of range: normal speed
    assert knobs.poll().slow == 1.0 and "out of range" in warnings[-1]


def test_non_finite_loss_or_norm_is_a_fault() -> None:
    guard = NumericGuard(spike=50.0)
    assert guard.check(2.0, 1.0) is None
    assert guard.check(float("nan"), 1.0) == "non-finite loss nan"
    assert guard.check(float("inf"), 1.0) == "non-finite loss inf"
    assert guard.check(2.0, float("nan")) == "non-finite gradient norm nan"
    assert guard.check(2.0, -1.0) is None  # the engine could not tell: not judged
    assert list(guard.norms) == [1.0]


def test_a_spike_counts_only_after_enough_history() -> None:
    guard = NumericGuard(spike=10.0, history=50, warmup=10)
    assert guard.check(2.0, 1.0) is None
    assert guard.check(2.0, 500.0) is None  # too early to judge: erratic first steps
    for _ in range(8):
        assert guard.check(2.0, 1.0) is None
    assert guard.check(2.0, 9.9) is None  # under 10 x the median (1.0)
    why = guard.check(2.0, 10.5)
    assert why is not None and "gradient norm 10.5 > 10 x median 1" in why
    assert 10.5 not in guard.norms  # a faulty step does not raise the bar
    assert guard.check(2.0, 10.5) is not None


def test_a_rewind_skips_everything_trained_since_the_checkpoint() -> None:
    # the step at index 12 (the 13th) faults; the newest checkpoint is step 10
    first = plan(10, 12, 0, "non-finite loss nan")
    assert (first.step, first.from_step) == (10, 13)
    assert (first.skip_from, first.skip_to, first.offset) == (10, 13, 3)
    message = first.message([0])
    assert (message.step, message.from_step, message.skip_from, message.skip_to) == (10, 13, 10, 13)
    assert (message.ranks, message.nonfinite) == ([0], 1)
    everyone = first.message(list(range(1000)))  # a diverging model on a large job
    assert everyone.ranks == list(range(64)) and everyone.nonfinite == 1000
    # steps 10, 11 now train on data positions 13, 14; a fault at index 11 skips those too
    second = plan(10, 11, first.offset, "again")
    assert (second.skip_from, second.skip_to, second.offset) == (13, 15, 5)
    with pytest.raises(ValueError):
        plan(15, 12, 0, "a checkpoint newer than the fault")


def test_a_rank_rewinds_faults_far_apart_afresh_and_gives_up_past_the_coordinators_run() -> None:
    """The same fault coming back (within the margin, or on the same data) may run one
    longer than the coordinator's budget; faults far apart never add up."""
    rewinds = Rewinds(max_rewinds=1, margin=10)
    for step in (100, 200, 300, 400, 500):  # five far apart: five rewinds
        rewinds.admit(step, step, "x")
    assert rewinds.count == 5
    rewinds.admit(505, 505, "y")  # back within 10 steps: a run of two
    with pytest.raises(NumericFault, match=r"step 507 \(z\): 3 times in a row .*500, 505, 507"):
        rewinds.admit(507, 507, "z")
    again = Rewinds(max_rewinds=0, margin=10)
    again.admit(5, 5, "first")  # the coordinator decides this one; the rank rewinds it
    again.admit(900, 40, "far on, but the data of step 40 again")
    with pytest.raises(NumericFault, match=r"2 times in a row .*steps 900, 2000"):
        again.admit(2000, 40, "the same data once more")


def test_the_straggler_window_reports_medians_by_rank_once_full() -> None:
    window = StragglerWindow(window_steps=3)
    assert window.add(1, [1.0, 3.0]) is None
    assert window.add(2, [9.0, 3.2]) is None  # a hiccup on rank 0
    report = window.add(3, [1.1, 2.9])
    assert report is not None
    assert (report.step, report.rank_step_s, report.window_steps) == (3, [1.1, 3.0], 3)
    assert window.add(4, [1.0, 1.0]) is None  # a fresh window


def _steps(probe: StepProbe, model: GPT, n: int) -> list[tuple[float, float]]:
    """(loss, compute seconds) of ``n`` forward/backward passes through the probe."""
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    out = []
    for _ in range(n):
        probe.begin()
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        out.append((loss.item(), probe.end(fallback_s=-1.0)))
    return out


def test_the_probe_times_compute_and_applies_the_knobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"))
    path = tmp_path / "knobs.json"
    write_knobs(path)
    knobs, _ = reader(path)
    probe = StepProbe(model, torch.device("cpu"), knobs)
    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), real_sleep(s))[1])
    normal = _steps(probe, model, 2)
    assert all(math.isfinite(loss) and seconds > 0 for loss, seconds in normal)
    assert slept == []
    write_knobs(path, slow=3.0)
    (_, seconds), *_ = _steps(probe, model, 1)
    # slept 2 x its compute so far, inside the window: 3 x that compute in all
    assert len(slept) == 1 and slept[0] > 0
    assert seconds >= 1.5 * slept[0]
    write_knobs(path, slow=1.0, nan_loss=1)
    poisoned, after = _steps(probe, model, 2)
    assert not math.isfinite(poisoned[0]) and math.isfinite(after[0])
    with torch.no_grad():  # no backward reaches the embedding: the caller's figure
        probe.begin()
        model(torch.zeros(1, 4, dtype=torch.long))
        assert probe.end(fallback_s=0.5) == 0.5
