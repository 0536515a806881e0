"""The trainer at GPU speed, what of it a CPU can check: preset sizes, model FLOPs and MFU,
the float8 recipe chosen per linear, compiled blocks against eager ones, activation
checkpointing, and the defaults each of them takes on CUDA and on CPU."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
import torch._inductor.config as inductor_config

from proto.job import JobSpec, TrainSection
from ringmaster.rank.log import Log, read
from trainer import compile as regional
from trainer.batch_size import choose_micro_batch, forward_backward
from trainer.build import activation_checkpointing, build_model
from trainer.engine_deepspeed import ds_config
from trainer.flops import Mfu, device_peak, model_flops_per_token, peak_bf16_flops
from trainer.fp8_auto import Choice, choose, plan
from trainer.model import GPT, Block, count_params, lm_loss
from trainer.precision import apply_precision
from trainer.presets import NOMINAL_PARAMS, PRESETS, get_preset, param_count

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_has_its_documented_size_and_float8_dims(name: str) -> None:
    cfg = get_preset(name)
    with torch.device("meta"):
        model = GPT(cfg)
    assert count_params(model) == param_count(cfg)
    assert abs(param_count(cfg) / NOMINAL_PARAMS[name] - 1) < 0.03
    assert all(n % 16 == 0 for n in (cfg.vocab_size, cfg.d_model, cfg.d_model // cfg.n_heads))


def test_3b_preset_is_three_billion_wide_enough_for_float8() -> None:
    cfg = get_preset("3b")
    assert cfg.d_model >= 3072 and cfg.d_model // cfg.n_heads == 128
    assert 2.9e9 < param_count(cfg) < 3.2e9


def test_model_flops_per_token_by_hand_for_125m() -> None:
    # 6N with N = tokens 50304*768 (tied head) + 12 blocks * (12*768² + 13*768) + final
    # norm 2*768 = 38,633,472 + 85,054,464 + 1,536 = 123,689,472 (position table left out);
    # attention 12 * 12 layers * 768 * 1024 tokens = 113,246,208.
    assert model_flops_per_token(get_preset("125m"), 1024) == 6 * 123_689_472 + 113_246_208


def test_mfu_is_none_off_cuda_and_a_fraction_of_the_peak_on_known_gpus() -> None:
    assert device_peak(CPU) is None
    flops = model_flops_per_token(get_preset("1b3"), 2048)
    assert Mfu(flops, device_peak(CPU), 1).of(10_000.0) is None
    assert peak_bf16_flops("NVIDIA H200") == peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("Some Future Accelerator") is None
    mfu = Mfu(flops, 989e12, 8).of(200_000.0)
    assert mfu == pytest.approx(200_000 * flops / (8 * 989e12))


@pytest.mark.parametrize(
    ("shape", "outliers", "recipe", "expected"),
    [
        ((1024, 1024), False, "auto", Choice(None, "too-small-to-gain")),
        ((4096, 1024), True, "auto", Choice(None, "too-small-to-gain")),
        ((1000, 4096), False, "auto", Choice(None, "dims-not-multiples-of-16")),
        ((1024, 3072), False, "auto", Choice("tensorwise", "tensorwise-pays")),
        ((8192, 2048), True, "auto", Choice("tensorwise", "tensorwise-pays")),  # N <= 2048
        ((12288, 3072), False, "auto", Choice("tensorwise", "tensorwise-pays")),
        ((12288, 3072), True, "auto", Choice("rowwise", "outlier-input-and-rowwise-pays")),
        ((128, 128), False, "rowwise", Choice("rowwise", "requested")),
        ((100, 128), False, "tensorwise", Choice(None, "dims-not-multiples-of-16")),
    ],
)
def test_recipe_choice_by_shape(
    shape: tuple[int, int], outliers: bool, recipe: str, expected: Choice
) -> None:
    assert choose(*shape, recipe, outliers) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("preset", "tensorwise", "rowwise"),
    [
        ("tiny", set(), set()),
        ("350m", {"attn.qkv", "mlp.fc"}, set()),
        ("1b3", {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}, set()),
        ("3b", {"attn.qkv", "attn.proj", "mlp.fc"}, {"mlp.proj"}),
    ],
)
def test_auto_plan_per_preset(preset: str, tensorwise: set[str], rowwise: set[str]) -> None:
    with torch.device("meta"):
        model = GPT(get_preset(preset))
    choices = plan(model, "auto")
    assert len(choices) == 4 * get_preset(preset).n_layers
    roles = {
        s: {f.split(".", 2)[2] for f, c in choices.items() if c.scaling == s}
        for s in ("tensorwise", "rowwise")
    }
    assert roles == {"tensorwise": tensorwise, "rowwise": rowwise}


def test_build_model_logs_which_linears_run_in_float8_and_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torchao.float8.float8_linear import Float8Linear

    train = TrainSection(model="small", precision="fp8", engine="ddp")
    model = build_model(train, get_preset("small"), CPU, Log(0))
    fields = list(read(capsys.readouterr().err))
    logged = {f["linears"].removeprefix("blocks.*."): f for f in fields if f["event"] == "float8"}
    assert len(fields) == len(logged) == 4  # once per role of linear, not per block
    assert logged["attn.qkv"] | {"t": "-", "wall": "-"} == {
        "trainer": "true",
        "t": "-",  # the log's clocks
        "wall": "-",
        "rank": "0",
        "attempt": "0",
        "event": "float8",
        "recipe": "auto",
        "linears": "blocks.*.attn.qkv",
        "count": "6",
        "shape": "512x1536",
        "runs_in": "tensorwise",
        "why": "tensorwise-pays",
    }
    why = {role: (f["shape"], f["runs_in"], f["why"]) for role, f in logged.items()}
    assert why["mlp.fc"] == ("512x2048", "tensorwise", "tensorwise-pays")
    assert why["attn.proj"] == ("512x512", "fp32", "too-small-to-gain")  # bf16 on CUDA
    assert why["mlp.proj"] == ("2048x512", "fp32", "too-small-to-gain")
    fp8 = {n.split(".", 2)[2] for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert fp8 == {role for role, f in logged.items() if f["runs_in"] == "tensorwise"}


def test_fp8_recipe_defaults_to_auto_and_the_speed_keys_to_the_device() -> None:
    spec = msgspec.convert({"job": {"name": "x"}}, JobSpec)
    assert spec.train.fp8_recipe == "auto"
    assert spec.train.compile is None and spec.train.activation_checkpointing is None
    assert not regional.wanted(None, CPU) and regional.wanted(None, CUDA)
    assert regional.wanted(True, CPU) and not regional.wanted(False, CUDA)
    big, small = get_preset("1b3"), get_preset("350m")
    assert activation_checkpointing(None, big, CUDA)
    assert activation_checkpointing(None, get_preset("3b"), CUDA)
    assert not activation_checkpointing(None, small, CUDA)
    assert not activation_checkpointing(None, big, CPU)
    assert activation_checkpointing(True, small, CPU)
    # DeepSpeed's fp8 runs BF16 around the float8 linears on CUDA, fp32 on CPU
    train = TrainSection(precision="fp8")
    assert ds_config(train, "fp8", CUDA)["bf16"] == {"enabled": True}
    assert ds_config(train, "fp8", CPU)["bf16"] == {"enabled": False}


def test_compile_cache_is_the_nodes_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert regional.cache_dir(
        {"RINGMASTER_COMPILE_CACHE": "/n/c", "TORCHINDUCTOR_CACHE_DIR": "/x"}
    ) == Path("/n/c")
    assert regional.cache_dir({"TORCHINDUCTOR_CACHE_DIR": "/x"}) == Path("/x")
    assert regional.cache_dir({}).name.startswith("ringmaster-compile-cache-")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored after the test
    regional.use_cache(tmp_path / "cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")
    assert (tmp_path / "cache").is_dir() and inductor_config.fx_graph_cache


def test_compile_clock_reports_the_first_steps_excess_once() -> None:
    clock = regional.CompileClock(enabled=True)
    assert [clock.record(s) for s in (30.5, 0.5, 0.4)] == [None, 30.0, None]
    assert regional.CompileClock(enabled=False).record(30.0) is None


def _losses(compiled: str | None, checkpointed: bool, steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"), checkpointed)
    if compiled:
        regional.compile_blocks(model, compiled)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 33), generator=generator)
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_compiled_blocks_train_as_eager_ones_do(monkeypatch: pytest.MonkeyPatch) -> None:
    # Inductor's CPU code needs a C compiler; without one, AOT autograd alone is compiled.
    backend = "inductor" if shutil.which("cc") or shutil.which("gcc") else "aot_eager"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored after the test
    regional.use_cache(regional.cache_dir({}))  # the node's cache: fast when warm
    torch._dynamo.reset()
    eager = _losses(None, checkpointed=False)
    for checkpointed in (False, True):
        compiled = _losses(backend, checkpointed)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_activation_checkpointing_recomputes_each_block_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    real = Block._forward

    def counted(self: Block, x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(self, x)

    monkeypatch.setattr(Block, "_forward", counted)
    grads = {}
    for checkpointed in (False, True):
        calls.clear()
        torch.manual_seed(0)
        model = GPT(get_preset("tiny"), checkpointed)
        tokens = torch.randint(0, 256, (2, 17))
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads[checkpointed] = [p.grad for p in model.parameters()]
        assert len(calls) == 2 * (2 if checkpointed else 1)  # 2 blocks, recomputed or not
    for plain, recomputed in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(recomputed, plain)


def test_auto_micro_batch_search_runs_with_activation_checkpointing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search's tries run the real (checkpointed) model; on a "GPU" that fits up to 3
    samples it settles on 2."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30, 2**31))
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"), activation_checkpointing=True)
    probe = forward_backward(model, 32, 256, "fp32", CPU)
    tried = []

    def attempt(size: int) -> None:
        tried.append(size)
        probe(size)  # forward and backward, recomputing each block
        if size > 3:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at {size}")

    size = choose_micro_batch(8, CUDA, attempt, Log(0), agree=lambda s: s, release=lambda: None)
    assert (size, tried) == (2, [8, 4, 2])
    assert all(p.grad is None for p in model.parameters())


def test_auto_converts_3b_with_both_scalings() -> None:
    """The one preset where "auto" mixes recipes, converted on the meta device (no memory):
    each linear gets the scaling its plan says."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        model = GPT(get_preset("3b"))
    apply_precision(model, "fp8", CPU, "auto")
    granularity = {
        name.split(".", 2)[2]: m.config.cast_config_weight.scaling_granularity
        for name, m in model.named_modules()
        if isinstance(m, Float8Linear)
    }
    tensorwise, rowwise = ScalingGranularity.TENSORWISE, ScalingGranularity.AXISWISE
    assert granularity == {
        "attn.qkv": tensorwise,
        "attn.proj": tensorwise,
        "mlp.fc": tensorwise,
        "mlp.proj": rowwise,
    }
