#!/usr/bin/env bash
# Creates .venv and installs Ringmaster with its pinned CPU dependencies.
# Idempotent: reinstalls only when pyproject.toml or constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.ringmaster-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
echo "ringmaster: setting up .venv (first run takes a few minutes)" >&2
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
export PIP_CONSTRAINT="$PWD/constraints.txt"
"${pip[@]}" install --upgrade pip setuptools wheel
# deepspeed ships as an sdist whose setup.py imports torch: install torch first and
# build deepspeed against it (no isolated build env pulling another torch).
"${pip[@]}" install torch
DS_BUILD_OPS=0 "${pip[@]}" install --no-build-isolation deepspeed
"${pip[@]}" install -e '.[dev]'
echo "$want" > "$stamp"
