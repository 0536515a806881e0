#!/usr/bin/env bash
# Sets up .venv if needed, then runs the walking-skeleton scenario on a local 2-node
# cluster: train examples/tiny.toml, inject an NVMe latency spike, watch the job pause,
# clear it, watch it resume and complete, and bring everything down.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export RINGMASTER_HOME="${RINGMASTER_HOME:-$PWD/.ringmaster/demo}"
exec .venv/bin/python examples/nvme_spike.py --home "$RINGMASTER_HOME" "$@"
