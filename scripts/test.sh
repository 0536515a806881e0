#!/usr/bin/env bash
# Sets up .venv if needed, then runs the one quality gate: format, lint, types, tests.
#   ./scripts/test.sh [PYTEST ARGS]         everything (what CI runs)
#   ./scripts/test.sh --fast [PYTEST ARGS]  the edit loop: every test but the scenarios
#                                           (end-to-end, boot, Slurm, and the runs of real
#                                           ranks: the tests marked slow)
set -euo pipefail
cd "$(dirname "$0")/.."
fast=()
if [[ ${1:-} == --fast ]]; then
    shift
    fast=(-m "not slow" --ignore=tests/e2e --ignore=tests/boot)
fi
./scripts/bootstrap.sh
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy
# Two workers, one per core of the machines this runs on; an idle worker steals queued
# tests (three were no faster here: the suite is bound by the cores).
# RINGMASTER_TEST_WORKERS=0 runs the tests in this process, one after another.
exec .venv/bin/python -m pytest -n "${RINGMASTER_TEST_WORKERS:-2}" --dist worksteal \
    "${fast[@]}" "$@"
