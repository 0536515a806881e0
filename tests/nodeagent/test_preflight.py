"""Preflight on fixture trees (one captured from this machine), the detector, the agent
raising a tunable where it may, and ``nodeagent --preflight`` as a real process."""

from __future__ import annotations

import json
import os
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
from nodeagent.collectors.sysctl import SOMAXCONN, Tunable
from nodeagent.config import AgentConfig
from nodeagent.detectors.preflight import PreflightDetector
from nodeagent.registry import preflight
from proto.conditions import ConditionKind, Severity, condition_key
from proto.events import NodePreflight, PreflightCheck

Tree = Callable[[str], Path]
REPO = Path(__file__).resolve().parents[2]


def checks(root: Path, *, need_gb: float = 1.0, shm_gb: float = 0.001) -> dict[str, Any]:
    collector = PreflightCollector(
        Roots(procfs=root / "proc", dev=root / "dev"),
        needs=[SpaceNeed("data", root / "data" / "not-yet", need_gb)],
        interval_s=300.0,
        tunables=[Tunable("somaxconn", SOMAXCONN, 65535)],
        shm_min_gb=shm_gb,
    )
    sample = collector.collect(0.0)
    return {"ok": sample.ok} | {c.name: msgspec.to_builtins(c) for c in sample.checks}


def test_this_machine_is_not_tuned_but_fit(tree: Tree) -> None:
    root = tree("procfs_this_machine")
    (root / "dev" / "shm").mkdir(parents=True)
    got = checks(root)
    assert got["somaxconn"] == {
        "name": "somaxconn",
        "ok": False,
        "value": "4096",
        "want": ">= 65535",
        "required": False,
        "fixed_from": "",
    }
    assert got["ok"], "a stock tunable is a warning: the node is fit"


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
    assert got["data_space"]["required"] and got["shm_size"]["required"]
    assert got["somaxconn"]["ok"]
    assert not checks(tree("procfs_tuned"), shm_gb=1e9)["ok"], "shm alone refuses"
    assert not checks(tree("procfs_tuned"), need_gb=1e9)["ok"], "space alone refuses"


def test_unreadable_sources_fail_their_check_only(tree: Tree) -> None:
    root = tree("procfs_edge")
    garbage = checks(root / "garbage")
    assert garbage["somaxconn"]["value"] == "unreadable: not an integer: 'lots'"
    assert not garbage["somaxconn"]["required"], "an unreadable tunable is a warning too"
    assert garbage["shm_size"]["value"].startswith("unreadable: No such file or directory: ")
    assert garbage["data_space"]["ok"], "measured on the mount that would hold it"
    eisdir = checks(root / "eisdir")
    assert eisdir["somaxconn"]["value"].startswith("unreadable: Is a directory: ")


def test_existing_parent(tmp_path: Path) -> None:
    assert existing(tmp_path / "a" / "b") == tmp_path
    assert existing(Path("/")) == Path("/")


ADVISORY = {"somaxconn"}  # the tunables; every other check is required


def observe(detector: PreflightDetector, t: float, **verdicts: bool) -> list[NodePreflight]:
    checks = [
        PreflightCheck(
            name=n, ok=ok, value="1" if ok else "0", want="1", required=n not in ADVISORY
        )
        for n, ok in verdicts.items()
    ]
    ok = all(c.ok for c in checks if c.required)
    events = detector.observe(PreflightSample(time=t, ok=ok, checks=checks))
    return [e for e in events if isinstance(e, NodePreflight)]


def test_events_on_first_result_and_on_changes() -> None:
    detector = PreflightDetector("node-0")
    first = observe(detector, 0, somaxconn=True, shm_size=False)
    assert len(first) == 1 and not first[0].ok and first[0].severity == "warning"
    assert first[0].message == "preflight failed: shm_size 0 (want 1)"
    assert [c.name for c in first[0].checks] == ["somaxconn", "shm_size"]
    assert observe(detector, 1, somaxconn=True, shm_size=False) == []
    fixed = observe(detector, 2, somaxconn=True, shm_size=True)
    assert len(fixed) == 1 and fixed[0].ok and fixed[0].message == "preflight passed"


def test_one_node_wide_condition_while_any_check_fails() -> None:
    detector = PreflightDetector("node-0")
    passed = observe(detector, 0, data_space=True, shm_size=True)
    assert passed[0].condition is None, "nothing opened"
    changes = [
        observe(detector, 1, data_space=False, shm_size=True),
        observe(detector, 2, data_space=False, shm_size=False),
        observe(detector, 3, data_space=True, shm_size=False),
        observe(detector, 4, data_space=True, shm_size=True),
    ]
    conditions = [events[0].condition for events in changes]
    key = condition_key(ConditionKind.PREFLIGHT, "node-0")
    assert [(c.key, c.active, c.since, c.severity) for c in conditions if c] == [
        (key, True, 1, "warning"),
        (key, True, 2, "warning"),
        (key, True, 3, "warning"),
        (key, False, 4, "warning"),
    ]
    assert [c.reason for c in conditions if c] == [
        "preflight failed: data_space 0 (want 1)",
        "preflight failed: data_space 0 (want 1); shm_size 0 (want 1)",
        "preflight failed: shm_size 0 (want 1)",
        "preflight passed",
    ]


def test_a_warning_is_advisory_and_a_required_failure_is_not() -> None:
    """Warnings alone: the event is ``ok`` (the node is fit) and the condition is open at
    info, so status shows it; a required check failing too turns it to warning (refused)."""
    detector = PreflightDetector("node-0")
    [warned] = observe(detector, 0, somaxconn=False, shm_size=True)
    assert warned.ok and warned.severity == "warning"
    assert warned.message == "preflight passed with warnings: somaxconn 0 (want 1)"
    assert warned.condition is not None and warned.condition.active
    assert (warned.condition.severity, warned.condition.reason) == (Severity.INFO, warned.message)
    [both] = observe(detector, 1, somaxconn=False, shm_size=False)
    assert not both.ok and both.condition is not None
    assert both.message == "preflight failed: shm_size 0 (want 1); warning: somaxconn 0 (want 1)"
    assert both.condition.severity is Severity.WARNING
    [back] = observe(detector, 2, somaxconn=False, shm_size=True)
    assert back.ok and back.condition is not None and back.condition.severity is Severity.INFO
    [passed] = observe(detector, 3, somaxconn=True, shm_size=True)
    assert passed.condition is not None and not passed.condition.active


# -- the agent raising a tunable --------------------------------------------------------


def agent_preflight(root: Path, *, fix: bool = True) -> tuple[PreflightSample, NodePreflight]:
    """The agent's own preflight (settings to collector and detector), on a fixture tree."""
    (root / "dev" / "shm").mkdir(parents=True, exist_ok=True)
    settings = {"data_dir": str(root), "checkpoint_dir": str(root), "shm_min_gb": 0.0}
    config = msgspec.convert(
        {
            "node": "node-0",
            "procfs": str(root / "proc"),
            "dev": str(root / "dev"),
            "preflight": settings | {"data_need_gb": 0.0, "checkpoint_need_gb": 0.0, "fix": fix},
        },
        AgentConfig,
    )
    entry = preflight(config)
    sample = entry.collector.collect(0.0)
    [event] = [e for d in entry.detectors for e in d.observe(sample)]
    assert isinstance(event, NodePreflight)
    return sample, event


def somaxconn_file(root: Path) -> Path:
    return root / "proc" / "sys" / "net" / "core" / "somaxconn"


def as_root_under_systemd(monkeypatch: pytest.MonkeyPatch, *, euid: int = 0) -> None:
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef0123456789abcdef")
    monkeypatch.setattr(os, "geteuid", lambda: euid)


def test_root_under_systemd_raises_the_tunable_and_says_so(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tree("procfs_this_machine")
    as_root_under_systemd(monkeypatch)
    sample, event = agent_preflight(root)
    assert somaxconn_file(root).read_text() == "65535\n"
    [check] = [c for c in sample.checks if c.name == "somaxconn"]
    assert (check.ok, check.value, check.fixed_from) == (True, "65535", "4096")
    assert event.ok and event.severity == "info" and event.condition is None
    assert event.message == "preflight passed; set somaxconn 4096 -> 65535"


def test_notify_socket_alone_counts_as_systemd(
    tree: Tree, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tree("procfs_this_machine")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    agent_preflight(root)
    assert somaxconn_file(root).read_text() == "65535\n"


def test_the_first_reading_only_is_raised(tree: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator who lowers it while the agent runs is not overridden."""
    root = tree("procfs_this_machine")
    as_root_under_systemd(monkeypatch)
    config = msgspec.convert({"procfs": str(root / "proc"), "dev": str(root)}, AgentConfig)
    collector = preflight(config).collector
    collector.collect(0.0)
    somaxconn_file(root).write_text("1024\n")
    [check] = [c for c in collector.collect(1.0).checks if c.name == "somaxconn"]
    assert (check.ok, check.value, check.fixed_from) == (False, "1024", "")
    assert somaxconn_file(root).read_text() == "1024\n"


@pytest.mark.parametrize("where", ["outside systemd", "not root", "fix = false"])
def test_nothing_is_written_elsewhere(
    tree: Tree, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    root = tree("procfs_this_machine")
    if where == "not root":
        as_root_under_systemd(monkeypatch, euid=1000)
    elif where == "fix = false":
        as_root_under_systemd(monkeypatch)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: 0)
    sample, event = agent_preflight(root, fix=where != "fix = false")
    assert somaxconn_file(root).read_text() == "4096\n"
    assert sample.ok and event.ok, "admitted with the warning"
    assert event.message == "preflight passed with warnings: somaxconn 4096 (want >= 65535)"
    assert event.condition is not None and event.condition.severity is Severity.INFO


def test_a_tunable_that_cannot_be_written_stays_a_warning(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tree("procfs_edge") / "eisdir"
    as_root_under_systemd(monkeypatch)
    sample, event = agent_preflight(root)
    [check] = [c for c in sample.checks if c.name == "somaxconn"]
    assert not check.ok and check.value.startswith("unreadable: Is a directory: ")
    assert sample.ok and event.ok
    root = tree("procfs_this_machine")
    monkeypatch.setattr(Path, "write_text", _read_only)  # root may write any plain file
    sample, event = agent_preflight(root)
    assert event.ok and "somaxconn 4096 (want >= 65535)" in event.message
    assert [c.fixed_from for c in sample.checks] == ["", "", "", ""]


def _read_only(path: Path, *args: object, **kwargs: object) -> int:
    raise OSError(30, "Read-only file system", str(path))


@pytest.mark.parametrize(
    ("fixture", "shm_gb", "code", "line"),
    [
        ("procfs_tuned", 0.001, 0, "ok   somaxconn: 65535 (want >= 65535)"),
        ("procfs_this_machine", 0.001, 0, "WARN somaxconn: 4096 (want >= 65535)"),
        ("procfs_tuned", 1e9, 1, "FAIL shm_size: "),
    ],
)
def test_the_command(tree: Tree, fixture: str, shm_gb: float, code: int, line: str) -> None:
    root = tree(fixture)
    (root / "dev" / "shm").mkdir(parents=True, exist_ok=True)
    config = root / "agent.toml"
    config.write_text(
        f'procfs = "{root}/proc"\ndev = "{root}/dev"\n[preflight]\n'
        f'data_dir = "{root}"\ncheckpoint_dir = "{root}/ckpt"\nshm_min_gb = {shm_gb}\n'
    )
    argv = [sys.executable, "-m", "nodeagent.cli", "--config", str(config), "--preflight"]
    plain = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    assert plain.returncode == code, plain.stderr
    assert any(out.startswith(line) for out in plain.stdout.splitlines()), plain.stdout
    as_json = subprocess.run(
        [*argv, "--json"], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert json.loads(as_json.stdout)["ok"] is (code == 0)
