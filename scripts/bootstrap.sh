#!/usr/bin/env bash
# Creates .venv and installs Ringmaster with its pinned CPU dependencies.
# Idempotent: reinstalls only when pyproject.toml or constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# promtool and prometheus (Debian's prometheus package) for the metrics tests: installed only
# as root where apt-get exists and they are missing, never a reason for set-up to fail; the
# package's service is turned off (the tests start a Prometheus of their own).
if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null \
    && ! { command -v promtool && command -v prometheus; } >/dev/null; then
    echo "ringmaster: installing Debian's prometheus package (promtool)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        -o DPkg::Lock::Timeout=300 --no-install-recommends prometheus; } >/dev/null 2>&1 \
        && { systemctl disable --now prometheus.service >/dev/null 2>&1 || true; } \
        || echo "ringmaster: prometheus not installed; the tests that need it skip" >&2
fi
# Chromium (Debian's chromium package, with the fonts it recommends) for the HTML
# report's browser test: on the same terms.
if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null \
    && ! command -v chromium >/dev/null; then
    echo "ringmaster: installing Debian's chromium package" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        -o DPkg::Lock::Timeout=300 --no-install-recommends chromium fonts-liberation; } \
        >/dev/null 2>&1 \
        || echo "ringmaster: chromium not installed; the report's browser test skips" >&2
fi
# nft (Debian's nftables) for inject's packet loss on kernels without the netem qdisc:
# on the same terms.
if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null && ! command -v nft >/dev/null; then
    echo "ringmaster: installing Debian's nftables package (nft)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        -o DPkg::Lock::Timeout=300 --no-install-recommends nftables; } >/dev/null 2>&1 \
        || echo "ringmaster: nftables not installed; injected loss needs the netem qdisc" >&2
fi
# Slurm (Debian's slurmctld, slurmd, slurm-client and munge) for the tests that run the
# job inside a real allocation: on the same terms; the packages' services are turned off
# (the tests start their own daemons with their own configuration).
if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null \
    && ! { command -v slurmctld && command -v slurmd && command -v sbatch \
        && command -v munged; } >/dev/null; then
    echo "ringmaster: installing Debian's Slurm packages (slurmctld, slurmd, munge)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        -o DPkg::Lock::Timeout=300 --no-install-recommends slurmctld slurmd slurm-client \
        munge; } >/dev/null 2>&1 \
        && { systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true; } \
        || echo "ringmaster: Slurm not installed; the tests inside an allocation skip" >&2
fi
# Podman, runc, mmdebstrap and iptables (Debian's packages; netavark wants iptables) for
# the tests whose nodes are containers booting systemd from the Dockerfile's image: on the
# same terms. The images are built by those tests and kept between runs (tests/boot).
if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null \
    && ! { command -v podman && command -v runc && command -v mmdebstrap \
        && command -v iptables; } >/dev/null; then
    echo "ringmaster: installing Debian's podman, runc, mmdebstrap and iptables" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        -o DPkg::Lock::Timeout=300 --no-install-recommends podman runc netavark \
        aardvark-dns mmdebstrap iptables; } >/dev/null 2>&1 \
        || echo "ringmaster: podman not installed; the booting-node tests skip" >&2
fi
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
