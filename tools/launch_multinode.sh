#!/usr/bin/env bash
# Launch `asyncrl train` across trainer nodes with torchrun (the Megatron trainer).
#
# Run the same command on every trainer node; node 0 is the head. Rank 0 (on the head) runs
# the event loop (rollouts, RoC, engines, metrics, checkpoints); every other rank holds its
# Megatron shards and follows rank 0's trainer calls over torch.distributed
# (asyncrl/cli/launch.py; the followers are asyncrl/trainer/megatron/launch.py). See
# docs/multinode.md.
#
# Two nodes of 8 GPUs, head at 10.0.0.1:
#   node 0:  NNODES=2 NODE_RANK=0 HEAD_NODE=10.0.0.1 tools/launch_multinode.sh my_rstar2.toml
#   node 1:  NNODES=2 NODE_RANK=1 HEAD_NODE=10.0.0.1 tools/launch_multinode.sh my_rstar2.toml
# i.e. on each node:
#   torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 \
#     --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id asyncrl \
#     -m asyncrl.cli.launch train my_rstar2.toml
#
# Extra arguments go to `asyncrl train` (e.g. --set trainer.tensor_parallel=8, --resume).
# The world (NNODES x GPUS_PER_NODE) must be a multiple of trainer.tensor_parallel; the rest
# is data parallel. Single node: NNODES=1 (HEAD_NODE defaults to localhost).
#
# Env: NNODES (default 1), NODE_RANK (0), HEAD_NODE (localhost), PORT (29500),
#      GPUS_PER_NODE (all visible GPUs), RDZV_ID (asyncrl), DRY_RUN=1 prints the command.
set -euo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
HEAD_NODE=${HEAD_NODE:-localhost}
PORT=${PORT:-29500}
RDZV_ID=${RDZV_ID:-asyncrl}
if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  [ "${GPUS_PER_NODE:-0}" -gt 0 ] || GPUS_PER_NODE=1
fi

# NCCL over the node's fast network; leave these to the cluster's defaults unless needed.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron TP overlap

cmd=(torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
     --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$PORT" --rdzv-id "$RDZV_ID"
     -m asyncrl.cli.launch train "$@")

if [ "${DRY_RUN:-0}" = "1" ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
