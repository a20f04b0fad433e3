"""Runs on the hosts of `netns.Hosts`: an authenticated sandbox node, trainer nodes started with
`tools/launch_multinode.sh`, a micro curriculum for the Megatron trainer and its metrics.

Every process is started through `Hosts.spawn`, so the harness kills it at the end whatever
happens; logs go to files (a full pipe would stall a trainer).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from netns import Hosts

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "tools" / "launch_multinode.sh"
SANDBOX_PORT = 8123
TOKEN = "multihost-token-" + "7c" * 16


def env(**extra: str) -> dict[str, str]:
    """This worktree's code (also under `ip netns exec`), one thread, no warnings."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", **extra}


def read_line(proc: subprocess.Popen[Any], timeout: float) -> str:
    """The next line of `proc`'s stdout, or AssertionError after `timeout` seconds."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError(f"no line from {proc.args} in {timeout}s")
    return str(proc.stdout.readline())


def sandbox_node(net: Hosts, host: int, token_file: Path) -> str:
    """`asyncrl sandbox serve` on `host`'s address with a token; returns its URL once ready."""
    token_file.write_text(TOKEN + "\n")
    proc = net.spawn(host, [sys.executable, "-m", "asyncrl.cli.main", "sandbox", "serve",
                            "--host", net.addr(host), "--port", str(SANDBOX_PORT),
                            "--token-file", str(token_file), "--workers", "1",
                            "--isolation", "seccomp", "--preload", "math"],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env())
    line = read_line(proc, 60)
    assert "auth=token" in line, line
    return f"http://{net.addr(host)}:{SANDBOX_PORT}"


def launch(net: Hosts, host: int, *, nnodes: int, node_rank: int, nproc: int, config: Path,
           log: Path, args: list[str]) -> subprocess.Popen[Any]:
    """`tools/launch_multinode.sh CONFIG ARGS` on `host`, head on host 0, as documented."""
    e = env(NNODES=str(nnodes), NODE_RANK=str(node_rank), HEAD_NODE=net.addr(0),
            NODE_ADDR=net.addr(host), GPUS_PER_NODE=str(nproc), PORT="29500")
    out = log.open("w")
    return net.spawn(host, ["bash", str(LAUNCH), str(config), *args], stdout=out,
                     stderr=subprocess.STDOUT, env=e, cwd=ROOT)


def wait_all(procs: dict[str, subprocess.Popen[Any]], logs: dict[str, Path],
             timeout: float) -> dict[str, int]:
    """Exit codes once every process ended; AssertionError with the logs' tails on timeout."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs.values()):
        if time.monotonic() > deadline:
            tails = {k: logs[k].read_text()[-2000:] for k in logs}
            raise AssertionError(f"still running after {timeout}s: {tails}")
        time.sleep(0.5)
    return {k: p.returncode for k, p in procs.items()}


def micro_config(path: Path, *, model: Path, sandbox_urls: list[str], token_file: Path,
                 tensor_parallel: int = 2, rl_steps: int = 3, temperature: float = 0.0) -> Path:
    """An SFT stage and an RL stage on the Megatron trainer, tools on the remote sandbox.

    Greedy rollouts by default: sampled ones depend on how the engine's batch was composed
    (the train loop samples from the engine's one RNG), which tool-call latency changes from
    run to run; greedy ones are the same in every run, so two runs can be compared step by
    step. Tool outputs show no measured time (`rollout.tool_time = "none"`): a time differs
    from run to run and the model reads it, so runs whose rollouts call the tool repeat only
    without it."""
    urls = ", ".join(f'"{u}"' for u in sandbox_urls)
    path.write_text(f"""
[run]
name = "multihost"
seed = 3
[model]
path = "{model}"
[data]
train = "generator:tiny_math"
eval = "generator:tiny_math"
max_prompt_tokens = 256
[data.generator_options]
train_size = 64
eval_size = 4
levels = [1]
[rollout]
prompts_per_step = 3
samples_per_prompt = 4
group_size = 2
max_turns = 2
max_response_tokens = 128
tool_format = "markdown"
tool_time = "none"
temperature = {temperature}
[roc]
min_pos = 1
min_neg = 1
reject_equal_reward = false
[algorithm]
lr = 1e-3
[engine]
kv_token_budget = 8192
[trainer]
kind = "megatron"
tensor_parallel = {tensor_parallel}
micro_batch_tokens = 4096
recompute = "none"
[sandbox]
kind = "remote"
urls = [{urls}]
token_file = "{token_file}"
time_limit_s = 2.0
call_timeout_s = 10.0
[eval]
every_steps = 0
[logging]
rollouts_every = 1
[[stages]]
name = "sft"
kind = "sft"
steps = 20
batch_size = 4
[[stages]]
name = "rl"
steps = {rl_steps}
""")
    return path


def rows(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def prepare_model(out: Path) -> Path:
    """A tiny model taught the tool format by a short SFT run (torch trainer, one process),
    so that the runs under test make tool calls and get mixed rewards; returns its directory.
    `ASYNCRL_MULTIHOST_MODEL=DIR` reuses one prepared before (`DIR` = a run's `final/`)."""
    if os.environ.get("ASYNCRL_MULTIHOST_MODEL"):
        return Path(os.environ["ASYNCRL_MULTIHOST_MODEL"])
    cfg = out / "prep.toml"
    cfg.write_text("""
[run]
name = "prep"
seed = 0
[model.init]
model_type = "qwen3"
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
max_position_embeddings = 512
tie_word_embeddings = true
[tokenizer]
train_on = "task_corpus"
vocab_size = 400
[data]
train = "generator:tiny_math"
eval = "generator:tiny_math"
max_prompt_tokens = 256
[data.generator_options]
train_size = 512
eval_size = 4
levels = [1]
[rollout]
tool_format = "markdown"
[algorithm]
lr = 3e-3
warmup_steps = 20
[eval]
every_steps = 0
[sandbox]
workers = 1
[[stages]]
name = "sft"
kind = "sft"
steps = 300
batch_size = 16
""")
    run_dir = out / "prep"
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg),
                           "--run-dir", str(run_dir), "--set", "logging.console=json"],
                          env=env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir / "final"


def train(net: Hosts, host: int, config: Path, log: Path, args: list[str]) -> subprocess.Popen[Any]:
    """`asyncrl train CONFIG ARGS` in one process on `host` (a world of one)."""
    out = log.open("w")
    return net.spawn(host, [sys.executable, "-m", "asyncrl.cli.main", "train", str(config),
                            *args], stdout=out, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)


def wait_for_step(run_dir: Path, step: int, procs: list[subprocess.Popen[Any]],
                  timeout: float) -> None:
    """Block until RL step `step` is in the run's metrics (AssertionError if a process ends
    or `timeout` passes first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and any(
                r["step"] >= step for r in rows(run_dir, "rl_step")):
            return
        assert all(p.poll() is None for p in procs), "the run ended before the step"
        time.sleep(0.2)
    raise AssertionError(f"no RL step {step} after {timeout}s")


def tool_statuses(run_dir: Path, step: int) -> list[str]:
    """The status of every tool call in RL step `step`'s rollouts (`logging.rollouts_every=1`)."""
    path = run_dir / "rollouts" / f"step_{step:06d}.jsonl"
    out = []
    for line in path.read_text().splitlines():
        for rollout in json.loads(line)["rollouts"]:
            out += [str(call["status"]) for call in rollout["tool_calls"]]
    return out


def worker_pids(net: Hosts, host: int) -> list[int]:
    """Trainer worker processes (not the torchrun agent) inside `host`."""
    r = subprocess.run(["ip", "netns", "pids", net.ns(host)], capture_output=True, text=True)
    out = []
    for pid in r.stdout.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"asyncrl.cli.launch" in cmd and not any(c.endswith(b"torchrun") for c in cmd):
            out.append(int(pid))
    return out


def assert_same_steps(got: list[dict], want: list[dict]) -> None:
    """The same rows, key for key: numbers within float summation order (rel 1e-5), anything
    else (a row's `kind`) equal. `pytest.approx` only for numbers: pytest 9 refuses a relative
    tolerance on a string."""
    import pytest

    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys(), (g, w)
        for k in g:
            if isinstance(w[k], int | float) and not isinstance(w[k], bool):
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (k, g, w)
            else:
                assert g[k] == w[k], (k, g, w)
