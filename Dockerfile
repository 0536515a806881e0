# One image for the node agent, the coordinator and the trainer.
# GPU nodes: build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
RUN apt-get update && apt-get install -y --no-install-recommends gcc nvme-cli chrony \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/ringmaster
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && DS_BUILD_OPS=0 pip install --no-cache-dir --no-build-isolation "deepspeed==0.19.8"
COPY pyproject.toml README.md ./
COPY proto proto
COPY ringmaster ringmaster
COPY nodeagent nodeagent
COPY coordinator coordinator
COPY trainer trainer
RUN pip install --no-cache-dir .
# The agent reads the host's hardware: run with --pid=host, --net=host, -v /sys:/host/sys:ro,
# -v /proc:/host/proc:ro and --sysfs /host/sys --procfs /host/proc.
# Prometheus /metrics: the coordinator on 9401, the agent on 9402 (docs/operations.md).
EXPOSE 9401 9402
ENTRYPOINT ["nodeagent"]
