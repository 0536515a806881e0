"""What a node agent decodes: commands from the coordinator (``CommandHandler.handle``:
always a ``CommandReply``, never an exception; garbage writes nothing and moves no epoch),
progress lines from rank 0 over the control channel, and the fault grammar of
``coordinatorctl inject`` (a ``Fault`` whose canonical form parses again, or one
``ValueError`` line naming the fault)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import msgspec
from fuzz_support import counted, listing, long_text, one_line, raw_or_structured
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.commands import CommandHandler
from nodeagent.control_channel import ControlChannel
from proto.codec import command_decoder, encode
from proto.commands import Command, CommandBase, CommandReply, Launch, RankSpec
from proto.events import ClockResynced, CommandRefused, EventBase
from proto.faults import FORMS, Fault, parse_fault
from proto.job import JobSection, JobSpec
from proto.progress import Progress, StepDone
from tests.waits import until_async

COMMAND_TYPES = tuple(Command.__args__)
TAGS = tuple(str(t.__struct_config__.tag) for t in COMMAND_TYPES)


class FakeSupervisor:
    """Records what the handler asked of it; never starts a process."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def launch(self, cmd: Launch) -> list[int]:
        self.calls.append(("launch", cmd.job))
        return [10_000 + r.rank for r in cmd.ranks]

    async def control(self, job: str, action: str) -> None:
        self.calls.append((action, job))

    async def stop(self, job: str, *, force: bool, grace_s: float) -> None:
        self.calls.append(("stop", job))


def _doc(tp: type[CommandBase]) -> dict[str, Any]:
    if tp is Launch:
        spec = JobSpec(job=JobSection(name="fuzz"))
        cmd: CommandBase = Launch(ranks=[RankSpec(rank=0, local_rank=0)], spec=spec, job="j")
    else:
        cmd = tp(job="j", epoch=7)
    doc = msgspec.json.decode(encode(cmd))
    return {"command": str(tp.__struct_config__.tag), **doc}


COMMANDS = st.sampled_from(COMMAND_TYPES).map(_doc).flatmap(lambda d: raw_or_structured(d, TAGS))


@given(COMMANDS, st.sampled_from([0, 5, 2**62]))
@counted
def test_command_handler(data: bytes, seen: int) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-agent-") as name:
        run_dir = Path(name) / "run"
        run_dir.mkdir()
        events: list[EventBase] = []

        async def on_event(event: EventBase) -> None:
            events.append(event)

        async def resync() -> ClockResynced:
            return ClockResynced(message="resynced")

        handler = CommandHandler(
            "n1",
            run_dir,
            FakeSupervisor(),  # type: ignore[arg-type]
            "127.0.0.1",
            on_event,
            resync,
        )
        handler.epoch_seen = seen
        try:
            cmd = command_decoder.decode(data)
        except msgspec.DecodeError:
            cmd = None
        reply = asyncio.run(handler.handle(data))
        assert isinstance(reply, CommandReply) and reply.node == "n1"
        assert reply.ok or reply.error, "a refusal says why"
        if cmd is None:
            assert not reply.ok and reply.error.startswith("invalid command: ")
            assert handler.epoch_seen == seen and listing(run_dir) == set()
            assert [type(e) for e in events] == [CommandRefused]
            return
        assert handler.epoch_seen == max(seen, cmd.epoch)
        if cmd.epoch < seen:
            assert not reply.ok and "stale epoch" in reply.error
        files = listing(run_dir)
        assert files <= {"epoch"} | {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}
        for path in run_dir.rglob("*"):
            if path.is_file():
                assert int(path.read_text()) == handler.epoch_seen


# -- rank 0's progress lines over the control channel ---------------------------------------


def _progress_doc() -> dict[str, Any]:
    doc: dict[str, Any] = msgspec.json.decode(encode(StepDone(job="j", step=1, loss=2.0)))
    return doc


LINES = raw_or_structured(_progress_doc(), ("step", "paused", "resumed", "checkpointed"))


@given(st.lists(LINES, min_size=1, max_size=4))
@counted
def test_control_channel_lines(lines: list[bytes]) -> None:
    """Whatever rank 0 writes, every well-formed line after garbage still gets through,
    and the channel stays up for the next word."""

    async def scenario(path: Path) -> list[Progress]:
        got: list[Progress] = []

        async def on_progress(msg: Progress) -> None:
            got.append(msg)

        channel = ControlChannel(path, on_progress)
        await channel.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(path), limit=2**20)
            for line in lines:
                # under the stream's 64 KiB line limit (longer: the test below)
                writer.write(line[:60_000].replace(b"\n", b" ") + b"\n")
            writer.write(encode(StepDone(job="sentinel", step=9)) + b"\n")
            await writer.drain()
            await until_async(
                lambda: any(m.job == "sentinel" for m in got),
                10,
                "the good line after garbage",
                lambda: got,
                interval=0.005,
            )
            await channel.send("pause")
            word = await asyncio.wait_for(reader.readline(), 2)
            assert b'"pause"' in word, word
            writer.close()
        finally:
            await channel.close()
        return got

    with tempfile.TemporaryDirectory(prefix="fuzz-chan-") as name:
        got = asyncio.run(scenario(Path(name) / "c.sock"))
        assert got and got[-1].job == "sentinel", "a good line after garbage was lost"


# -- the fault grammar ---------------------------------------------------------------------

NAMES = list(FORMS)
values = st.one_of(
    st.sampled_from(["on", "off", "1", "0", "-1", "nan", "inf", "-inf", "1e999", "150", "1_0"]),
    st.floats().map(str),
    st.integers().map(str),
    st.integers(1, 6000).map(lambda n: "9" * n),
    long_text(),
    st.builds(
        lambda a, b, k: f"{a}-{b}:{k}",
        st.integers(-1, 10**20),
        st.integers(),
        st.sampled_from(["NV2", "SYS", "NV0", "X"]),
    ),
)
targets = st.one_of(
    st.just(""),
    st.builds(lambda t: "@" + t, st.one_of(st.text(max_size=8), st.integers().map(str))),
    st.sampled_from(["@nvme0n1", "@nvme0n1p1", "@0", "@", "@" + "9" * 5000]),
)
faults = st.one_of(
    st.text(max_size=60),
    st.builds(lambda n, v, t: f"{n}={v}{t}", st.sampled_from(NAMES), values, targets),
    st.builds(lambda n, w: f"{w}{n}{w}", st.sampled_from(NAMES), st.sampled_from(["", " ", "\n"])),
)


@given(faults)
@counted
def test_parse_fault(text: str) -> None:
    try:
        fault: Fault = parse_fault(text)
    except ValueError as exc:
        message = str(exc)
        assert type(exc) is ValueError and one_line(message), repr(message)
        assert message.startswith(("unknown fault ", "bad fault ")), message
        if message.startswith("bad fault "):
            assert "; expected " in message, message
        return
    again = parse_fault(str(fault))  # the canonical form parses, to the same kind
    assert type(again) is type(fault)
    assert str(fault).partition("=")[0] == text.strip().partition("=")[0]


def test_control_channel_survives_an_overlong_line() -> None:
    """A line past the stream's 64 KiB limit drops that connection, quietly; rank 0's
    next connection is served."""

    async def scenario(path: Path) -> list[Progress]:
        got: list[Progress] = []

        async def on_progress(msg: Progress) -> None:
            got.append(msg)

        channel = ControlChannel(path, on_progress)
        await channel.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
            writer.write(b"x" * 200_000 + b"\n")
            await writer.drain()
            try:  # the channel drops this connection (reset: it left bytes unread)
                said = await asyncio.wait_for(reader.read(), 10)
            except ConnectionResetError:
                said = b""
            assert said == b"", said
            writer.close()
            _, writer = await asyncio.open_unix_connection(str(path))
            writer.write(encode(StepDone(job="after", step=1)) + b"\n")
            await writer.drain()
            await until_async(lambda: got, 10, "rank 0's next line", interval=0.005)
            writer.close()
        finally:
            await channel.close()
        return got

    with tempfile.TemporaryDirectory(prefix="fuzz-chan-") as name:
        assert [m.job for m in asyncio.run(scenario(Path(name) / "c.sock"))] == ["after"]
