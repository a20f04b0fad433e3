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
# Where hostnames do not resolve to the inter-node network (containers, multi-homed nodes,
# network namespaces), give each node its own address on that network too:
#   NODE_ADDR=10.0.0.2 NNODES=2 NODE_RANK=1 HEAD_NODE=10.0.0.1 tools/launch_multinode.sh ...
# Extra arguments go to `asyncrl train` (e.g. --set trainer.tensor_parallel=8, --resume).
# The world (NNODES x GPUS_PER_NODE) must be a multiple of trainer.tensor_parallel; the rest
# is data parallel. Single node: NNODES=1 (HEAD_NODE defaults to localhost).
#
# Env: NNODES (default 1), NODE_RANK (0), HEAD_NODE (localhost), PORT (29500),
#      GPUS_PER_NODE (all visible GPUs), RDZV_ID (asyncrl), NODE_ADDR (this node's address
#      on the inter-node network; default: let torchrun use the hostname), DRY_RUN=1 prints
#      the command.
# The head node always hosts the rendezvous store (is_host=1; is_host=0 elsewhere): c10d's own
# guess compares HEAD_NODE with this machine's hostname and fails where the hostname does
# not resolve to HEAD_NODE. NODE_ADDR becomes torchrun's --local-addr, the address the other
# ranks are told to reach this node at (MASTER_ADDR on the head), and selects the interface
# gloo binds to.
set -euo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'
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

IS_HOST=0
[ "$NODE_RANK" = "0" ] && IS_HOST=1
cmd=(torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
     --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$PORT" --rdzv-id "$RDZV_ID"
     --rdzv-conf "is_host=$IS_HOST")
if [ -n "${NODE_ADDR:-}" ]; then
  cmd+=(--local-addr "$NODE_ADDR")
  if [ -z "${GLOO_SOCKET_IFNAME:-}" ] && command -v ip >/dev/null; then
    # the interface that holds NODE_ADDR: gloo's own pick follows the hostname
    IFACE=$(ip -o -4 addr show | awk -v a="$NODE_ADDR" 'index($4, a "/") == 1 {print $2; exit}')
    [ -n "$IFACE" ] && export GLOO_SOCKET_IFNAME="$IFACE"
  fi
fi
cmd+=(-m asyncrl.cli.launch train "$@")

if [ "${DRY_RUN:-0}" = "1" ]; then
  [ -n "${GLOO_SOCKET_IFNAME:-}" ] && printf 'GLOO_SOCKET_IFNAME=%q ' "$GLOO_SOCKET_IFNAME"
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
