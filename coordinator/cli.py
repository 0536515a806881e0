"""``coordinator``: run one coordinator (leader or standby; the lease decides)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

from coordinator.service import Coordinator
from proto.subjects import check_token
from ringmaster.bus import DEFAULT_URL
from ringmaster.log import configure


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
    p.add_argument("--log-json", action="store_true")
    args = p.parse_args(argv)
    try:
        check_token(args.id, "--id")
        check_token(args.cluster, "--cluster")
    except ValueError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    if args.lease_ttl < 1.0:
        print("coordinator: --lease-ttl must be at least 1 second", file=sys.stderr)
        return 2
    configure("coordinator", json=args.log_json)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Coordinator(
            args.nats, args.cluster, args.id, args.lease_ttl, replicas=args.replicas
        ).run(stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
