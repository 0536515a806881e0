"""``coordinatorctl``: the operator's command line (its contract is in README.md).

Exit codes: 0 success, 1 the operation or job failed, 2 bad usage or bad input. Data goes
to stdout (``start`` prints the job id alone); progress and errors go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from pathlib import Path
from typing import NoReturn

from nats.errors import Error as NatsError
from rich.console import Console

from coordinator import loop_support
from coordinator.auth import init as init_auth
from coordinator.ctl import join, local, netns
from coordinator.ctl.bus import session
from coordinator.ctl.errors import CtlError
from coordinator.ctl.follow import follow, inside_allocation
from coordinator.ctl.home import home, resolve, resolve_creds
from coordinator.ctl.inject import inject
from coordinator.ctl.jobfile import JobFileError, load_job
from coordinator.ctl.nodes import node_command
from coordinator.ctl.report import report
from coordinator.ctl.start_point import decide, in_use, sharing
from coordinator.ctl.status import render, status_json
from coordinator.ctl.tail import Filters, parse_duration, tail
from proto.api import JobControl, SubmitJob
from proto.events import Severity
from proto.job import JobRecord
from ringmaster.slurm import REQUEUE_EXIT


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def build() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("--nats", help="NATS URL (else $RINGMASTER_NATS, else the local cluster)")
    common.add_argument("--cluster", help="cluster name (default: the local cluster's, 'local')")
    common.add_argument("--dir", help="local cluster directory (else $RINGMASTER_HOME)")
    common.add_argument(
        "--creds", help="NATS creds file (else $RINGMASTER_CREDS, else the local cluster's)"
    )
    p = Parser(prog="coordinatorctl", description="Operate a Ringmaster cluster")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    up = sub.add_parser("up", parents=[common], help="start a local cluster")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--gpus-per-node", type=int, default=1)
    up.add_argument("--standby", action="store_true", help="also start a standby coordinator")
    up.add_argument("--json", action="store_true")
    up.add_argument(
        "--netns",
        action="store_true",
        help="root: each node in its own network namespace, on a control and a data network",
    )
    up.add_argument("--ctl-net", default=netns.CTL_NET, help="with --netns: the control network")
    up.add_argument("--data-net", default=netns.DATA_NET, help="with --netns: the data network")
    up.add_argument(
        "--auth",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per-process NATS users with least-privilege permissions (default: on)",
    )
    auth = sub.add_parser("auth", help="NATS users and creds for a production cluster")
    auth_sub = auth.add_subparsers(dest="auth_command", required=True, parser_class=Parser)
    init = auth_sub.add_parser("init", help="write nats-auth.conf and one creds file each")
    init.add_argument("--cluster", required=True)
    init.add_argument("--nodes", required=True, help="comma-separated node ids")
    init.add_argument("--coordinators", default="coordinator-0", help="comma-separated ids")
    init.add_argument("--out", type=Path, required=True, help="directory to write into")
    sub.add_parser("down", parents=[common], help="stop everything up started")
    jn = sub.add_parser(
        "join", parents=[common], help="start a real node's agent in the local cluster"
    )
    jn.add_argument("node", help="its node id")
    jn.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="ranks it hosts (default: the cluster's --gpus-per-node); on CPU without GPUs",
    )
    jn.add_argument(
        "--print",
        dest="print_only",
        action="store_true",
        help="admit it and print its nodeagent command line, without starting it",
    )
    start = sub.add_parser("start", parents=[common], help="submit a job")
    start.add_argument("jobfile", type=Path)
    start.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    start.add_argument(
        "--wait",
        action="store_true",
        help="follow the job to its end; exit 0 completed, 1 failed, "
        f"{REQUEUE_EXIT} stopped at a checkpoint for its Slurm job to be requeued",
    )
    start.add_argument(
        "--no-allocation",
        action="store_true",
        help="inside a Slurm allocation, place the job on any node, not the allocation's",
    )
    origin = start.add_mutually_exclusive_group()
    origin.add_argument(
        "--resume",
        action="store_true",
        help="resume from the checkpoint dir's newest checkpoint even if it is at or past "
        "the target step",
    )
    origin.add_argument(
        "--fresh",
        action="store_true",
        help="start from step 0 in a new checkpoint dir beside the configured one",
    )
    status = sub.add_parser("status", parents=[common], help="nodes and jobs")
    status.add_argument("job", nargs="?")
    status.add_argument("--json", action="store_true")
    status.add_argument(
        "-o",
        "--output",
        choices=("wide", "json"),
        help="wide: every column even in a narrow terminal (piped output always has them)",
    )
    status.add_argument("--wide", dest="output", action="store_const", const="wide")
    t = sub.add_parser("tail", parents=[common], help="live events")
    t.add_argument("--since", help="replay history from this long ago (90s, 5m, 2h)")
    t.add_argument("--no-follow", dest="follow", action="store_false")
    t.add_argument("--node")
    t.add_argument("--job")
    t.add_argument("--kind", help="event kind, shell-style patterns allowed (nvme.*)")
    t.add_argument("--severity", choices=[s.value for s in Severity], help="at least this")
    t.add_argument("--json", action="store_true")
    for verb in ("pause", "resume", "checkpoint", "stop"):
        c = sub.add_parser(verb, parents=[common], help=f"{verb} a job")
        c.add_argument("job")
    cordon = sub.add_parser("cordon", parents=[common], help="no new placements on a node")
    cordon.add_argument("node")
    cordon.add_argument("--reason", default="", help="why, shown with the cordon")
    drain = sub.add_parser(
        "drain", parents=[common], help="take a node out: its jobs move elsewhere"
    )
    drain.add_argument("node")
    drain.add_argument("--reason", required=True, help="why (shown in status and in Slurm)")
    undrain = sub.add_parser(
        "undrain", parents=[common], help="return a node to placement (also lifts a cordon)"
    )
    undrain.add_argument("node")
    rep = sub.add_parser("report", parents=[common], help="a job's goodput, costs and timeline")
    rep.add_argument("job")
    rep.add_argument("--price-per-gpu-hour", type=price, metavar="X", help="money per GPU-hour")
    rep.add_argument("--html", type=Path, metavar="FILE", help="also write an HTML timeline")
    rep.add_argument("--json", action="store_true")
    inj = sub.add_parser("inject", parents=[common], help="inject a fault (simulated nodes)")
    inj.add_argument("node")
    inj.add_argument("fault")
    return p


def price(text: str) -> float:
    """A non-negative finite number (argparse turns the ValueError into exit 2)."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(text)
    return value


def main(argv: list[str] | None = None) -> int:
    args = build().parse_args(argv)
    try:
        return dispatch(args)
    except CtlError as exc:
        print(f"coordinatorctl: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except (NatsError, TimeoutError) as exc:  # the bus went away mid-command
        print(f"coordinatorctl: NATS: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `coordinatorctl tail | head`: the reader is gone, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def dispatch(args: argparse.Namespace) -> int:
    if args.command == "auth":
        return auth_init(args)
    directory = home(args.dir)
    if args.command == "up":
        cluster = args.cluster or os.environ.get("RINGMASTER_CLUSTER") or "local"
        info = local.up(
            directory,
            args.nodes,
            args.gpus_per_node,
            args.standby,
            cluster,
            auth=args.auth,
            netns=args.netns,
            ctl_net=args.ctl_net,
            data_net=args.data_net,
        )
        if args.json:
            print(json.dumps({"dir": str(directory), "nats": info.nats, "nodes": info.nodes}))
        else:
            print(
                f"local cluster up in {directory}: {len(info.nodes)} nodes, NATS {info.nats}",
                file=sys.stderr,
            )
        return 0
    if args.command == "join":
        return join_node(directory, args)
    if args.command == "down":
        for what in local.down(directory):
            print(what if what.startswith("removed ") else f"stopped {what}", file=sys.stderr)
        return 0
    url, cluster = resolve(args.nats, args.cluster, args.dir)
    creds = resolve_creds(args.creds, args.dir)
    return asyncio.run(_remote(args, url, cluster, creds, directory))


def join_node(directory: Path, args: argparse.Namespace) -> int:
    if args.gpus is not None and args.gpus < 1:
        raise CtlError("--gpus must be at least 1", code=2)
    if args.print_only:
        print(shlex.join(join.command(directory, args.node, args.gpus)[1]))
    else:
        print(join.join(directory, args.node, args.gpus), file=sys.stderr)
    return 0


def auth_init(args: argparse.Namespace) -> int:
    nodes = [n for n in args.nodes.split(",") if n]
    coordinators = [c for c in args.coordinators.split(",") if c]
    try:
        conf = init_auth(args.out, args.cluster, nodes, coordinators)
    except ValueError as exc:
        raise CtlError(str(exc), code=2) from None
    print(f"wrote {conf} and the creds files in {conf.parent / 'secrets'}", file=sys.stderr)
    return 0


async def _remote(
    args: argparse.Namespace, url: str, cluster: str, creds: str | None, directory: Path
) -> int:
    cmd = args.command
    if cmd == "start":
        try:
            spec = load_job(args.jobfile, args.set)
        except JobFileError as exc:
            raise CtlError(str(exc), code=2) from None
        alloc = None if args.no_allocation else inside_allocation(spec)
        workdir = Path.cwd()
        point = decide(spec, workdir, resume=args.resume, fresh=args.fresh)
        spec.checkpoint.dir = point.checkpoint_dir
    async with session(url, cluster, creds) as s:
        if cmd == "start":
            try:
                jobs = await s.records("jobs", JobRecord)
            except CtlError:  # no job state yet: the submit will say why
                jobs = []
            if (busy := sharing(jobs, point.checkpoint_dir)) is not None:
                raise in_use(busy)
            submit = SubmitJob(
                spec=spec,
                workdir=str(workdir),
                source=str(args.jobfile.resolve()),
                resume_step=point.resume_step,
                resume_job=point.resume_job,
                allocation=alloc,
            )
            reply = await s.ask("submit", submit)
            if not reply.ok:
                raise CtlError(reply.error, code=2)
            print(f"{reply.job}: {point.note}", file=sys.stderr)
            said = loop_support.summary(JobRecord(id=reply.job, name=spec.job.name, spec=spec))
            loop = "its script's" if spec.job.entry else "the built-in trainer's"
            print(f"{reply.job}: reactions ({loop}): {said}", file=sys.stderr)
            print(reply.job, flush=True)
            if not args.wait:
                return 0
            return await follow(s, reply.job, alloc, lambda: session(url, cluster, creds))
        if cmd == "status":
            data = await status_json(s, args.job)
            for line in s.unreadable:
                print(f"warning: {line}", file=sys.stderr)
            if args.json or args.output == "json":
                print(json.dumps(data, indent=2))
            else:
                render(Console(highlight=False), data, args.job, wide=args.output == "wide")
            return 0
        if cmd == "tail":
            since = parse_duration(args.since) if args.since else None
            severity = Severity(args.severity) if args.severity else None
            filters = Filters(node=args.node, job=args.job, kind=args.kind, severity=severity)
            return await tail(s, filters, since, args.follow, args.json)
        if cmd in ("pause", "resume", "checkpoint", "stop"):
            reply = await s.ask("control", JobControl(job=args.job, action=cmd))
            if not reply.ok:
                code = 2 if reply.error.startswith("no job") else 1
                raise CtlError(reply.error, code=code)
            print(
                f"{cmd}: sent to {reply.job}{f' ({reply.note})' if reply.note else ''}",
                file=sys.stderr,
            )
            return 0
        if cmd in ("cordon", "drain", "undrain"):
            return await node_command(s, cmd, args.node, getattr(args, "reason", ""), creds)
        if cmd == "report":
            print(await report(s, args.job, args.price_per_gpu_hour, args.html, args.json))
            return 0
        if cmd == "inject":
            print(await inject(s, args.node, args.fault, directory), file=sys.stderr)
            return 0
    raise CtlError(f"unknown command {cmd}", code=2)


if __name__ == "__main__":
    sys.exit(main())
