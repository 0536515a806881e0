"""Who may do what on the bus: one NATS user per principal, each with the subjects it needs
and no more, generated from the cluster name and its node list.

The permission sets are pure functions of ``proto.subjects`` (unit-tested, and tested
against a real server in tests/coordinator/test_auth.py); :func:`init` writes them out as an
``authorization`` block for ``nats-server`` plus one creds file per principal. ``up`` calls
it for a local cluster; ``coordinatorctl auth init`` does the same for production.

Repliers (agents, coordinators, the simulator) get ``allow_responses`` instead of a publish
right on other principals' inboxes: they can answer the requests they receive, nothing else.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from proto import subjects
from proto.events import CoordinatorLeader, EventBase
from ringmaster.auth import Creds, save

JS = "$JS.API"
BUCKETS = ("jobs", "nodes", "leader", "coordinators", "nodelife")  # kvstore.ensure_layout's
OPERATOR, OBSERVER, SIMULATOR = "operator", "observer", "simulator"


@dataclass(frozen=True)
class Permissions:
    publish: list[str]
    subscribe: list[str]
    responses: bool = False  # may answer requests it received (their reply subjects)


def _kind(event: type[EventBase]) -> str:
    return str(event.__struct_config__.tag)


def kv_streams(cluster: str) -> list[str]:
    return [f"KV_{subjects.bucket(cluster, what)}" for what in BUCKETS]


def data_streams(cluster: str) -> list[str]:
    return [subjects.events_stream(cluster), subjects.progress_stream(cluster)]


def stream_reader(stream: str) -> list[str]:
    """Reading a stream: its info, direct gets (KV reads), ordered consumers (``tail``,
    ``report``, KV key listing) with their flow control and status checks, and deleting
    them afterwards."""
    return [
        f"{JS}.STREAM.INFO.{stream}",
        f"{JS}.DIRECT.GET.{stream}",
        f"{JS}.DIRECT.GET.{stream}.>",
        f"{JS}.CONSUMER.CREATE.{stream}",
        f"{JS}.CONSUMER.CREATE.{stream}.>",
        f"{JS}.CONSUMER.INFO.{stream}.>",
        f"{JS}.CONSUMER.DELETE.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def stream_owner(stream: str) -> list[str]:
    """What the coordinator does to its own streams: create and update them, and pull from
    durable consumers with explicit acks."""
    return [
        *stream_reader(stream),
        f"{JS}.STREAM.CREATE.{stream}",
        f"{JS}.STREAM.UPDATE.{stream}",
        f"{JS}.STREAM.MSG.GET.{stream}",
        f"{JS}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"{JS}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]


def leader_event(cluster: str) -> str:
    return subjects.event(cluster, "cluster", "-", _kind(CoordinatorLeader))


def agent(cluster: str, node: str) -> Permissions:
    """Its own node's events (what it reports about a job's ranks included, filed under
    the node: ``proto.events.NODE_REPORTED``), heartbeat, progress and commands: every
    subject it may publish names its node."""
    return Permissions(
        publish=[
            subjects.events_filter(cluster, node=node),
            subjects.heartbeat(cluster, node),
            subjects.progress(cluster, "*", node),
            subjects.clock(cluster),
        ],
        subscribe=[subjects.command(cluster, node), leader_event(cluster)],
        responses=True,
    )


def coordinator(cluster: str, ident: str) -> Permissions:
    return Permissions(
        publish=[
            *subjects.events_all(cluster),
            subjects.command(cluster, "*"),
            subjects.canary(cluster, ident),
            subjects.coordinator_alive(cluster, "*"),
            *(f"$KV.{subjects.bucket(cluster, what)}.>" for what in BUCKETS),
            *(
                s
                for stream in data_streams(cluster) + kv_streams(cluster)
                for s in stream_owner(stream)
            ),
        ],
        subscribe=[
            subjects.heartbeats(cluster),
            subjects.canary(cluster, ident),
            subjects.coordinator_alive(cluster, ident),
            subjects.api(cluster, "submit"),
            subjects.api(cluster, "control"),
            subjects.api(cluster, "node"),
            subjects.clock(cluster),
        ],
        responses=True,
    )


def observer(cluster: str) -> Permissions:
    """``status``, ``tail`` and ``report``: reads only; no API, no commands, no faults."""
    streams = data_streams(cluster) + kv_streams(cluster)
    return Permissions(
        publish=[s for stream in streams for s in stream_reader(stream)], subscribe=[]
    )


def operator(cluster: str) -> Permissions:
    """The observer's reads, plus submitting and controlling jobs, cordoning, draining
    and undraining nodes, and injecting faults."""
    reads = observer(cluster)
    return Permissions(
        publish=[
            *reads.publish,
            subjects.api(cluster, "submit"),
            subjects.api(cluster, "control"),
            subjects.api(cluster, "node"),
            subjects.sim(cluster, "*"),
        ],
        subscribe=[],
    )


def simulator(cluster: str, nodes: list[str]) -> Permissions:
    """Answers fault injections for its nodes; publishes nothing of its own."""
    return Permissions(
        publish=[], subscribe=[subjects.sim(cluster, n) for n in nodes], responses=True
    )


def agent_user(node: str) -> str:
    return f"agent-{node}"


def principals(cluster: str, nodes: list[str], coordinators: list[str]) -> dict[str, Permissions]:
    """Every user of a cluster by name (the creds file is ``<name>.json``)."""
    users = {agent_user(n): agent(cluster, n) for n in nodes}
    users.update({c: coordinator(cluster, c) for c in coordinators})
    users.update(
        {
            OPERATOR: operator(cluster),
            OBSERVER: observer(cluster),
            SIMULATOR: simulator(cluster, nodes),
        }
    )
    if len(users) != len(nodes) + len(coordinators) + 3:
        raise ValueError("principal names collide: give coordinators ids unlike the others")
    return users


def user_entry(creds: Creds, perms: Permissions) -> dict[str, object]:
    """One ``users`` entry of the server config. An empty publish list still denies all:
    the server allows everything on a side with no ``allow`` list."""
    publish = perms.publish or [creds.inbox]
    block: dict[str, object] = {
        "publish": {"allow": publish},
        "subscribe": {"allow": [*perms.subscribe, f"{creds.inbox}.>"]},
    }
    if perms.responses:
        block["allow_responses"] = True
    return {"user": creds.user, "password": creds.password, "permissions": block}


BLOCK = "authorization: "


def render(users: list[tuple[Creds, Permissions]]) -> str:
    """The ``authorization`` block (JSON is valid NATS config; quoted strings keep ``$JS``
    from being read as a variable)."""
    return _render([user_entry(c, p) for c, p in users])


def _render(entries: list[dict[str, object]]) -> str:
    body = json.dumps({"users": entries}, indent=2)
    return f"# generated by ringmaster (coordinator/auth.py); holds passwords\n{BLOCK}{body}\n"


def init(out: Path, cluster: str, nodes: list[str], coordinators: list[str]) -> Path:
    """Write ``out/nats-auth.conf`` (0600) and ``out/secrets/<name>.json`` for every
    principal, each with a fresh password. Returns the config's path."""
    for name in [cluster, *nodes, *coordinators]:
        subjects.check_token(name, "name")
    users = []
    for name, perms in principals(cluster, nodes, coordinators).items():
        creds = Creds(user=name, password=secrets.token_urlsafe(24))
        save(creds_path(out, name), creds)
        users.append((creds, perms))
    conf = out / "nats-auth.conf"
    conf.unlink(missing_ok=True)
    conf.touch(mode=0o600)
    conf.write_text(render(users))
    return conf


def add_agent(out: Path, cluster: str, node: str) -> Path:
    """A node joining a cluster already running: a creds file for its agent, and its user
    added to ``out/nats-auth.conf`` (written by :func:`init`). Every other user's entry,
    password included, stays as it was, so a server reload admits the node without
    disconnecting anyone; a node joining again gets a fresh password. Returns the creds
    file's path."""
    subjects.check_token(node, "name")
    conf = out / "nats-auth.conf"
    _, found, body = conf.read_text().partition(BLOCK)
    if not found:
        raise ValueError(f"{conf}: no authorization block")
    creds = Creds(user=agent_user(node), password=secrets.token_urlsafe(24))
    entries = [u for u in json.loads(body)["users"] if u["user"] != creds.user]
    save(creds_path(out, creds.user), creds)
    conf.write_text(_render([*entries, user_entry(creds, agent(cluster, node))]))
    return creds_path(out, creds.user)


def creds_path(out: Path, name: str) -> Path:
    return out / "secrets" / f"{name}.json"
