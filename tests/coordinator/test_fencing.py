"""Fencing: a real agent refuses a command stamped with an epoch older than the newest it
has seen, says so in a ``command.refused`` event, and remembers across restarts."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from coordinator.embedded_nats import NatsServer
from coordinator.kvstore import ensure_layout
from proto import subjects
from proto.codec import decode_event, encode, reply_decoder
from proto.commands import CommandReply, ReservePort
from proto.events import CommandRefused
from ringmaster.procs import wait_until_async

pytestmark = [pytest.mark.slow, pytest.mark.anyio]


def start_agent(url: str, run_dir: Path, sysfs: Path, config: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nodeagent.cli",
            "--config",
            str(config),
            "--node",
            "n1",
            "--cluster",
            "t",
            "--nats",
            url,
            "--run-dir",
            str(run_dir),
            "--sysfs",
            str(sysfs),
            "--advertise-addr",
            "127.0.0.1",
            "--metrics-port",  # its fixed default port would clash with another test's
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(run_dir.parent / "agent.log").open("ab"),
    )


@pytest.fixture
def agent(
    nats_server: NatsServer, tmp_path: Path, host_agent_config: Path
) -> Iterator[tuple[str, Path]]:
    run_dir = tmp_path / "agent"
    run_dir.mkdir()
    (tmp_path / "sys" / "block").mkdir(parents=True)
    proc = start_agent(nats_server.url, run_dir, tmp_path / "sys", host_agent_config)
    yield nats_server.url, run_dir
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()  # never leave an agent holding its ports for the tests after
        proc.wait()
        raise


async def send(nc: nats.NATS, epoch: int) -> CommandReply:
    subject = subjects.command("t", "n1")

    async def answered() -> CommandReply | None:
        try:
            msg = await nc.request(subject, encode(ReservePort(epoch=epoch)), timeout=2)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return None  # the agent is not serving yet
        return reply_decoder.decode(msg.data)

    return await wait_until_async(answered, 20.0, interval=0.1)


async def test_stale_epoch_is_refused_with_an_event(agent: tuple[str, Path]) -> None:
    url, run_dir = agent
    nc = await nats.connect(url)
    await ensure_layout(nc.jetstream(), "t")
    refused: list[CommandRefused] = []

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, CommandRefused):
            refused.append(event)

    await nc.subscribe(subjects.event("t", "node", "n1", "command.refused"), cb=on_event)
    new = await send(nc, epoch=7)
    assert new.ok and new.port > 0 and new.epoch_seen == 7
    old = await send(nc, epoch=5)
    assert not old.ok and "stale epoch 5 < 7" in old.error
    same = await send(nc, epoch=7)
    assert same.ok

    async def told() -> bool:
        return bool(refused)

    with contextlib.suppress(TimeoutError):  # the assertion below says what came instead
        await wait_until_async(told, 5.0)
    assert [(e.epoch, e.current_epoch, e.command) for e in refused] == [(5, 7, "reserve_port")]
    assert (run_dir / "epoch").read_text() == "7"
    await nc.close()


async def test_invalid_command_is_refused_not_fatal(agent: tuple[str, Path]) -> None:
    url, _ = agent
    nc = await nats.connect(url)
    await send(nc, epoch=1)  # the agent is up
    msg = await nc.request(subjects.command("t", "n1"), b'{"command": "explode"}', timeout=5)
    reply = reply_decoder.decode(msg.data)
    assert not reply.ok and "invalid command" in reply.error
    msg = await nc.request(subjects.command("t", "n1"), b"\xff not json", timeout=5)
    assert not reply_decoder.decode(msg.data).ok
    assert (await send(nc, epoch=1)).ok  # still serving
    await nc.close()
