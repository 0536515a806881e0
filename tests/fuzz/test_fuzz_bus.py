"""Every message the coordinator and the agents decode from the bus: events, commands,
heartbeats, progress and API requests. Decoding gives a typed message or a
``msgspec.DecodeError``; a decoded message survives a round trip; the leader's handlers
never raise, answer every API request with one ``ApiReply`` whose error is one line, and
leave the jobs as they were when the message was garbage or named nobody they know."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from fuzz_support import counted, one_line, raw_or_structured
from hypothesis import given
from hypothesis import strategies as st

from coordinator.cas import MemoryCasStore
from coordinator.fake_agents import FakeAgents
from coordinator.jobs import JobManager
from coordinator.leader import Leadership
from coordinator.node_keeper import NodeKeeper
from coordinator.registry import Registry
from proto import subjects
from proto.api import ApiReply, JobControl, NodeControl, SubmitJob
from proto.codec import (
    api_reply_decoder,
    command_decoder,
    control_decoder,
    decode_event,
    encode,
    event_decoder,
    heartbeat_decoder,
    job_decoder,
    node_beat_decoder,
    node_control_decoder,
    progress_decoder,
    submit_decoder,
)
from proto.commands import Command, CommandBase, Launch, RankSpec
from proto.conditions import Condition, ConditionKind
from proto.events import Event, EventBase, NodeRegistered, kind_of
from proto.job import JobRecord, JobSection, JobSpec, JobState
from proto.node import GpuSample, Heartbeat, NodeBeat, Telemetry
from proto.progress import Checkpointed, Finished, Progress, StepDone
from ringmaster.bus import event_subject

SPEC = JobSpec(job=JobSection(name="fuzz", nodes=2))
CONDITION = Condition(kind=ConditionKind.NVME_LATENCY, node="zz-node", subject="nvme0n1", since=1.0)


def _union(tp: Any) -> tuple[type[Any], ...]:
    return tuple(tp.__args__)


EVENT_TYPES = _union(Event)
EVENT_TAGS = tuple(str(t.__struct_config__.tag) for t in EVENT_TYPES)
COMMAND_TYPES = _union(Command)
COMMAND_TAGS = tuple(str(t.__struct_config__.tag) for t in COMMAND_TYPES)
PROGRESS_TYPES = _union(Progress)
PROGRESS_TAGS = tuple(str(t.__struct_config__.tag) for t in PROGRESS_TYPES)


def builtins(obj: object) -> Any:
    return msgspec.json.decode(encode(obj))


def _event_doc(tp: type[EventBase]) -> dict[str, Any]:
    doc = builtins(tp(node="zz-node", job="zz-job", message="m", condition=CONDITION))
    assert isinstance(doc, dict)
    return doc


def _command_doc(tp: type[CommandBase]) -> dict[str, Any]:
    if tp is Launch:
        cmd: CommandBase = Launch(ranks=[RankSpec(rank=0, local_rank=0)], spec=SPEC, job="j")
    else:
        cmd = tp(job="zz-job", epoch=3)
    return {"command": str(tp.__struct_config__.tag), **builtins(cmd)}


EVENT_DOCS = st.sampled_from(EVENT_TYPES).map(_event_doc)
COMMAND_DOCS = st.sampled_from(COMMAND_TYPES).map(_command_doc)
PROGRESS_DOCS = st.sampled_from(PROGRESS_TYPES).map(
    lambda tp: builtins(tp(job="zz-job", step=3, time=1.0))
)
BEAT = Heartbeat(
    node="n",
    seq=1,
    sent_at=1.0,
    telemetry=Telemetry(nvme_latency_us={"nvme0n1": 20.0}, gpus=[GpuSample(index=0)]),
    conditions=[CONDITION],
    jobs=["j"],
)


def hostile(docs: st.SearchStrategy[Any], tags: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    return docs.flatmap(lambda doc: raw_or_structured(doc, tags))


def decoded(decode: Any, data: bytes) -> Any:
    """The decoder's contract: a message or a DecodeError, nothing else."""
    try:
        return decode(data)
    except msgspec.DecodeError as exc:
        assert str(exc)
        return None


# -- decoders --------------------------------------------------------------------------


@given(hostile(EVENT_DOCS, EVENT_TAGS))
@counted
def test_events_decode(data: bytes) -> None:
    event = decoded(decode_event, data)
    if event is not None:
        assert isinstance(event, EVENT_TYPES) and kind_of(event) in EVENT_TAGS
        assert event_decoder.decode(encode(event)) == event


@given(hostile(COMMAND_DOCS, COMMAND_TAGS))
@counted
def test_commands_decode(data: bytes) -> None:
    cmd = decoded(command_decoder.decode, data)
    if cmd is not None:
        assert isinstance(cmd, COMMAND_TYPES)
        assert command_decoder.decode(encode(cmd)) == cmd


@given(hostile(st.just(builtins(BEAT)), ()))
@counted
def test_heartbeats_decode_and_register(data: bytes) -> None:
    """As the agent's type and as the coordinator's reading (``NodeBeat``): a beat the
    first accepts, the second reads the same, its telemetry decoded when asked for."""
    whole = decoded(heartbeat_decoder.decode, data)
    beat = decoded(node_beat_decoder.decode, data)
    if whole is not None:
        assert isinstance(whole, Heartbeat) and heartbeat_decoder.decode(encode(whole)) == whole
        assert beat is not None
        shared = set(NodeBeat.__struct_fields__) - {"telemetry"}
        assert all(getattr(beat, f) == getattr(whole, f) for f in shared)
    if beat is None:
        return
    registry = Registry()
    node, fresh = registry.observe(beat, now=100.0)
    assert fresh and node.id == beat.node and registry.nodes[beat.node] is node
    registry.sweep(now=101.0)  # a node's own numbers never break the sweep
    assert all(c.active for c in node.conditions.values())
    telemetry = node.telemetry  # read as a node record does: a telemetry or its error
    if whole is not None:
        assert telemetry == whole.telemetry and not node.telemetry_error
    else:
        assert not node.telemetry_error or telemetry == Telemetry(), "an error: no telemetry"


@given(hostile(PROGRESS_DOCS, PROGRESS_TAGS))
@counted
def test_progress_decodes(data: bytes) -> None:
    msg = decoded(progress_decoder.decode, data)
    if msg is not None:
        assert isinstance(msg, PROGRESS_TYPES)
        assert progress_decoder.decode(encode(msg)) == msg


# -- the leader ------------------------------------------------------------------------


@dataclass
class FakeMsg:
    data: bytes
    replies: list[bytes] = field(default_factory=list)

    async def respond(self, data: bytes) -> None:
        self.replies.append(data)


class World:
    """A leader over the in-memory store and fake agents, with one running job on two
    known nodes (names the fuzzers never produce)."""

    def __init__(self) -> None:
        self.store = MemoryCasStore()
        self.agents = FakeAgents()
        self.registry = Registry()
        self.events: list[EventBase] = []
        for i in range(2):
            self.registry.observe(
                Heartbeat(node=f"node-{i}", seq=1, sent_at=0.0, addr=f"10.0.0.{i}", gpus=1),
                now=0.0,
            )

        async def publish(event: EventBase) -> None:
            self.events.append(event)

        self.jobs = JobManager(
            self.store, self.agents.sender("c-0", lambda: 1), self.registry, publish
        )
        leader = Leadership.__new__(Leadership)
        leader.me, leader.cluster = "c-0", "fuzz"
        leader.registry, leader.jobs, leader.publish = self.registry, self.jobs, publish
        leader.alert = lambda event: None  # attributes a real construction sets
        leader.decisions, leader.clock = None, self.jobs.clock

        async def evacuate(node: str, why: str) -> None:
            pass

        leader.keeper = NodeKeeper(
            self.registry, MemoryCasStore(), publish, evacuate, self.jobs.clock
        )
        self.leader = leader
        job = JobRecord(
            id="fuzz-000001",
            name="fuzz",
            spec=copy.deepcopy(SPEC),
            state=JobState.RUNNING,
            step=5,
            target_steps=100,
            world_size=2,
            nodes=["node-0", "node-1"],
            attempt=1,
            goodput={"productive": 100.0, "checkpoint_stall": 0.0, "lost_work": 0.0},
            failed_at_step=4,
            restarts=1,
        )
        self.job = job
        self.jobs.jobs[job.id] = job
        asyncio.run(self.jobs.table.save(job))

    def snapshot(self) -> tuple[Any, ...]:
        nodes = {
            n.id: (n.state, sorted(n.conditions), n.drain_reason)
            for n in self.registry.nodes.values()
        }
        jobs = {k: encode(v) for k, v in self.jobs.jobs.items()}
        store = {k: v for k, v in self.store._data.items()}
        return jobs, store, nodes, len(self.agents.received), len(self.events)


@pytest.fixture(scope="module")
def world_factory() -> type[World]:
    return World


def _unknown_names(doc: Any) -> Any:
    """Point a document's node and job names at nobody the world knows."""
    if isinstance(doc, dict):
        return {
            k: ("zz-" + v if k in ("node", "job") and isinstance(v, str) else _unknown_names(v))
            for k, v in doc.items()
        }
    if isinstance(doc, list):
        return [_unknown_names(v) for v in doc]
    return doc


@given(hostile(EVENT_DOCS, EVENT_TAGS))
@counted
def test_leader_on_event(data: bytes) -> None:
    world = World()
    event = decoded(decode_event, data)
    subject = "ringmaster.fuzz.node.zz-node.x"
    if event is not None:
        # Only messages about somebody else: re-encode with every name made unknown.
        data = encode(_unknown_names(builtins(event)))
        subject = event_subject("fuzz", decode_event(data))
    before = world.snapshot()
    asyncio.run(world.leader._on_event(subject, data))
    jobs, store, nodes, commands, _ = world.snapshot()
    assert (jobs, store) == before[:2], "an event about nobody changed a job"
    assert nodes == before[2] and commands == before[3]


@given(hostile(PROGRESS_DOCS, PROGRESS_TAGS), st.booleans())
@counted
def test_leader_on_progress(data: bytes, ours: bool) -> None:
    """Garbage or another job's progress changes nothing; the job's own progress, however
    odd its numbers, leaves a record that still decodes with a sane ledger."""
    world = World()
    msg = decoded(progress_decoder.decode, data)
    if msg is not None and ours:
        msg.job, msg.attempt = world.job.id, world.job.attempt  # as rank 0's node relays it
        data = encode(msg)
    before = world.snapshot()
    subject = subjects.progress("fuzz", world.job.id, world.job.nodes[0])
    asyncio.run(world.leader._on_progress(subject, data))
    asyncio.run(world.jobs.flush())
    if msg is None or not ours:
        assert world.snapshot()[:3] == before[:3], "progress about nobody changed a job"
        return
    found = asyncio.run(world.store.get(world.job.id))
    assert found is not None
    record = job_decoder.decode(found[0])
    assert all(v >= 0 for v in record.goodput.values()), record.goodput
    if isinstance(msg, StepDone | Checkpointed | Finished):
        assert record.state in JobState  # a state, whatever the step numbers were


def _request(verb: str) -> st.SearchStrategy[bytes]:
    good: Any = {
        "submit": lambda: builtins(SubmitJob(spec=SPEC, workdir="/w", source="f.toml")),
        "control": lambda: builtins(JobControl(job="fuzz-000001", action="pause")),
        "node": lambda: builtins(NodeControl(node="node-0", action="drain", reason="r")),
    }[verb]()
    tags = ("cordon", "drain", "undrain") if verb == "node" else ("pause", "resume", "stop")
    return raw_or_structured(good, tags)


def _handler(world: World, verb: str) -> Any:
    return {
        "submit": world.leader._on_submit,
        "control": world.leader._on_control,
        "node": world.leader._on_node,
    }[verb]


GOOD: dict[str, Any] = {
    "submit": lambda world: SubmitJob(spec=SPEC),
    "control": lambda world: JobControl(job=world.job.id, action="stop"),
    "node": lambda world: NodeControl(node="node-1", action="drain", reason="disk swap"),
}
DECODERS = {
    "submit": submit_decoder.decode,
    "control": control_decoder.decode,
    "node": node_control_decoder.decode,
}


@pytest.mark.parametrize("verb", ["submit", "control", "node"])
def test_a_good_request_is_answered_ok(verb: str) -> None:
    world = World()
    msg = FakeMsg(encode(GOOD[verb](world)))
    asyncio.run(_handler(world, verb)(msg))
    reply = api_reply_decoder.decode(msg.replies[0])
    assert reply.ok, reply.error


def _check_answer(verb: str, data: bytes) -> None:
    world = World()
    valid = decoded(DECODERS[verb], data) is not None
    before = world.snapshot()
    msg = FakeMsg(data)
    asyncio.run(_handler(world, verb)(msg))
    assert len(msg.replies) == 1, "every request gets exactly one reply"
    reply: ApiReply = api_reply_decoder.decode(msg.replies[0])
    assert reply.coordinator == "c-0"
    if reply.ok:
        assert valid and not reply.error
    else:
        assert one_line(reply.error), repr(reply.error)
        if not valid:
            assert reply.error.startswith(f"invalid {verb} request: ")
            assert world.snapshot()[:3] == before[:3], "a malformed request changed state"


@given(_request("submit"))
@counted
def test_leader_answers_submit(data: bytes) -> None:
    _check_answer("submit", data)


@given(_request("control"))
@counted
def test_leader_answers_control(data: bytes) -> None:
    _check_answer("control", data)


@given(_request("node"))
@counted
def test_leader_answers_node(data: bytes) -> None:
    _check_answer("node", data)


def test_registered_event_is_ignored_for_unknown_node() -> None:
    world = World()
    before = world.snapshot()
    registered = NodeRegistered(node="zz")
    asyncio.run(world.leader._on_event(event_subject("fuzz", registered), encode(registered)))
    assert world.snapshot()[:4] == before[:4]
