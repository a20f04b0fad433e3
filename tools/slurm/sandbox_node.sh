#!/usr/bin/env bash
# One task of the sandbox job step (tools/slurm/asyncrl.sbatch starts it with srun, one task
# per sandbox node): `asyncrl sandbox serve` on this node's inter-node address, with the
# job's token file. Writes its URL to $SANDBOX_URL_DIR/<node>.url for the batch script.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${SANDBOX_URL_DIR:?set by asyncrl.sbatch}" "${SANDBOX_TOKEN_FILE:?set by asyncrl.sbatch}"
addr=$("$here/node_addr.sh")
port=${SANDBOX_PORT:-8123}
echo "http://$addr:$port" > "$SANDBOX_URL_DIR/${SLURMD_NODENAME:-$(hostname)}.url"
# shellcheck disable=SC2086  # SANDBOX_ARGS is a list of options
exec "${PYTHON:-python3}" -m asyncrl.cli.main sandbox serve --host "$addr" --port "$port" \
  --token-file "$SANDBOX_TOKEN_FILE" --workers "${SANDBOX_WORKERS:-$(nproc)}" ${SANDBOX_ARGS:-}
