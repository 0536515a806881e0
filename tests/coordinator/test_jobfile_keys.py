"""Every job-file key is documented once, with its real default (docs/jobfile.md), and a
key that was removed is refused in one line that says where its setting lives now."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect
import pytest

from coordinator.ctl.jobfile import REMOVED, JobFileError, to_spec
from coordinator.ctl.main import main
from proto.job import JobSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "jobfile.md"
ROW = re.compile(r"^\| `(?P<key>[a-z_]+\.[a-z_0-9]+)` \| [^|]* \| (?P<default>[^|]*) \|")


def spec_defaults() -> dict[str, Any]:
    """``section.key`` → its default as JobSpec has it (NODEFAULT: required)."""
    out: dict[str, Any] = {}
    for section in msgspec.inspect.type_info(JobSpec).fields:  # type: ignore[attr-defined]
        info = section.type
        if isinstance(info, msgspec.inspect.StructType):
            for field in info.fields:
                default = (
                    field.default_factory()
                    if field.default_factory is not msgspec.NODEFAULT
                    else field.default
                )
                out[f"{section.name}.{field.name}"] = default
    return out


def doc_defaults() -> dict[str, Any]:
    """The keys table of docs/jobfile.md: key → its default column, read as TOML."""
    rows: dict[str, Any] = {}
    for line in DOC.read_text().splitlines():
        if (row := ROW.match(line)) is None:
            continue
        key, cell = row["key"], row["default"].strip()
        assert key not in rows, f"{key} is listed twice"
        if cell == "required":
            rows[key] = msgspec.NODEFAULT
        elif cell == "unset":
            rows[key] = None
        else:
            literal = re.fullmatch(r"`([^`]*)`", cell)
            assert literal, f"{key}: default {cell!r} is neither a `TOML value`, unset nor required"
            rows[key] = msgspec.toml.decode(f"v = {literal[1]}".encode())["v"]
    return rows


def test_the_docs_table_lists_exactly_the_job_file_keys_with_their_defaults() -> None:
    documented, actual = doc_defaults(), spec_defaults()
    assert sorted(documented) == sorted(actual)
    for key, default in actual.items():
        assert documented[key] == default, key
        assert type(documented[key]) is type(default), key  # 300 is not 300.0


def test_the_docs_table_is_read_for_real() -> None:
    assert len(doc_defaults()) > 30
    assert doc_defaults()["policy.max_restarts"] == 3


@pytest.mark.parametrize("key", sorted(REMOVED))
def test_a_removed_key_is_one_line_that_says_where_it_lives_now(key: str, tmp_path: Path) -> None:
    section, name = key.split(".")
    path = tmp_path / "old.toml"
    path.write_text(f'[job]\nname = "old"\n\n[{section}]\n{name} = 3\n')
    assert key not in spec_defaults()
    err, out = io.StringIO(), io.StringIO()
    args = ["start", str(path), "--dir", str(tmp_path / "none"), "--nats", "nats://127.0.0.1:9"]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(args)
    assert code == 2 and out.getvalue() == ""
    line = f"coordinatorctl: {path}: unknown key {key!r}: removed; {REMOVED[key]}\n"
    assert err.getvalue() == line


def test_an_unknown_key_that_never_existed_says_only_that() -> None:
    with pytest.raises(JobFileError) as err:
        to_spec({"job": {"name": "x"}, "policy": {"max_restart": 3}}, "job.toml")
    assert str(err.value) == "job.toml: unknown key 'policy.max_restart'"
