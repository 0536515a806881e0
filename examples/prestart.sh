#!/bin/sh
# Runs on every node after its GPUs are up and before its ranks start (warm caches,
# check mounts, load kernel modules). A non-zero exit fails the launch on this node.
echo "pre-start on ${RINGMASTER_NODE} for ${RINGMASTER_JOB_ID}: world ${WORLD_SIZE}, master ${MASTER_ADDR}:${MASTER_PORT}"
