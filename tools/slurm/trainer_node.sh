#!/usr/bin/env bash
# One task of the trainer job step (tools/slurm/asyncrl.sbatch starts it with srun, one task
# per trainer node): tools/launch_multinode.sh with this node's rank and address, the head's
# address from HEAD_NODE. Arguments: CONFIG [asyncrl train args].
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${HEAD_NODE:?set by asyncrl.sbatch: the address of the head node}"
NODE_ADDR=${NODE_ADDR:-$("$here/node_addr.sh")}
export NODE_ADDR HEAD_NODE
export NNODES=${SLURM_STEP_NUM_NODES:-$SLURM_NNODES}
export NODE_RANK=$SLURM_NODEID          # 0 on the head: the step's first node
# a fresh rendezvous for every start of the job (a requeued job keeps its id)
export RDZV_ID="asyncrl-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"
echo "trainer_node: $(hostname) rank $NODE_RANK of $NNODES at $NODE_ADDR, head $HEAD_NODE" >&2
exec bash "$here/../launch_multinode.sh" "$@"
