"""Run every fuzz property of tests/fuzz with the ``bench`` profile (10,000 examples per
property unless ``--examples`` says otherwise) and print a table: property, examples run,
failures, seconds. Exits non-zero when a property fails.

    .venv/bin/python bench/fuzz.py                 # everything, 10,000 examples each
    .venv/bin/python bench/fuzz.py --examples 500 -k jobfile
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="bench", help="per property (default: bench)")
    parser.add_argument("-k", dest="select", help="pytest -k expression")
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the run")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fuzz-bench-") as tmp:
        report = Path(tmp) / "report.json"
        env = {
            **os.environ,
            "RINGMASTER_FUZZ_EXAMPLES": str(args.examples),
            "RINGMASTER_FUZZ_REPORT": str(report),
            "RINGMASTER_FUZZ_CLI_EXAMPLES": os.environ.get("RINGMASTER_FUZZ_CLI_EXAMPLES", "30"),
        }
        cmd = [sys.executable, "-m", "pytest", "tests/fuzz", "-q", "-p", "no:cacheprovider"]
        cmd += ["-o", "addopts=", "--timeout=0", *(["-k", args.select] if args.select else [])]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.timeout, check=False)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
        took = time.monotonic() - started
        results = json.loads(report.read_text()) if report.exists() else {}
    rows = sorted(results.items())
    print(f"\n{'property':<58} {'examples':>9} {'failures':>9} {'seconds':>8}")
    for nodeid, entry in rows:
        name = nodeid.split("::", 1)[-1]
        print(
            f"{name:<58} {entry.get('examples', 0):>9} {int(bool(entry.get('failed'))):>9}"
            f" {entry.get('seconds', 0.0):>8.1f}"
        )
    failures = sum(bool(e.get("failed")) for _, e in rows)
    total = sum(int(e.get("examples", 0)) for _, e in rows)
    print(
        f"{len(rows)} tests, {total} examples, {failures} failed, {took:.0f} s (pytest exit {code})"
    )
    return 1 if failures or code not in (0, 5) else 0


if __name__ == "__main__":
    sys.exit(main())
