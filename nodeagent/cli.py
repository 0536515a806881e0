"""``nodeagent``: run the daemon, or print one sample of every collector (``--once``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import msgspec

from nodeagent import health_gate
from nodeagent.config import AgentConfig, ConfigError, load
from nodeagent.registry import build, preflight
from nodeagent.sampling import close_all, run_once
from proto.warm import WARM_RANKS_ENV, WARM_TEMPLATE_ENV, warm_ranks
from ringmaster.auth import AuthError
from ringmaster.log import configure


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nodeagent", description="Ringmaster node agent")
    p.add_argument("--config", type=Path, help="agent TOML file")
    p.add_argument("--node", help="node id (default: short hostname)")
    p.add_argument("--cluster")
    p.add_argument("--nats", help="NATS URL(s), comma-separated")
    p.add_argument("--creds", dest="creds_file", help="NATS creds file (else $RINGMASTER_CREDS)")
    p.add_argument("--run-dir", dest="run_dir")
    p.add_argument("--sysfs")
    p.add_argument("--procfs")
    p.add_argument("--dev")
    p.add_argument("--gpus", type=int)
    p.add_argument(
        "--warm-ranks",
        dest="warm_ranks",
        type=int,
        default=warm_ranks(os.environ),
        help=f"spare rank interpreters, 0: none (else ${WARM_RANKS_ENV}, else the config's)",
    )
    p.add_argument(
        "--warm-template-socket",
        dest="warm_template_socket",
        default=os.environ.get(WARM_TEMPLATE_ENV) or None,
        help="fork spares from the template this machine's agents share, listening here "
        f"(else ${WARM_TEMPLATE_ENV}, else the config's)",
    )
    p.add_argument("--advertise-addr", dest="advertise_addr")
    p.add_argument("--simulated", action="store_true", default=None)
    p.add_argument(
        "--metrics-port", dest="metrics_port", type=int, help="0: off; -1: any free port"
    )
    p.add_argument("--metrics-addr", dest="metrics_addr", help="address /metrics listens on")
    p.add_argument("--once", action="store_true", help="print one sample of every collector")
    p.add_argument(
        "--preflight", action="store_true", help="check the host; exit 1 if a required check fails"
    )
    p.add_argument(
        "--health-gate",
        action="store_true",
        help="may this node take work? exit 1 naming its open conditions (Slurm Prolog, "
        "HealthCheckProgram); 0 with a warning when the agent cannot be asked",
    )
    p.add_argument("--json", action="store_true", help="with --once or --preflight: JSON")
    p.add_argument("--log-json", action="store_true", help="log JSON lines")
    return p.parse_args(argv)


def sample_all(config: AgentConfig) -> dict[str, object]:
    """One full sample per collector. Rate-based collectors need two readings, so every
    collector is read, then read again after the longest interval (capped at 1 s)."""
    entries = build(config)
    for entry in entries:
        run_once(entry, time.time())
    time.sleep(min(1.0, max(e.collector.interval_s for e in entries)))
    out: dict[str, object] = {}
    for entry in entries:
        sample, status = run_once(entry, time.time())
        out[status.name] = {
            "ok": status.ok,
            "duration_s": round(status.duration_s, 6),
            "error": status.error,
            "values": msgspec.to_builtins(sample) if sample else None,
        }
    close_all(entries)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    overrides = {
        k: getattr(args, k)
        for k in (
            "node",
            "cluster",
            "nats",
            "creds_file",
            "run_dir",
            "sysfs",
            "procfs",
            "dev",
            "gpus",
            "warm_ranks",
            "warm_template_socket",
            "advertise_addr",
            "simulated",
            "metrics_port",
            "metrics_addr",
        )
    }
    try:
        config = load(args.config, overrides)
    except ConfigError as exc:
        print(f"nodeagent: {exc}", file=sys.stderr)
        return 2
    if args.health_gate:
        url = health_gate.metrics_url(
            config.metrics_addr, config.metrics_port, Path(config.run_dir)
        )
        code, line = health_gate.check(config.node, url)
        print(line, file=sys.stderr if line.startswith("warning") else sys.stdout)
        return code
    configure("nodeagent", json=args.log_json)
    if args.preflight:
        sample, status = run_once(preflight(config), time.time())
        if args.json:
            out = msgspec.to_builtins(sample) if sample else {"ok": False, "error": status.error}
            print(json.dumps(out, indent=2))
        elif sample is None:
            print(f"preflight: {status.error}", file=sys.stderr)
        else:
            for check in sample.checks:
                verdict = "ok  " if check.ok else "FAIL" if check.required else "WARN"
                was = f"; was {check.fixed_from}" if check.fixed_from else ""
                print(f"{verdict} {check.name}: {check.value} (want {check.want}{was})")
        return 0 if sample is not None and sample.ok else 1
    if args.once:
        result = sample_all(config)
        if args.json:
            print(json.dumps(result, indent=2, sort_keys=True))
        else:
            for name, value in result.items():
                print(f"{name}: {json.dumps(value, sort_keys=True)}")
        return 0
    from nodeagent.daemon import Agent

    async def run() -> None:
        stop = asyncio.Event()
        agent = Agent(config)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, agent.on_sigterm, stop)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await agent.run(stop)

    try:
        asyncio.run(run())
    except AuthError as exc:
        print(f"nodeagent: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
