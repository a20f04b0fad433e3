#!/usr/bin/env bash
# One task of the inference job step (tools/slurm/asyncrl.sbatch, INFERENCE_NODES > 0): one
# SGLang server per GPU of this node (tp_size 1), each on its own port, on this node's
# inter-node address; their URLs go to $INFERENCE_URL_DIR/<node>-<gpu>.url. The config's
# [engine] must be kind = "sglang" (the URLs reach engine.urls) with weight_sync "disk" (a
# shared filesystem) or "distributed". NOT RUN by this project's tests (no GPU, no SGLang
# there); the command is SGLang's documented `python -m sglang.launch_server`.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${INFERENCE_URL_DIR:?set by asyncrl.sbatch}" "${INFERENCE_MODEL:?the model path for SGLang}"
addr=$("$here/node_addr.sh")
gpus=${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
base=${INFERENCE_PORT:-30000}
pids=()
for ((g = 0; g < gpus; g++)); do
  # shellcheck disable=SC2086  # INFERENCE_ARGS is a list of options
  CUDA_VISIBLE_DEVICES=$g "${PYTHON:-python3}" -m sglang.launch_server \
    --model-path "$INFERENCE_MODEL" --host "$addr" --port $((base + g)) --tp-size 1 \
    ${INFERENCE_ARGS:-} &
  pids+=($!)
  echo "http://$addr:$((base + g))" > "$INFERENCE_URL_DIR/${SLURMD_NODENAME:-$(hostname)}-$g.url"
done
wait -n "${pids[@]}"   # one server gone: end the step (the batch script logs it)
echo "inference_node: a server on $(hostname) exited; stopping the others" >&2
kill "${pids[@]}" 2>/dev/null || true
wait
exit 1
