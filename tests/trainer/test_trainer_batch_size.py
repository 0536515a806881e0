"""``train.auto_micro_batch``: the halving back-off, tried with an injected step that runs
out of memory above a size (no GPU needed), and the logged no-op on CPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from proto.job import JobSpec
from ringmaster.rank.log import Log, read
from trainer.batch_size import choose_micro_batch, forward_backward, largest_fitting
from trainer.model import GPT
from trainer.presets import get_preset


class FitsUpTo:
    """An attempt that raises CUDA's out-of-memory error above ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tried: list[int] = []
        self.released = 0

    def __call__(self, size: int) -> None:
        self.tried.append(size)
        if size > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at {size}")

    def release(self) -> None:
        self.released += 1


@pytest.mark.parametrize(
    ("start", "limit", "tried"),
    [
        (16, 16, [16]),
        (16, 5, [16, 8, 4]),
        (12, 3, [12, 6, 3]),
        (7, 1, [7, 3, 1]),
    ],
)
def test_halves_on_out_of_memory_until_it_fits(start: int, limit: int, tried: list[int]) -> None:
    attempt = FitsUpTo(limit)
    assert largest_fitting(start, attempt, attempt.release) == tried[-1]
    assert attempt.tried == tried
    assert attempt.released == len(tried) - 1  # between tries only


def test_nothing_fits_re_raises_after_trying_one() -> None:
    attempt = FitsUpTo(0)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        largest_fitting(4, attempt, attempt.release)
    assert attempt.tried == [4, 2, 1]


def test_other_errors_are_not_taken_for_out_of_memory() -> None:
    def broken(size: int) -> None:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        largest_fitting(8, broken, lambda: None)


def test_cpu_is_a_logged_no_op(capsys: pytest.CaptureFixture[str]) -> None:
    attempt = FitsUpTo(1)
    size = choose_micro_batch(8, torch.device("cpu"), attempt, Log(0), agree=lambda s: 1 / 0)
    assert size == 8 and attempt.tried == []
    line = capsys.readouterr().err
    assert "event=micro_batch size=8 auto=skipped reason=no-cuda-device" in line


def test_cuda_uses_the_minimum_over_ranks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 8 * 2**30))
    attempt = FitsUpTo(10)
    agreed: list[int] = []

    def agree(found: int) -> int:  # another rank found only 2 fitting
        agreed.append(found)
        return min(found, 2)

    size = choose_micro_batch(
        32, torch.device("cuda", 0), attempt, Log(0), agree=agree, release=attempt.release
    )
    assert (size, agreed, attempt.tried) == (2, [8], [32, 16, 8])
    [fields] = read(capsys.readouterr().err)
    assert fields["event"] == "micro_batch" and fields["auto"] == "probed"
    assert (fields["size"], fields["requested"], fields["fits_here"]) == ("2", "32", "8")
    assert fields["free_gib"] == "3"


def test_probe_step_runs_the_model_and_leaves_no_gradients() -> None:
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"))
    attempt = forward_backward(model, 16, 256, "fp32", torch.device("cpu"))
    before = torch.get_rng_state()
    attempt(2)
    assert torch.equal(torch.get_rng_state(), before)  # training's RNG stream untouched
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_worker_on_cpu_logs_the_no_op_and_trains_at_the_requested_size(
    tmp_path: Path, launch: Any, make_spec: Callable[..., JobSpec]
) -> None:
    spec = make_spec(train={"auto_micro_batch": True, "micro_batch_size": 3, "steps": 2})
    ranks = launch(spec, world_size=1, env={"RINGMASTER_TEST_TRACE": str(tmp_path)})
    assert ranks.wait() == [0], ranks.log(0)
    [event] = ranks.events(0, "micro_batch")
    assert (event["size"], event["auto"], event["reason"]) == ("3", "skipped", "no-cuda-device")
    records = (tmp_path / "trace-rank-0.jsonl").read_text().splitlines()
    assert [len(json.loads(r)["ids"]) for r in records] == [3, 3]
