# Ringmaster's images: hosts that boot systemd, with the units in systemd/ installed.
#
#   podman build --target control-plane -t ringmaster:control-plane .
#   podman build --target gpu-node -t ringmaster:gpu-node .
#
# control-plane: the node agent, the coordinator and coordinatorctl, no training stack
#   (small, quick to build): coordinator hosts, and nodes whose ranks bring their own.
# gpu-node: the same plus torch, DeepSpeed and torchao for the built-in trainer and the
#   rank API (TORCH_INDEX picks the CUDA build; the default is CUDA 12.8's).
#
# Both start /sbin/init. Enable the role's unit in an image of your own
# (`RUN systemctl enable ringmaster-nodeagent.service`) and bind its configuration into
# /etc/ringmaster (docs/operations.md, "Container images").
#
# BASE is any Debian or Ubuntu image; what it lacks of systemd and Python 3.11 is installed
# from its package archive. WHEELS (a folder inside the build context) installs the Python
# packages from that folder alone, with no index: for builds with no route to PyPI.
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS os
RUN set -eu; missing=""; \
    for p in systemd systemd-sysv dbus python3 python3-venv iproute2 procps ca-certificates; do \
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" \
            || missing="$missing $p"; \
    done; \
    if [ -n "$missing" ]; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
            --no-install-recommends $missing && rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'import sys; assert sys.version_info >= (3, 11), sys.version'
# a container's console is not a terminal, and nothing here needs a login
RUN systemctl mask getty.target console-getty.service systemd-logind.service \
    systemd-firstboot.service
STOPSIGNAL SIGRTMIN+3
CMD ["/sbin/init"]

FROM os AS control-plane
ARG WHEELS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# the dependencies first, from pyproject.toml alone: a change to the code reuses this layer
COPY pyproject.toml README.md /src/
RUN --mount=type=bind,target=/ctx set -eu; \
    for p in proto ringmaster nodeagent coordinator trainer; do \
        mkdir -p /src/$p && touch /src/$p/__init__.py; done; \
    python3 -m venv /opt/ringmaster; \
    /opt/ringmaster/bin/pip install -q ${WHEELS:+--no-index --find-links /ctx/$WHEELS} /src; \
    rm -rf /src
COPY proto /src/proto
COPY ringmaster /src/ringmaster
COPY nodeagent /src/nodeagent
COPY coordinator /src/coordinator
COPY trainer /src/trainer
COPY pyproject.toml README.md /src/
RUN --mount=type=bind,target=/ctx set -eu; \
    /opt/ringmaster/bin/pip install -q --no-deps ${WHEELS:+--no-index --find-links /ctx/$WHEELS} /src; \
    rm -rf /src; mkdir -p /etc/ringmaster
COPY systemd/ringmaster-nodeagent.service systemd/ringmaster-coordinator.service \
    /etc/systemd/system/
COPY docs /opt/ringmaster/docs
# Prometheus /metrics: the coordinator on 9401, the agent on 9402 (docs/operations.md).
EXPOSE 9401 9402

FROM control-plane AS gpu-node
ARG WHEELS=
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0
# a C compiler for torch.compile's generated code; nvme-cli and chronyc for the agent's
# disk and clock probes (each is a warning where it is missing, never a stop). chronyd
# itself stays off: a container cannot set the host's clock; chronyc asks the host's
# chronyd (with --net=host).
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
        --no-install-recommends gcc libc6-dev nvme-cli chrony \
    && rm -rf /var/lib/apt/lists/* && systemctl disable chrony.service
RUN --mount=type=bind,target=/ctx set -eu; \
    pip=/opt/ringmaster/bin/pip; \
    if [ -n "$WHEELS" ]; then index="--no-index --find-links /ctx/$WHEELS"; \
    else index="--index-url $TORCH_INDEX --extra-index-url https://pypi.org/simple"; fi; \
    $pip install -q $index "torch==$TORCH_VERSION"; \
    DS_BUILD_OPS=0 $pip install -q --no-build-isolation \
        ${WHEELS:+--no-index --find-links /ctx/$WHEELS} "deepspeed==0.19.8"; \
    $pip install -q ${WHEELS:+--no-index --find-links /ctx/$WHEELS} "torchao>=0.10"
