"""Bad input to coordinatorctl: one line naming the problem, exit 2, nothing created.

Runs the real CLI in subprocesses against a real nats-server and a real coordinator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.embedded_nats import NatsServer
from ringmaster.procs import wait_until

pytestmark = pytest.mark.slow
GOOD = """
[job]
name = "ok"
nodes = 1
[train]
steps = 5
"""


def ctl(url: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RINGMASTER_NATS": url, "RINGMASTER_HOME": str(cwd or ".")}
    return subprocess.run(
        [sys.executable, "-m", "coordinator.ctl.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
        check=False,
    )


@pytest.fixture
def coordinator(nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    log = (tmp_path / "coordinator.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "--nats", nats_server.url, "--id", "c0"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def running() -> bool:
        done = ctl(nats_server.url, "status", "--json", cwd=tmp_path)
        return done.returncode == 0 and bool(json.loads(done.stdout)["coordinators"])

    try:
        wait_until(running, 30.0, interval=0.2)
        yield nats_server.url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (GOOD.replace("steps = 5", "stpes = 5"), "unknown key 'train.stpes'"),
        (GOOD.replace("steps = 5", 'steps = "five"'), "train.steps = 'five': expected `int`"),
        (GOOD.replace("steps = 5", "steps = -5"), "train.steps = -5: expected `int` >= 1"),
        (GOOD.replace("nodes = 1", "nodes = 1.5"), "job.nodes = 1.5"),
        (
            GOOD + 'engine = "fsdpp"\n',
            "train.engine = 'fsdpp': expected one of 'ddp', 'deepspeed', 'fsdp'",
        ),
        ("[train]\nsteps = 5\n", "missing required key 'job'"),
        ("[job\nname=", "not valid TOML"),
    ],
)
def test_bad_job_file_is_one_line_exit_2_and_creates_nothing(
    coordinator: str, tmp_path: Path, body: str, expected: str
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(body)
    done = ctl(coordinator, "start", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr
    status = json.loads(ctl(coordinator, "status", "--json", cwd=tmp_path).stdout)
    assert status["jobs"] == []


def test_missing_job_file_and_bad_overrides(coordinator: str, tmp_path: Path) -> None:
    done = ctl(coordinator, "start", str(tmp_path / "nope.toml"), cwd=tmp_path)
    assert done.returncode == 2 and "no such file" in done.stderr
    path = tmp_path / "job.toml"
    path.write_text(GOOD)
    done = ctl(coordinator, "start", str(path), "--set", "train.steps=-1", cwd=tmp_path)
    assert done.returncode == 2 and "train.steps = -1" in done.stderr
    done = ctl(coordinator, "start", str(path), "--set", "nonsense", cwd=tmp_path)
    assert done.returncode == 2 and "expected key.path=value" in done.stderr
    assert json.loads(ctl(coordinator, "status", "--json", cwd=tmp_path).stdout)["jobs"] == []


def test_good_job_prints_its_id_alone_and_is_pending_without_nodes(
    coordinator: str, tmp_path: Path
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(GOOD)
    done = ctl(coordinator, "start", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    assert job.startswith("ok-") and "\n" not in job
    status = json.loads(ctl(coordinator, "status", job, "--json", cwd=tmp_path).stdout)
    assert status["state"] == "pending" and status["target_steps"] == 5


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["status", "no-such-job"], "no job 'no-such-job'"),
        (["tail", "--since", "yesterday"], "--since 'yesterday'"),
        (["pause", "no-such-job"], "no job 'no-such-job'"),
        (["inject", "node-9", "nvme-latency=abc"], "nvme-latency"),
        (["inject", "node-9", "nvme-latency=500"], "no node 'node-9'"),
        (["frobnicate"], "invalid choice"),
        (["cordon", "node-9"], "no node 'node-9'"),
        (["undrain", "node-9"], "no node 'node-9'"),
        (["drain", "node-9"], "the following arguments are required: --reason"),
        (["drain", "node-9", "--reason", " "], "drain needs a reason"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    coordinator: str, tmp_path: Path, args: list[str], expected: str
) -> None:
    done = ctl(coordinator, *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr


def test_unreachable_nats_is_one_line_exit_1(tmp_path: Path) -> None:
    done = ctl("nats://127.0.0.1:1", "status", cwd=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach NATS" in lines[0], done.stderr


@pytest.mark.anyio
async def test_malformed_api_requests_get_an_error_reply(coordinator: str) -> None:
    import nats

    from proto import subjects
    from proto.codec import api_reply_decoder

    nc = await nats.connect(coordinator)
    try:
        malformed = (
            ("submit", b"\xff garbage"),
            ("control", b'{"job": 5}'),
            ("node", b'{"node": "node-1", "action": "reboot"}'),
        )
        for verb, payload in malformed:
            msg = await nc.request(subjects.api("local", verb), payload, timeout=10)
            reply = api_reply_decoder.decode(msg.data)
            assert not reply.ok and reply.error.startswith(f"invalid {verb} request")
    finally:
        await nc.close()
