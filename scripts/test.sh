#!/usr/bin/env bash
# Sets up .venv if needed, then runs the one quality gate: format, lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
