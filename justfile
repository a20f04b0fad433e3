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

lint:
    {{python}} -m ruff check asyncrl sandbox tests bench tools
    {{python}} -m mypy

# Benchmarks: print tables, write JSON under bench/results/.
bench:
    {{python}} bench/tool_latency.py

# The embedded default: SFT cold start + GRPO-RoC stages on a CPU in minutes.
train-tiny *ARGS:
    asyncrl train curricula/tiny.toml {{ARGS}}
