"""A child process for GPU collector tests: pynvml loads its library once per process, so
each test drives the collectors in a process of its own. One JSON command a line on stdin,
one JSON answer a line on stdout:

    {"collect": "gpu" | "gpu_topology"}  →  {"ok": true, "values": sample} | {"ok": false, "error"}
    {"wait": seconds}                    →  {"readable": bool}: the XID wake-up fd turned readable

The collectors read a manual clock that stands at ``ringmaster.clock.EPOCH``: samples and
XIDs are stamped with it.
"""

from __future__ import annotations

import json
import select
import sys

import msgspec

from nodeagent.collectors.base import CollectorUnavailable
from nodeagent.collectors.gpu import GpuCollector
from nodeagent.collectors.gpu_topology import GpuTopologyCollector
from nodeagent.collectors.nvml import NvmlSession
from ringmaster.clock import ManualClock


def main() -> None:
    session = NvmlSession(sys.argv[1] if len(sys.argv) > 1 else None)
    clock = ManualClock()
    collectors = {
        "gpu": GpuCollector(session, clock=clock),
        "gpu_topology": GpuTopologyCollector(session),
    }
    for line in sys.stdin:
        command = json.loads(line)
        answer: dict[str, object]
        if "wait" in command:
            ready, _, _ = select.select([collectors["gpu"].fileno()], [], [], command["wait"])
            answer = {"readable": bool(ready)}
        else:
            try:
                sample = collectors[command["collect"]].collect(clock.time())
                answer = {"ok": True, "values": msgspec.to_builtins(sample)}
            except CollectorUnavailable as exc:
                answer = {"ok": False, "error": str(exc)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
