"""What a SIGTERM means depends on whether the host is going down."""

from __future__ import annotations

from pathlib import Path

from nodeagent.shutdown import host_shutting_down


def fake_systemctl(tmp_path: Path, state: str) -> str:
    script = tmp_path / "systemctl"
    script.write_text(f"#!/bin/sh\necho {state}\n")
    script.chmod(0o755)
    return str(script)


def test_a_running_host_is_not_going_down(tmp_path: Path) -> None:
    assert not host_shutting_down(tmp_path, fake_systemctl(tmp_path, "running"))
    assert not host_shutting_down(tmp_path, fake_systemctl(tmp_path, "degraded"))


def test_systemd_stopping_or_a_scheduled_shutdown_means_going_down(tmp_path: Path) -> None:
    assert host_shutting_down(tmp_path, fake_systemctl(tmp_path, "stopping"))
    (tmp_path / "nologin").write_text("shutting down\n")
    assert host_shutting_down(tmp_path, fake_systemctl(tmp_path, "running"))


def test_no_systemctl_is_not_a_shutdown(tmp_path: Path) -> None:
    assert not host_shutting_down(tmp_path, str(tmp_path / "absent"))
