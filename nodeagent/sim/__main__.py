"""``python -m nodeagent.sim``: simulate the hardware of several nodes in one process.

Each node gets ``<root>/<node>/sys``, ``proc`` and ``dev``, ticked every ``--tick`` seconds,
``--gpus`` GPUs behind a stub NVML library in ``nvml/``, a cloud metadata service on a local
port, and a NATS responder on ``proto.subjects.sim(cluster, node)`` that applies
``InjectFault`` requests. ``<root>/<node>/agent.toml`` holds the settings that point that
node's agent at all this (start it with ``--config``). ``<root>/<node>/.ready`` appears once
the tree has been ticked, the config written and injection is being served, so whoever
starts agents after it can wait for that file.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import anyio
import msgspec
import structlog
from nats.aio.msg import Msg

from nodeagent.sim import agent_config
from nodeagent.sim.metadata import MetadataServer
from nodeagent.sim.node import SimulatedNode
from proto import subjects
from proto.api import InjectFault, InjectReply
from ringmaster import auth
from ringmaster.bus import connect

log = structlog.get_logger("nodeagent.sim")
_inject_decoder = msgspec.json.Decoder(InjectFault)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nodeagent.sim", description=__doc__)
    parser.add_argument("--root", type=Path, required=True, help="directory holding the nodes")
    parser.add_argument("--nodes", required=True, help="comma-separated node ids")
    parser.add_argument("--nats", required=True, help="NATS server URL")
    parser.add_argument("--cluster", required=True, help="cluster name in subjects")
    parser.add_argument("--creds", help="NATS creds file (else $RINGMASTER_CREDS)")
    parser.add_argument("--tick", type=float, default=0.1, help="seconds between updates")
    parser.add_argument("--nvme-devices", type=int, default=2, help="NVMe namespaces per node")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per node (stub NVML)")
    parser.add_argument("--pidfile", type=Path, help="write this process's id here")
    parser.add_argument(
        "--netns-host",
        metavar="ADDR",
        help="each node's agent runs in its own network namespace and reaches this host at "
        "ADDR (coordinatorctl up --netns): the metadata services listen there, and the "
        "agents read their links (real veths) from their namespace's /sys",
    )
    parser.add_argument(
        "--warm-template-socket",
        metavar="PATH",
        help="the agents fork their spares from the template listening here, which this "
        "machine's agents share (coordinatorctl up starts it)",
    )
    args = parser.parse_args(argv)
    try:
        subjects.check_token(args.cluster, "cluster")
        args.nodes = [subjects.check_token(n, "node") for n in args.nodes.split(",") if n]
    except ValueError as exc:
        parser.error(str(exc))
    if not args.nodes:
        parser.error("--nodes names no node")
    if args.tick <= 0:
        parser.error("--tick must be above 0")
    return args


def configure_logging() -> None:
    """One JSON object per line on stderr, tracebacks included, so logs stay greppable."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def handle_inject(node: SimulatedNode, data: bytes) -> InjectReply:
    try:
        request = _inject_decoder.decode(data)
    except msgspec.DecodeError as exc:
        return InjectReply(ok=False, error=f"bad InjectFault payload: {exc}", faults=node.faults())
    try:
        node.apply(request.fault)
    except ValueError as exc:
        log.info("inject_refused", node=node.node, fault=request.fault, error=str(exc))
        return InjectReply(ok=False, error=str(exc), faults=node.faults())
    log.info("inject_applied", node=node.node, fault=request.fault, faults=node.faults())
    return InjectReply(ok=True, faults=node.faults())


async def run(args: argparse.Namespace) -> None:
    host = args.netns_host or "127.0.0.1"
    services = {n: MetadataServer(host=host).start() for n in args.nodes}
    # in a namespace the data link and TCP's counters are real: the agent reads them where
    # the kernel shows them (/proc/net follows the namespace)
    real = {"nic_sysfs": "/sys", "tcp_procfs": "/proc"}
    overrides: dict[str, object] = {"network": real} if args.netns_host else {}
    if args.warm_template_socket:
        overrides["warm_template_socket"] = args.warm_template_socket
    nodes = [
        SimulatedNode(args.root / n, n, args.nvme_devices, gpus=args.gpus, metadata=services[n])
        for n in args.nodes
    ]
    for node in nodes:
        (node.root / ".ready").unlink(missing_ok=True)  # a marker left by an earlier run
        node.tick(args.tick)
        agent_config.write(node, overrides)
        if node.gpus is not None and node.gpus.error:
            log.warning("no simulated GPUs", node=node.node, error=node.gpus.error)
    try:
        await _run(args, nodes)
    finally:
        for service in services.values():
            service.stop()


async def _run(args: argparse.Namespace, nodes: list[SimulatedNode]) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_tick_forever, nodes, args.tick)
            tg.start_soon(_serve, args, nodes)
            async for signum in signals:
                log.info("stopping", signal=signal.Signals(signum).name)
                break
            tg.cancel_scope.cancel()


async def _serve(args: argparse.Namespace, nodes: list[SimulatedNode]) -> None:
    """Answer injections until cancelled; keeps retrying the server, as agents do."""

    nc = await connect(args.nats, "ringmaster-sim", auth.from_env(args.creds))
    try:
        for node in nodes:

            async def respond(msg: Msg, node: SimulatedNode = node) -> None:
                await msg.respond(msgspec.json.encode(handle_inject(node, msg.data)))

            await nc.subscribe(subjects.sim(args.cluster, node.node), cb=respond)
        await nc.flush()
        for node in nodes:
            (node.root / ".ready").write_text(f"{os.getpid()}\n")
        log.info("serving", nodes=args.nodes, root=str(args.root), nats=args.nats)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await nc.drain()


async def _tick_forever(nodes: list[SimulatedNode], interval: float) -> None:
    """Tick by measured elapsed time, so counters follow the wall clock under load."""
    last = time.monotonic()
    while True:
        await anyio.sleep(interval)
        now = time.monotonic()
        for node in nodes:
            node.tick(now - last)
        last = now


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    if args.pidfile:
        args.pidfile.parent.mkdir(parents=True, exist_ok=True)
        args.pidfile.write_text(f"{os.getpid()}\n")
    try:
        anyio.run(run, args, backend="asyncio")
    except Exception:
        log.exception("failed")
        return 1
    finally:
        if args.pidfile:
            args.pidfile.unlink(missing_ok=True)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
