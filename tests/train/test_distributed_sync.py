"""`asyncrl train` with `engine.weight_sync = "distributed"`: a micro run against the SGLang
fake (its own process) forms the weight-update group at the first push, broadcasts every
step's weights over it (the server ends at the last version) and ends the group with the run.

Slow (~25 s on 2 cores: the run's model, tokenizer and sandbox pools):
`python -m pytest -m slow tests/train/test_distributed_sync.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fakes.control import FakeProcess
from micro_config import MICRO_DATA, MICRO_MODEL

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_a_run_broadcasts_each_steps_weights_over_the_group(tmp_path):
    with FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                     "--incremental-streaming-output") as fake:
        cfg = tmp_path / "run.toml"
        cfg.write_text(MICRO_MODEL + MICRO_DATA + f"""
[run]
name = "pg"
[rollout]
prompts_per_step = 2
group_size = 4
max_response_tokens = 16
tools = false
[engine]
kind = "sglang"
urls = ["{fake.url}"]
weight_sync = "distributed"
weight_bucket_mb = 1
[sandbox]
workers = 1
[roc]
reject_equal_reward = false
min_pos = 0
min_neg = 0
[eval]
every_steps = 0
[[stages]]
name = "rl"
steps = 2
""")
        run_dir = tmp_path / "run"
        p = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg),
                            "--run-dir", str(run_dir), "--set", "logging.console=json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=240,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert p.returncode == 0, p.stderr[-3000:]
        st = asyncio.run(fake.state("core.weight_version"))
    assert st["attrs"]["core.weight_version"] == "2"
    calls = st["calls"]
    assert len(calls["/init_weights_update_group"]) == 1  # formed once, kept
    assert [c["weight_version"] for c in calls["/update_weights_from_distributed"]] == ["1", "2"]
    (left,) = calls["/destroy_weights_update_group"]
    (init,) = calls["/init_weights_update_group"]
    assert left == {"group_name": init["group_name"]}
    assert re.fullmatch(r"asyncrl-[0-9a-f]{8}-1", init["group_name"])
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    pushes = [e for e in events if e.get("event") == "weight_group_push"]
    assert [(e["version"], e["failed"]) for e in pushes] == [(1, []), (2, [])]
