"""``coordinator``: run one coordinator (leader or standby; the lease decides)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import structlog

from coordinator.metrics import RETENTION_S
from coordinator.node_life import parse_probation
from coordinator.service import Coordinator
from proto.subjects import check_token
from ringmaster import slurm
from ringmaster.auth import ENV as ENV_CREDS
from ringmaster.auth import AuthError
from ringmaster.bus import DEFAULT_URL
from ringmaster.log import configure
from ringmaster.metrics import ANY_PORT

log = structlog.get_logger()
ENV_WEBHOOK = "RINGMASTER_ALERT_WEBHOOK_URL"
ENV_PROBATION = "RINGMASTER_PROBATION"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="coordinator", description="Ringmaster coordinator")
    p.add_argument("--nats", default=os.environ.get("RINGMASTER_NATS", DEFAULT_URL))
    p.add_argument("--cluster", default=os.environ.get("RINGMASTER_CLUSTER", "local"))
    p.add_argument("--id", default=f"coordinator-{socket.gethostname().split('.')[0]}")
    p.add_argument("--lease-ttl", type=float, default=2.0, help="seconds (default 2)")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        choices=(1, 3, 5),
        help="JetStream replicas for streams and buckets (3 on a 3-server NATS cluster)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9401,
        help="Prometheus /metrics port (default 9401; 0: off; -1: any free port)",
    )
    p.add_argument("--metrics-addr", default="0.0.0.0", help="address /metrics listens on")
    p.add_argument(
        "--metrics-retention-s",
        type=float,
        default=RETENTION_S,
        help=f"seconds an ended job's series stay on /metrics (default {RETENTION_S:g})",
    )
    p.add_argument(
        "--alert-webhook-url-file",
        type=Path,
        help="file holding a Slack-compatible webhook URL for critical events and job ends "
        "(else $RINGMASTER_ALERT_WEBHOOK_URL); a file, so a token in it stays off `ps`",
    )
    p.add_argument(
        "--creds",
        default=os.environ.get(ENV_CREDS),
        help=f"NATS creds file (else ${ENV_CREDS}; none: no auth)",
    )
    p.add_argument(
        "--slurm",
        choices=("auto", "on", "off"),
        default="auto",
        help="drain in Slurm the nodes Ringmaster finds bad, lift its own drains when they "
        "heal (auto: in each round where scontrol and a slurm.conf are found)",
    )
    p.add_argument(
        "--probation",
        action="append",
        default=[s for s in os.environ.get(ENV_PROBATION, "").split(",") if s],
        metavar="KIND=SECONDS",
        help="how long a node's health gate must pass, after the fault it was drained for "
        "closed, before it takes work again, for one kind (nvme.readonly=300; repeatable; "
        f"else ${ENV_PROBATION}, comma-separated; defaults in docs/architecture.md)",
    )
    p.add_argument("--log-json", action="store_true")
    args = p.parse_args(argv)
    try:
        check_token(args.id, "--id")
        check_token(args.cluster, "--cluster")
    except ValueError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    if not ANY_PORT <= args.metrics_port <= 65535:
        print("coordinator: --metrics-port must be -1, 0 or a port number", file=sys.stderr)
        return 2
    if not args.metrics_retention_s >= 0:  # NaN too
        print("coordinator: --metrics-retention-s must be 0 or more seconds", file=sys.stderr)
        return 2
    try:
        alert_url = webhook_url(args.alert_webhook_url_file)
    except ValueError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    try:
        probation = parse_probation(args.probation)
    except ValueError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    if args.lease_ttl < 1.0:
        print("coordinator: --lease-ttl must be at least 1 second", file=sys.stderr)
        return 2
    configure("coordinator", json=args.log_json)
    if args.slurm == "on" and not slurm.available():
        log.warning("--slurm on, but no scontrol or slurm.conf here: drains will fail")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Coordinator(
            args.nats,
            args.cluster,
            args.id,
            args.lease_ttl,
            replicas=args.replicas,
            metrics_port=args.metrics_port,
            metrics_addr=args.metrics_addr,
            metrics_retention_s=args.metrics_retention_s,
            alert_url=alert_url,
            creds=args.creds,
            slurm=args.slurm,
            probation=probation,
        ).run(stop)

    try:
        asyncio.run(run())
    except AuthError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    return 0


def webhook_url(path: Path | None) -> str:
    """The coordinator's alert webhook from ``path`` or the environment ("" for none)."""
    try:
        url = path.read_text().strip() if path else os.environ.get(ENV_WEBHOOK, "").strip()
    except OSError as exc:
        raise ValueError(f"--alert-webhook-url-file: {exc.strerror}: {path}") from None
    where = str(path) if path else f"${ENV_WEBHOOK}"
    if url and not url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: the alert webhook must be an http:// or https:// URL")
    return url


if __name__ == "__main__":
    sys.exit(main())
