#!/bin/bash
# A multi-node megatron-rl run over plain ssh: run this on the first trainer node (the Ray head,
# which also runs the driver); it starts Ray on every node with its role, converts the HF
# checkpoint once, submits `megatron-rl train` and stops Ray on every node when the run ends.
# Passwordless ssh to every node and a shared filesystem for HF_CHECKPOINT and OUTPUT_DIR are
# assumed; docs/production.md has the whole path.
#
#   TRAINER_NODES="node1 node2" GENERATOR_NODES="node3 node4" GPUS_PER_NODE=4 \
#   RECIPE=examples/llama4_scout/<recipe>.yaml HF_CHECKPOINT=/shared/Llama-4-Scout-17B-16E \
#   OUTPUT_DIR=/shared/runs/scout examples/launch/ssh.sh [section.field=value ...] \
#       2>&1 | tee driver.log
#
# With the Dockerfile's image: start one long-lived container per node (docker run -d --name
# megatron-rl --gpus all --network=host --ipc=host -v /shared:/shared megatron-rl:gpu sleep
# infinity), set MRL_SSH_PREFIX="docker exec megatron-rl" and MRL_REPO=/opt/megatron_rl, and run
# this script inside the head's container. Without it, MRL_SETUP activates the environment (e.g.
# "source /shared/megatron_rl/.venv/bin/activate"). Logs: driver.log, OUTPUT_DIR/generator-*.log,
# OUTPUT_DIR/processes.json, /tmp/ray/session_latest/logs on each node; TensorBoard:
# `tensorboard --logdir OUTPUT_DIR/tensorboard`.
set -euo pipefail
MRL_SSH_PREFIX=${MRL_SSH_PREFIX:-}

on_node() {  # NODE COMMAND
  # shellcheck disable=SC2086  # MRL_SSH_PREFIX is a command prefix
  ssh -o BatchMode=yes "$1" $MRL_SSH_PREFIX bash -c "$(printf '%q' "$2")"
}

# shellcheck source=common.sh
source "$(cd "$(dirname "$0")" && pwd)/common.sh"
trap stop_ray EXIT
start_ray
convert_checkpoint
submit_run "$@"
