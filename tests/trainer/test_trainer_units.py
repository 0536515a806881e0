"""Fast in-process checks: presets, model, precision, data order, launch and control."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from proto.job import JobSpec
from proto.progress import ControlWord
from ringmaster.rank.control import Action, Decision, fold
from ringmaster.rank.launch import SpecError, read_launch, torch_threads
from trainer.data import Batches, Layout, sample_ids, synthetic_sample
from trainer.model import GPT
from trainer.precision import apply_precision, count_float8_linears
from trainer.presets import PRESETS, get_preset
from trainer.tokenize import main as tokenize_main

REPO = Path(__file__).resolve().parents[2]


def test_unknown_preset_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'huge'") as err:
        get_preset("huge")
    assert all(name in str(err.value) for name in PRESETS)


def test_model_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(get_preset("tiny")).eval()
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, b = model(tokens), model(changed)
    assert a.shape == (1, 16, 256)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def _float8_fqns(model: torch.nn.Module) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}


def test_fp8_recipes_convert_block_linears_only_and_forward_differs_slightly() -> None:
    from torchao.float8.config import ScalingGranularity

    torch.manual_seed(0)
    fp32 = GPT(get_preset("tiny"))
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        ref = fp32(tokens)
    outs, converted = {}, {}
    for recipe, granularity in (
        ("tensorwise", ScalingGranularity.TENSORWISE),
        ("rowwise", ScalingGranularity.AXISWISE),
    ):
        fp8 = apply_precision(copy.deepcopy(fp32), "fp8", torch.device("cpu"), recipe)
        # 4 linears per block (qkv, attn proj, mlp fc, mlp proj), 2 blocks; not the LM head
        assert count_float8_linears(fp8) == 8
        assert type(fp8.head) is torch.nn.Linear
        converted[recipe] = _float8_fqns(fp8)
        configs = [m.config for m in fp8.modules() if hasattr(m, "config")]
        assert configs and all(c.emulate for c in configs)  # no float8 matmul on CPU
        assert {c.cast_config_weight.scaling_granularity for c in configs} == {granularity}
        with torch.no_grad():
            outs[recipe] = fp8(tokens)
        rel = ((outs[recipe] - ref).abs().max() / ref.abs().max()).item()
        assert 0 < rel < 0.2, (recipe, rel)
    assert count_float8_linears(fp32) == 0
    assert converted["tensorwise"] == converted["rowwise"]
    assert not torch.equal(outs["tensorwise"], outs["rowwise"])  # the recipe took effect


def test_fp8_recipe_is_an_optional_checked_key() -> None:
    base = {"job": {"name": "x"}}
    assert msgspec.convert(base, JobSpec).train.fp8_recipe == "auto"
    spec = msgspec.convert({**base, "train": {"fp8_recipe": "rowwise"}}, JobSpec)
    assert spec.train.fp8_recipe == "rowwise"
    with pytest.raises(msgspec.ValidationError, match="fp8_recipe"):
        msgspec.convert({**base, "train": {"fp8_recipe": "blockwise"}}, JobSpec)


def test_sample_ids_are_disjoint_and_a_pure_function_of_step_and_rank() -> None:
    layout = Layout(micro_batch_size=3, world_size=2)
    seen = [i for step in range(5) for rank in range(2) for i in sample_ids(layout, step, rank)]
    assert sorted(seen) == list(range(30))
    assert sample_ids(layout, 4, 1) == [27, 28, 29]


def test_synthetic_batches_are_deterministic_and_learnable() -> None:
    a = Batches("synthetic", seq_len=32, vocab_size=256, seed=7, layout=Layout(4, 2), rank=1)
    b = Batches("synthetic", seq_len=32, vocab_size=256, seed=7, layout=Layout(4, 2), rank=1)
    for step in (0, 3, 1000):
        xa, ya = a.batch(step)
        xb, yb = b.batch(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are inputs shifted by one
    sample = synthetic_sample(7, 0, 200, 256)
    strides = np.diff(sample) % 256
    assert np.bincount(strides).max() > 150  # mostly one stride: a pattern to learn
    assert not np.array_equal(sample, synthetic_sample(8, 0, 200, 256))


def test_token_file_visits_every_window_once_per_epoch(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(10 * 9, dtype=np.uint16).tofile(path)  # 10 windows of seq_len 8 + 1
    batches = Batches(str(path), seq_len=8, vocab_size=1000, seed=1, layout=Layout(5, 1), rank=0)
    firsts = [int(x[0]) for step in (0, 1) for x in batches.batch(step)[0]]
    assert sorted(firsts) == list(range(0, 90, 9))
    big = Batches(str(path), seq_len=8, vocab_size=50, seed=1, layout=Layout(5, 1), rank=0)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        big.batch(0)


def test_fold_keeps_checkpoint_and_stop_wins() -> None:
    def words(*actions: str) -> list[ControlWord]:
        return [ControlWord(action=a, seq=i) for i, a in enumerate(actions, 1)]  # type: ignore[arg-type]

    assert fold([]) == Decision()
    assert fold(words("pause", "checkpoint")) == Decision(Action.PAUSE, True, 2)
    assert fold(words("pause", "resume")).action == Action.RESUME
    assert fold(words("stop", "resume")).action == Action.STOP


def test_read_launch_env_contract(tmp_path: Path, make_spec: Callable[..., JobSpec]) -> None:
    spec_path = tmp_path / "spec.json"
    spec_path.write_bytes(msgspec.json.encode(make_spec()))
    env = {
        "RINGMASTER_JOB_SPEC": str(spec_path),
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
        "RINGMASTER_WORKDIR": str(tmp_path),
        "RINGMASTER_CONTROL_SOCKET": "/run/agent.sock",
    }
    launch = read_launch(env, [])
    assert (launch.rank, launch.world_size, launch.master_port) == (1, 2, 29400)
    assert launch.job_id == "local"
    assert launch.resolve("ckpt") == tmp_path / "ckpt"
    assert launch.control_socket == Path("/run/agent.sock")
    with pytest.raises(SpecError, match="needs MASTER_ADDR and MASTER_PORT"):
        read_launch({k: v for k, v in env.items() if k != "MASTER_PORT"}, [])
    with pytest.raises(SpecError, match="no job spec"):
        read_launch({}, [])
    assert torch_threads({"OMP_NUM_THREADS": "3"}, 2) == 3
    assert torch_threads({}, 10_000) == 1


def test_toml_config_is_read_when_no_spec_env(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('[job]\nname = "t"\n[train]\nsteps = 7\n')
    assert read_launch({}, ["--config", str(config)]).spec.train.steps == 7


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[job]\nname = "t"\n[train]\nstepz = 7\n', "unknown field `stepz`"),
        ('[job]\nname = "t"\n[train]\nmodel = "huge"\n', "unknown model preset 'huge'"),
        ('[job]\nname = "t"\n[train]\nseq_len = 4096\n', "exceeds 'tiny'"),
        ('[job]\nname = "t"\n[train]\ndata = "missing.bin"\n', "missing.bin"),
    ],
)
def test_bad_spec_is_one_line_and_exit_2(tmp_path: Path, toml: str, message: str) -> None:
    config = tmp_path / "job.toml"
    config.write_text(toml)
    done = subprocess.run(
        [sys.executable, "-m", "trainer.worker", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_tokenize_writes_byte_tokens_the_data_reader_reads(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("héllo, world\n" * 20)
    out = tmp_path / "a.bin"
    assert tokenize_main([str(text), "-o", str(out)]) == 0
    tokens = np.fromfile(out, dtype=np.uint16)
    assert bytes(tokens.astype(np.uint8)) == text.read_bytes()
    batches = Batches(str(out), seq_len=15, vocab_size=256, seed=0, layout=Layout(2, 1), rank=0)
    inputs, _ = batches.batch(0)
    assert inputs.shape == (2, 15) and int(inputs.max()) < 256
    assert tokenize_main([str(tmp_path / "missing.txt"), "-o", str(out)]) == 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp8_runs_bf16_around_the_float8_linears_on_cuda_only() -> None:
    from trainer.precision import autocast_context

    on_gpu = autocast_context("fp8", torch.device("cuda"))()
    assert isinstance(on_gpu, torch.autocast) and on_gpu.fast_dtype == torch.bfloat16
    assert not isinstance(autocast_context("fp8", torch.device("cpu"))(), torch.autocast)
    assert autocast_context("bf16", torch.device("cpu"))().fast_dtype == torch.bfloat16  # type: ignore[attr-defined]


def test_replicated_share_deals_every_parameter_to_one_rank_with_its_optimizer_state() -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ringmaster.rank.dcp_async import replicated_share

    model = GPT(get_preset("tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    shares = [replicated_share(state, rank, 3) for rank in range(3)]
    owners = [set(share["model"]) for share in shares]
    assert set().union(*owners) == set(model_sd)  # every parameter saved ...
    assert sum(len(o) for o in owners) == len(model_sd)  # ... by exactly one rank
    for share, own in zip(shares, owners, strict=True):
        assert set(share["optimizer"]["state"]) <= own  # moments travel with their weight
        assert share["optimizer"]["param_groups"] == optim_sd["param_groups"]
    sizes = [sum(t.numel() for t in share["model"].values()) for share in shares]
    assert max(sizes) < 0.5 * sum(sizes)  # about a third each, not all on one rank
    assert replicated_share(state, 0, 1)["model"].keys() == model_sd.keys()
