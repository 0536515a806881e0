"""The job file of ``coordinatorctl start``: TOML text (and ``--set`` overrides) in, a
``JobSpec`` or one :class:`JobFileError` line out, and nothing written anywhere. A spec
that validates must also survive the wire: the coordinator decodes what the CLI accepted.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import (
    counted,
    cwd_listing,
    json_values,
    listing,
    long_text,
    mutated,
    one_line,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.ctl.jobfile import JobFileError, load_job
from coordinator.ctl.main import main
from proto.api import SubmitJob
from proto.codec import encode, submit_decoder
from proto.job import JobSpec

ROOT = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "job": {
        "name": "fuzz",
        "nodes": 2,
        "gpus_per_node": 1,
        "entry": ["train.py", "--flag"],
        "env": {"A": "b"},
        "pre_start": "hook.sh",
        "pre_start_timeout_s": 30.0,
    },
    "train": {
        "model": "tiny",
        "steps": 10,
        "precision": "bf16",
        "fp8_recipe": "auto",
        "compile": False,
        "micro_batch_size": 2,
        "seq_len": 64,
        "lr": 0.001,
        "seed": 0,
        "engine": "ddp",
        "zero_stage": 1,
    },
    "checkpoint": {"every_steps": 5, "dir": "ckpt", "keep": 2, "staging_dir": "/tmp/x"},
    "policy": {"hang_floor_s": 3.0, "wait_for_nodes_s": 60.0, "max_restarts": 1},
}
KEYS = [f"{s}.{k}" for s, table in BASE.items() for k in table] + ["job", "x.y", "job.env.X"]


# -- a small TOML writer (msgspec's needs tomli_w) ------------------------------------------


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string (\\u escapes of surrogates are invalid)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        items = (f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items() if v is not None)
        return "{" + ", ".join(items) + "}"
    return "1979-05-27T07:32:00Z"  # None: TOML has no null; a datetime is another wrong type


def to_toml(doc: Any) -> str:
    if not isinstance(doc, dict):
        return f"v = {toml_value(doc)}\n"
    head = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    lines = [*head]
    for key, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{json.dumps(key)}]")
            lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# -- the workspace: a temp dir holding the job file and what it names --------------------


@contextlib.contextmanager
def workspace() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-jobfile-") as name:
        base = Path(name)
        (base / "train.py").write_text("print('hi')\n")
        (base / "hook.sh").write_text("true\n")
        yield base


def check_load(base: Path, content: bytes, overrides: list[str]) -> JobSpec | JobFileError:
    """The contract of load_job, asserted; returns what it gave."""
    path = base / "job.toml"
    path.write_bytes(content)
    before, cwd_before, cwd = listing(base), cwd_listing(), Path.cwd()
    try:
        spec: JobSpec | JobFileError = load_job(path, overrides)
    except JobFileError as exc:
        spec = exc
        assert one_line(str(exc)), repr(str(exc))
    assert listing(base) == before, "load_job wrote into the job file's directory"
    assert cwd_listing() == cwd_before and Path.cwd() == cwd, "load_job touched the cwd"
    if isinstance(spec, JobSpec):
        # What validates locally is what the coordinator will decode: the same spec.
        wire = submit_decoder.decode(encode(SubmitJob(spec=spec)))
        assert wire.spec == spec, "the spec changed on the wire"
        entry = spec.job.entry or [""]
        assert not entry[0].endswith(".py") or Path(entry[0]).is_absolute()
    return spec


toml_docs = mutated(BASE).map(to_toml).map(lambda s: s.encode("utf-8", errors="surrogatepass"))


@given(st.one_of(st.binary(max_size=400), toml_docs))
@counted
def test_job_file_bytes(content: bytes) -> None:
    with workspace() as base:
        check_load(base, content, [])


@given(
    st.one_of(
        toml_docs,
        st.just(to_toml(BASE).encode()),
        st.builds(lambda t: t.encode("utf-8", errors="surrogatepass"), st.text(max_size=200)),
    )
)
@counted
def test_job_file_structured(content: bytes) -> None:
    with workspace() as base:
        check_load(base, content, [])


argv_text = st.text(
    alphabet=st.one_of(st.characters(), st.sampled_from(["\udcff", "\udc80", "=", ".", "\n"])),
    max_size=40,
)
overrides = st.one_of(
    argv_text,
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), argv_text),
    st.builds(lambda k, v: f"{k}={toml_value(v)}", st.sampled_from(KEYS), json_values(4)),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), long_text()),
)


@given(st.lists(overrides, min_size=1, max_size=3))
@counted
def test_job_file_overrides(items: list[str]) -> None:
    with workspace() as base:
        result = check_load(base, to_toml(BASE).encode(), items)
        if isinstance(result, JobFileError) and any(i.startswith("job.name=") for i in items):
            assert str(result)  # the error names something: never an empty line


def test_a_valid_file_loads() -> None:
    with workspace() as base:
        spec = check_load(base, to_toml(BASE).encode(), ["train.steps=7"])
        assert isinstance(spec, JobSpec) and spec.train.steps == 7


@pytest.mark.parametrize(
    "path_suffix", ["job.toml/inside", "missing.toml", "", "x" * 300 + ".toml"]
)
def test_odd_job_file_paths(path_suffix: str) -> None:
    with workspace() as base:
        (base / "job.toml").write_text(to_toml(BASE))
        with pytest.raises(JobFileError) as err:
            load_job(base / path_suffix, [])
        assert one_line(str(err.value))


# -- coordinatorctl start ------------------------------------------------------------------


def ctl_args(base: Path, path: Path, items: list[str]) -> list[str]:
    sets = [arg for item in items for arg in ("--set", item)]
    home = str(base / "no-cluster-here")
    return ["start", str(path), "--dir", home, "--nats", "nats://127.0.0.1:9", *sets]


@given(st.one_of(st.binary(max_size=200), toml_docs), st.lists(overrides, max_size=2))
@counted
def test_ctl_start_in_process(content: bytes, items: list[str]) -> None:
    """``coordinatorctl start`` on a bad file: exit 2, one stderr line, before any bus."""
    if any(i.startswith("-") for i in items):
        return  # argparse's business, not the job file's
    with workspace() as base:
        result = check_load(base, content, items)
        if not isinstance(result, JobFileError):
            return  # a valid file would go on to connect
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(ctl_args(base, base / "job.toml", items))
        assert code == 2
        assert out.getvalue() == ""
        assert err.getvalue() == f"coordinatorctl: {result}\n"


@settings(max_examples=int(os.environ.get("RINGMASTER_FUZZ_CLI_EXAMPLES", "4")))
@given(st.one_of(st.binary(max_size=200), toml_docs))
@counted
def test_ctl_start_subprocess(content: bytes) -> None:
    """The real process: exit 2, one stderr line, no traceback (a small sample: each
    example costs a Python start)."""
    with workspace() as base:
        result = check_load(base, content, [])
        if not isinstance(result, JobFileError):
            return
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [
            sys.executable,
            "-m",
            "coordinator.ctl.main",
            *ctl_args(base, base / "job.toml", []),
        ]
        proc = subprocess.run(argv, capture_output=True, timeout=60, env=env, cwd=base)
        stderr = proc.stderr.decode(errors="replace")
        assert proc.returncode == 2, stderr
        assert b"Traceback" not in proc.stderr
        assert stderr.count("\n") == 1 and stderr.startswith("coordinatorctl: "), stderr
        assert proc.stdout == b""
        assert listing(base) == {"job.toml", "train.py", "hook.sh"}


@pytest.mark.parametrize(
    "tail", ["[train]\nlr = inf\n", "[policy]\nhang_floor_s = inf\n", "[job.env]\nX = 1\n"]
)
def test_values_the_wire_cannot_carry_are_refused(tail: str) -> None:
    with workspace() as base:
        result = check_load(base, b'[job]\nname = "x"\nnodes = 99999999999999999999999\n', [])
        assert isinstance(result, JobFileError)
        result = check_load(base, ('[job]\nname = "x"\n' + tail).encode(), [])
        assert isinstance(result, JobFileError)
