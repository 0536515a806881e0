"""Preflight on fixture trees (one captured from this machine), the detector, and
``nodeagent --preflight`` as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from nodeagent.collectors.base import Roots
from nodeagent.collectors.preflight import (
    PreflightCollector,
    PreflightSample,
    SpaceNeed,
    existing,
)
from nodeagent.detectors.preflight import PreflightDetector
from proto.conditions import ConditionKind, condition_key
from proto.events import NodePreflight, PreflightCheck

Tree = Callable[[str], Path]
REPO = Path(__file__).resolve().parents[2]


def checks(root: Path, *, need_gb: float = 1.0, shm_gb: float = 0.001) -> dict[str, Any]:
    collector = PreflightCollector(
        Roots(procfs=root / "proc", dev=root / "dev"),
        needs=[SpaceNeed("data", root / "data" / "not-yet", need_gb)],
        interval_s=300.0,
        somaxconn_min=65535,
        shm_min_gb=shm_gb,
    )
    sample = collector.collect(0.0)
    return {"ok": sample.ok} | {c.name: msgspec.to_builtins(c) for c in sample.checks}


def test_this_machine_is_not_tuned(tree: Tree) -> None:
    got = checks(tree("procfs_this_machine"))
    assert got["somaxconn"] == {
        "name": "somaxconn",
        "ok": False,
        "value": "4096",
        "want": ">= 65535",
    }
    assert not got["ok"]


def test_a_tuned_host_passes(tree: Tree) -> None:
    root = tree("procfs_tuned")
    got = checks(root)
    assert got["ok"] and got["somaxconn"]["value"] == "65535"
    assert got["data_space"]["ok"] and got["data_space"]["value"].endswith(" GB free")
    assert got["data_space"]["want"] == f">= 1 GB free at {root}/data/not-yet"
    assert got["shm_size"]["ok"]


def test_not_enough_space_or_shm(tree: Tree) -> None:
    got = checks(tree("procfs_tuned"), need_gb=1e9, shm_gb=1e9)
    assert not got["ok"] and not got["data_space"]["ok"] and not got["shm_size"]["ok"]
    assert got["somaxconn"]["ok"]


def test_unreadable_sources_fail_their_check_only(tree: Tree) -> None:
    root = tree("procfs_edge")
    garbage = checks(root / "garbage")
    assert (
        garbage["somaxconn"]["value"]
        == "unreadable: invalid literal for int() with base 10: 'lots'"
    )
    assert garbage["shm_size"]["value"].startswith("unreadable: No such file or directory: ")
    assert garbage["data_space"]["ok"], "measured on the mount that would hold it"
    eisdir = checks(root / "eisdir")
    assert eisdir["somaxconn"]["value"].startswith("unreadable: Is a directory: ")


def test_existing_parent(tmp_path: Path) -> None:
    assert existing(tmp_path / "a" / "b") == tmp_path
    assert existing(Path("/")) == Path("/")


def observe(detector: PreflightDetector, t: float, **verdicts: bool) -> list[NodePreflight]:
    checks = [
        PreflightCheck(name=n, ok=ok, value="1" if ok else "0", want="1")
        for n, ok in verdicts.items()
    ]
    events = detector.observe(PreflightSample(time=t, ok=all(verdicts.values()), checks=checks))
    return [e for e in events if isinstance(e, NodePreflight)]


def test_events_on_first_result_and_on_changes() -> None:
    detector = PreflightDetector("node-0")
    first = observe(detector, 0, somaxconn=False, shm_size=True)
    assert len(first) == 1 and not first[0].ok and first[0].severity == "warning"
    assert first[0].message == "preflight failed: somaxconn 0 (want 1)"
    assert [c.name for c in first[0].checks] == ["somaxconn", "shm_size"]
    assert observe(detector, 1, somaxconn=False, shm_size=True) == []
    fixed = observe(detector, 2, somaxconn=True, shm_size=True)
    assert len(fixed) == 1 and fixed[0].ok and fixed[0].message == "preflight passed"


def test_one_node_wide_condition_while_any_check_fails() -> None:
    detector = PreflightDetector("node-0")
    passed = observe(detector, 0, somaxconn=True, shm_size=True)
    assert passed[0].condition is None, "nothing opened"
    changes = [
        observe(detector, 1, somaxconn=False, shm_size=True),
        observe(detector, 2, somaxconn=False, shm_size=False),
        observe(detector, 3, somaxconn=True, shm_size=False),
        observe(detector, 4, somaxconn=True, shm_size=True),
    ]
    conditions = [events[0].condition for events in changes]
    key = condition_key(ConditionKind.PREFLIGHT, "node-0")
    assert [(c.key, c.active, c.since) for c in conditions if c] == [
        (key, True, 1),
        (key, True, 2),
        (key, True, 3),
        (key, False, 4),
    ]
    assert [c.reason for c in conditions if c] == [
        "preflight failed: somaxconn 0 (want 1)",
        "preflight failed: somaxconn 0 (want 1); shm_size 0 (want 1)",
        "preflight failed: shm_size 0 (want 1)",
        "preflight passed",
    ]


@pytest.mark.parametrize(("fixture", "code"), [("procfs_tuned", 0), ("procfs_this_machine", 1)])
def test_the_command(tree: Tree, fixture: str, code: int) -> None:
    root = tree(fixture)
    (root / "dev" / "shm").mkdir(parents=True, exist_ok=True)
    config = root / "agent.toml"
    config.write_text(
        f'procfs = "{root}/proc"\ndev = "{root}/dev"\n[preflight]\n'
        f'data_dir = "{root}"\ncheckpoint_dir = "{root}/ckpt"\nshm_min_gb = 0.001\n'
    )
    argv = [sys.executable, "-m", "nodeagent.cli", "--config", str(config), "--preflight"]
    plain = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    assert plain.returncode == code, plain.stderr
    assert plain.stdout.splitlines()[0].startswith(
        "ok   somaxconn" if code == 0 else "FAIL somaxconn"
    )
    as_json = subprocess.run(
        [*argv, "--json"], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert json.loads(as_json.stdout)["ok"] is (code == 0)
