"""The bus's users and permissions (coordinator.auth), checked against a real nats-server
running the generated configuration: refusals are asserted as the server reports them
(nats-py's error callback, or a refused connection), not inferred from silence."""

from __future__ import annotations

import json
import signal
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import ConsumerConfig, DeliverPolicy

from coordinator import auth
from coordinator.ctl.bus import session
from coordinator.ctl.errors import CtlError
from coordinator.ctl.main import main as ctl_main
from coordinator.embedded_nats import NatsServer, start_nats_server
from coordinator.kvstore import ensure_layout
from proto import subjects
from proto.api import ApiReply, JobControl
from ringmaster.auth import ENV, Refused, connect_options
from ringmaster.bus import connect
from ringmaster.procs import wait_until_async

CLUSTER, NODES, COORDINATORS = "c1", ["node-a", "node-b"], ["coordinator-0"]


def test_an_agent_may_touch_its_own_node_only() -> None:
    perms = auth.agent(CLUSTER, "node-a")
    assert subjects.events_filter(CLUSTER, node="node-a") in perms.publish
    assert subjects.heartbeat(CLUSTER, "node-a") in perms.publish
    assert subjects.command(CLUSTER, "node-a") in perms.subscribe
    # what it reports about a job names its node, never another's: no job-scoped subject
    assert subjects.progress(CLUSTER, "*", "node-a") in perms.publish
    assert not any(".job." in s or ".progress.*.*" in s for s in perms.publish)
    every = " ".join(perms.publish + perms.subscribe)
    assert "node-b" not in every
    assert subjects.api(CLUSTER, "submit") not in perms.publish
    assert not any(s.startswith("$JS.API") for s in perms.publish)  # acked publishes need none


def test_the_observer_reads_and_nothing_more() -> None:
    reads = auth.observer(CLUSTER)
    assert all(s.startswith(("$JS.API.", "$JS.FC.")) for s in reads.publish)
    assert not any(".CREATE." in s and "STREAM" in s for s in reads.publish)
    assert not any("MSG.NEXT" in s or "$JS.ACK" in s for s in reads.publish)
    assert not reads.responses
    operator = auth.operator(CLUSTER)
    assert subjects.api(CLUSTER, "submit") in operator.publish
    assert set(reads.publish) < set(operator.publish)


def test_names_that_collide_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="collide"):
        auth.principals(CLUSTER, ["a"], ["agent-a"])
    with pytest.raises(ValueError):
        auth.init(tmp_path, CLUSTER, ["bad.node"], COORDINATORS)


def test_secrets_are_owner_only(tmp_path: Path) -> None:
    conf = auth.init(tmp_path, CLUSTER, NODES, COORDINATORS)
    files = [conf, *sorted((tmp_path / "secrets").iterdir())]
    assert [p.name for p in files[1:]] == sorted(
        f"{n}.json" for n in auth.principals(CLUSTER, NODES, COORDINATORS)
    )
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[NatsServer, Path]]:
    conf = auth.init(tmp_path, CLUSTER, NODES, COORDINATORS)
    server = start_nats_server(tmp_path / "nats", config=conf)
    try:
        yield server, tmp_path
    finally:
        server.stop()


@dataclass
class Conn:
    nc: Client
    errors: list[str] = field(default_factory=list)

    async def refused(self, subject: str, timeout: float = 3.0) -> bool:
        """Whether the server reported a permissions violation naming ``subject``."""
        await self.nc.flush()

        async def reported() -> bool:
            return any("permissions violation" in e and f'"{subject}"' in e for e in self.errors)

        try:
            return await wait_until_async(reported, timeout)
        except TimeoutError:
            return False


Opener = Callable[[str], Awaitable[Conn]]


@pytest.fixture
async def connect_as(secured: tuple[NatsServer, Path]) -> AsyncIterator[Opener]:
    server, directory = secured
    opened: list[Client] = []

    async def open_as(who: str) -> Conn:
        conn = Conn(nc=Client())

        async def record(exc: Exception) -> None:
            conn.errors.append(str(exc))

        conn.nc = await nats.connect(
            server.url,
            error_cb=record,
            allow_reconnect=False,
            **connect_options(auth.creds_path(directory, who)),
        )
        opened.append(conn.nc)
        return conn

    yield open_as
    for nc in opened:
        await nc.close()


@pytest.mark.anyio
async def test_no_credentials_no_bus(secured: tuple[NatsServer, Path]) -> None:
    server, _ = secured
    with pytest.raises(NatsError, match="Authorization Violation"):
        await nats.connect(server.url, allow_reconnect=False, error_cb=_ignore)
    with pytest.raises(Refused, match="refused"):
        await connect(server.url, "test", None)


async def _ignore(_: Exception) -> None:
    """Silences nats-py's default traceback logging for expected failures."""


@pytest.mark.anyio
async def test_an_agent_cannot_speak_for_another_node(connect_as: Opener) -> None:
    coordinator = await connect_as("coordinator-0")
    await ensure_layout(coordinator.nc.jetstream(), CLUSTER)
    agent = await connect_as(auth.agent_user("node-a"))
    ack = await agent.nc.jetstream().publish(subjects.event(CLUSTER, "node", "node-a", "x"), b"{}")
    assert ack.stream == subjects.events_stream(CLUSTER)  # its own events: acked
    other = subjects.event(CLUSTER, "node", "node-b", "x")
    await agent.nc.publish(other, b"{}")
    assert await agent.refused(other)
    command = subjects.command(CLUSTER, "node-b")
    await agent.nc.publish(command, b"{}")
    assert await agent.refused(command)
    await agent.nc.subscribe(command)
    assert await agent.refused(command)
    submit = subjects.api(CLUSTER, "submit")
    await agent.nc.publish(submit, b"{}")
    assert await agent.refused(submit)


@pytest.mark.anyio
async def test_observer_reads_but_cannot_control(
    connect_as: Opener, secured: tuple[NatsServer, Path]
) -> None:
    server, directory = secured
    coordinator = await connect_as("coordinator-0")
    js = coordinator.nc.jetstream()
    buckets = await ensure_layout(js, CLUSTER)
    await buckets.jobs.put("job-1", b'{"id": "job-1"}')
    event = subjects.event(CLUSTER, "job", "job-1", "job.submitted")
    await js.publish(event, b"{}")

    async def answer(msg: Msg) -> None:
        await msg.respond(msgspec.json.encode(ApiReply(ok=True, job="job-1")))

    await coordinator.nc.subscribe(subjects.api(CLUSTER, "control"), cb=answer)
    await coordinator.nc.flush()

    observer = await connect_as(auth.OBSERVER)
    ojs = observer.nc.jetstream()
    entry = await (await ojs.key_value(subjects.bucket(CLUSTER, "jobs"))).get("job-1")
    assert entry.value == b'{"id": "job-1"}'
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    sub = await ojs.subscribe(
        subjects.events_filter(CLUSTER),
        stream=subjects.events_stream(CLUSTER),
        ordered_consumer=True,
        config=config,
    )
    assert (await sub.next_msg(timeout=5)).subject == event
    await sub.unsubscribe()
    assert not observer.errors

    stop = JobControl(job="job-1", action="stop")
    async with session(server.url, CLUSTER, str(auth.creds_path(directory, "observer"))) as s:
        with pytest.raises(CtlError, match="permissions violation") as refused:
            await s.ask("control", stop, timeout=5)
        assert refused.value.code == 2
    async with session(server.url, CLUSTER, str(auth.creds_path(directory, "operator"))) as s:
        assert (await s.ask("control", stop, timeout=5)).ok


def test_the_cli_says_so_in_one_line(
    secured: tuple[NatsServer, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, directory = secured
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("RINGMASTER_HOME", str(directory / "no-local-cluster"))
    assert ctl_main(["status", "--nats", server.url, "--cluster", CLUSTER]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused a connection without credentials" in err
    bad = directory / "bad.json"
    bad.write_text("{}")
    assert ctl_main(["status", "--nats", server.url, "--creds", str(bad)]) == 2
    assert "creds file" in capsys.readouterr().err


@pytest.mark.anyio
async def test_a_node_joins_a_running_server_on_reload(
    secured: tuple[NatsServer, Path], connect_as: Opener
) -> None:
    server, directory = secured
    before = (await connect_as("agent-node-a")).nc
    creds = auth.add_agent(directory, CLUSTER, "node-c")
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    with pytest.raises(Refused):  # written, not yet read by the server
        await connect(server.url, "test", str(creds))
    server.process.send_signal(signal.SIGHUP)

    async def admitted() -> bool:
        try:
            await (await connect(server.url, "test", str(creds))).close()
        except Refused:
            return False
        return True

    try:
        await wait_until_async(admitted, 10.0)
    except TimeoutError:
        raise AssertionError("the reloaded server never admitted the new agent") from None
    joined = await connect_as("agent-node-c")
    await joined.nc.publish(subjects.heartbeat(CLUSTER, "node-c"), b"{}")
    await joined.nc.publish(subjects.heartbeat(CLUSTER, "node-a"), b"{}")
    assert await joined.refused(subjects.heartbeat(CLUSTER, "node-a"))
    assert not any("node-c" in e for e in joined.errors), joined.errors
    assert before.is_connected  # the reload disconnected nobody


def test_joining_again_replaces_the_node_user_alone(tmp_path: Path) -> None:
    conf = auth.init(tmp_path, CLUSTER, NODES, COORDINATORS)

    def users() -> dict[str, str]:
        body = json.loads(conf.read_text().partition(auth.BLOCK)[2])
        return {u["user"]: u["password"] for u in body["users"]}

    first = users()
    auth.add_agent(tmp_path, CLUSTER, "node-c")
    auth.add_agent(tmp_path, CLUSTER, "node-c")
    after = users()
    assert set(after) == {*first, "agent-node-c"}
    assert {k: after[k] for k in first} == first
    password = json.loads((tmp_path / "secrets" / "agent-node-c.json").read_text())["password"]
    assert after["agent-node-c"] == password
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
