"""Checkpoint staging, sealing and the resume rules, in one process (world size 1)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ringmaster.clock import SYSTEM, Clock, ManualClock
from ringmaster.rank import durable
from ringmaster.rank.checkpoint import Checkpointer, HostBuffers, Stage, Written
from ringmaster.rank.coordination import Coordination, find_resumable, load_file


def own_files(manifest: durable.Manifest) -> list[str]:
    return ["rank-0.pt"]


def resumes_from(root: Path) -> str | None:
    found = find_resumable(root, Coordination(), own_files)
    return found[1].name if found else None


def make(
    tmp_path: Path, keep: int = 3, clock: Clock = SYSTEM
) -> tuple[Checkpointer, list[tuple[int, Path, float]]]:
    reported: list[tuple[int, Path, float]] = []
    ckpt = Checkpointer(
        tmp_path / "ckpt",
        tmp_path / "staging",
        Coordination(),
        keep=keep,
        engine="ddp",
        job="t-0a1b2c",
        on_durable=lambda step, path, stall: reported.append((step, path, stall)),
        clock=clock,
    )
    return ckpt, reported


def state(step: int) -> Stage:
    """A snapshot function handing over one in-memory object, as a DDP rank does."""

    def stage(directory: Path, target: Path) -> dict[str, Any]:
        return {"rank-0.pt": {"step": step, "weights": torch.full((64,), float(step))}}

    return stage


def staged_file(step: int) -> Stage:
    """A snapshot function that writes its file into the staging dir, as DeepSpeed's
    recovery scripts are."""

    def stage(directory: Path, target: Path) -> dict[str, Any]:
        (directory / "extra").mkdir()
        (directory / "extra" / "notes.txt").write_text(f"step {step}")
        return {"rank-0.pt": {"step": step}}

    return stage


def taking(clock: ManualClock, seconds: float, stage: Stage) -> Stage:
    """``stage``, taking ``seconds`` of ``clock``'s time."""

    def slow(directory: Path, target: Path) -> dict[str, Any]:
        clock.advance(seconds)
        return stage(directory, target)

    return slow


def test_save_seals_manifest_moves_latest_and_prunes(tmp_path: Path) -> None:
    clock = ManualClock()
    ckpt, reported = make(tmp_path, keep=2, clock=clock)
    stalls = []
    for step in (10, 20, 30):
        stalls.append(ckpt.save(step, taking(clock, step / 100, state(step))))
        # the seconds the caller was blocked (the snapshot's), and what gets reported
        assert stalls[-1] == pytest.approx(step / 100)
        assert ckpt.last_stall_s == stalls[-1]
    ckpt.close()
    assert [r[2] for r in reported] == stalls
    root = tmp_path / "ckpt"
    assert durable.read_latest(root) == "step-30"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-20", "step-30"]
    manifest = durable.read_manifest(root / "step-30")
    assert manifest is not None and manifest.step == 30 and manifest.world_size == 1
    assert durable.verify(root / "step-30", manifest, "rank-0.pt")
    assert manifest.ranks == {"0": ["rank-0.pt"]} and manifest.job == "t-0a1b2c"
    assert [r[0] for r in reported] == [10, 20, 30]
    assert not (tmp_path / "staging").exists()  # the staged copy is dropped on close
    assert resumes_from(root) == "step-30"
    assert torch.equal(
        load_file(root / "step-30" / "rank-0.pt")["weights"], torch.full((64,), 30.0)
    )


def test_saving_the_same_step_again_reports_it_without_rewriting(tmp_path: Path) -> None:
    ckpt, reported = make(tmp_path)
    ckpt.save(5, state(5))
    ckpt.wait()
    created = durable.read_manifest(tmp_path / "ckpt" / "step-5")
    ckpt.save(5, state(5))
    ckpt.close()
    assert [r[0] for r in reported] == [5, 5]
    assert durable.read_manifest(tmp_path / "ckpt" / "step-5") == created


def test_a_step_is_reported_durable_before_step_reports_can_name_it(tmp_path: Path) -> None:
    """Rank 0's step reports carry ``durable_step``; its own report must go out first, or
    the coordinator would take a step report's word for a report still on its way."""
    seen: list[tuple[int, int | None]] = []
    ckpt = Checkpointer(
        tmp_path / "ckpt",
        tmp_path / "staging",
        Coordination(),
        keep=3,
        engine="ddp",
        job="t-0a1b2c",
        on_durable=lambda step, path, stall: seen.append((step, ckpt.durable_step)),
    )
    ckpt.save(10, state(10))
    ckpt.save(20, state(20))
    ckpt.close()
    assert seen == [(10, None), (20, 10)] and ckpt.durable_step == 20


def test_loop_blocks_only_for_the_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, _ = make(tmp_path)
    release = threading.Event()
    real_write = durable.write_and_hash

    def held_write(dst: Path, write: Any) -> durable.FileEntry:
        release.wait(30)
        return real_write(dst, write)

    monkeypatch.setattr(durable, "write_and_hash", held_write)
    ckpt.save(1, state(1))  # returns while serialisation is held
    assert durable.read_latest(tmp_path / "ckpt") is None
    assert not list(tmp_path.rglob("*.pt"))  # nothing serialised yet, anywhere
    release.set()
    ckpt.wait()
    assert durable.read_latest(tmp_path / "ckpt") == "step-1"


def test_staged_files_and_snapshot_objects_share_the_manifest(tmp_path: Path) -> None:
    ckpt, _ = make(tmp_path)
    ckpt.save(2, staged_file(2))
    ckpt.close()
    step_dir = tmp_path / "ckpt" / "step-2"
    manifest = durable.read_manifest(step_dir)
    assert manifest is not None and manifest.ranks == {"0": ["extra/notes.txt", "rank-0.pt"]}
    assert all(durable.verify(step_dir, manifest, name) for name in manifest.files)
    assert (step_dir / "extra" / "notes.txt").read_text() == "step 2"
    assert load_file(step_dir / "rank-0.pt") == {"step": 2}


def written_by_engine(step: int, release: threading.Event, fail: bool = False) -> Stage:
    """A snapshot function whose engine writes its own file into the step dir from another
    thread, as DCP's upload thread does; ``wait`` fails if the write did."""

    def stage(directory: Path, target: Path) -> dict[str, Any]:
        done: list[str] = []

        def upload() -> None:
            release.wait(30)
            if not fail:
                (target / "dcp").mkdir(parents=True)
                (target / "dcp" / "__0_0.distcp").write_bytes(bytes([step]) * 100)
                done.append("dcp/__0_0.distcp")

        thread = threading.Thread(target=upload)
        thread.start()

        def wait() -> list[str]:
            thread.join()
            if not done:
                raise OSError("upload failed")
            return done

        return {"dcp": Written(wait), "trainer-rank-0.pt": {"step": step}}

    return stage


def test_files_an_engine_writes_itself_are_waited_for_hashed_and_sealed(tmp_path: Path) -> None:
    ckpt, reported = make(tmp_path)
    release = threading.Event()
    ckpt.save(3, written_by_engine(3, release))
    assert ckpt.last_in_memory == ["dcp", "trainer-rank-0.pt"]
    assert durable.read_latest(tmp_path / "ckpt") is None  # sealed only after the upload
    release.set()
    ckpt.wait()
    step_dir = tmp_path / "ckpt" / "step-3"
    manifest = durable.read_manifest(step_dir)
    assert manifest is not None
    assert manifest.ranks == {"0": ["dcp/__0_0.distcp", "trainer-rank-0.pt"]}
    assert manifest.files["dcp/__0_0.distcp"].size == 100
    assert durable.verify(step_dir, manifest, "dcp/__0_0.distcp")
    assert [step for step, _, _ in reported] == [3]
    # a failed upload leaves step 3 as the newest checkpoint
    ckpt.save(4, written_by_engine(4, release, fail=True))
    ckpt.close()
    assert durable.read_latest(tmp_path / "ckpt") == "step-3"
    assert durable.read_manifest(tmp_path / "ckpt" / "step-4") is None


def test_host_buffers_snapshot_is_private_and_reused() -> None:
    weight = torch.randn(4, 3)
    model: OrderedDict[str, torch.Tensor] = OrderedDict(emb=weight, head=weight, bias=torch.ones(3))
    model._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    live = {"model": model, "optimizer": {"state": {0: {"step": torch.tensor(5.0)}}, "lr": [0.1]}}
    buffers = HostBuffers()
    first = buffers.copy(live, "rank-0.pt")
    snap = {k: v.clone() for k, v in first["model"].items()}
    assert first["model"]._metadata == model._metadata  # type: ignore[attr-defined]
    assert first["model"]["emb"] is first["model"]["head"]  # tied weights stay tied
    assert first["model"]["emb"].data_ptr() != weight.data_ptr()
    weight.add_(1.0)  # the next optimizer step
    live["optimizer"]["state"][0]["step"].add_(1)  # type: ignore[index]
    assert torch.equal(first["model"]["emb"], snap["emb"])
    assert first["optimizer"]["state"][0]["step"].item() == 5.0
    second = buffers.copy(live, "rank-0.pt")
    assert second["model"]["emb"].data_ptr() == first["model"]["emb"].data_ptr()  # reused
    assert torch.equal(second["model"]["emb"], weight)
    assert second["optimizer"]["state"][0]["step"].item() == 6.0
    assert buffers.nbytes == (12 + 3 + 1) * 4


def test_corrupt_or_partial_checkpoints_are_skipped(tmp_path: Path) -> None:
    ckpt, _ = make(tmp_path, keep=5)
    for step in (1, 2, 3, 4):
        ckpt.save(step, state(step))
    ckpt.close()
    root = tmp_path / "ckpt"

    # a persist that died before its manifest, newer than latest: ignored
    (root / "step-9").mkdir()
    (root / "step-9" / "rank-0.pt").write_bytes(b"partial")
    assert resumes_from(root) == "step-4"
    # a shard whose bytes changed (same size): caught by the checksum
    shard = root / "step-4" / "rank-0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert resumes_from(root) == "step-3"
    # a corrupt manifest
    (root / "step-3" / "manifest.json").write_text("{not json")
    assert resumes_from(root) == "step-2"
    # a truncated shard
    shard = root / "step-2" / "rank-0.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    assert resumes_from(root) == "step-1"
    # a missing shard
    (root / "step-1" / "rank-0.pt").unlink()
    assert resumes_from(root) is None


def test_without_latest_every_sealed_dir_is_a_candidate(tmp_path: Path) -> None:
    ckpt, _ = make(tmp_path)
    for step in (1, 2):
        ckpt.save(step, state(step))
    ckpt.close()
    (tmp_path / "ckpt" / "latest").unlink()
    assert durable.candidates(tmp_path / "ckpt") == ["step-2", "step-1"]


def test_host_buffers_are_reserved_in_the_background_for_the_first_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = torch.randn(4, 3)
    live = {
        "model": {"emb": weight, "head": weight, "bias": torch.ones(3)},  # tied: one buffer
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(4, 3), "step": torch.tensor(1.0)}}},
        "lr": 0.1,
    }
    release = threading.Event()
    threads: list[str] = []
    real = HostBuffers._allocate

    def held(self: HostBuffers, *args: Any) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        release.wait(30)
        return real(self, *args)

    monkeypatch.setattr(HostBuffers, "_allocate", held)
    buffers = HostBuffers()
    buffers.reserve({"rank-0.pt": live})  # returns while the allocation is held
    release.set()
    buffers.wait()
    assert buffers.allocations == 4 and set(threads) == {"host-buffers"}
    assert buffers.nbytes == (12 + 3 + 12 + 1) * 4
    weight.add_(1.0)  # training goes on after the reservation
    first = buffers.copy(live, "rank-0.pt")
    assert buffers.allocations == 4  # the first copy allocated nothing
    assert torch.equal(first["model"]["emb"], weight) and first["lr"] == 0.1
    assert first["model"]["emb"] is first["model"]["head"]
