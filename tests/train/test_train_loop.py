"""`asyncrl train` end to end on a micro curriculum: stages run, metrics and report are written,
a SIGKILLed run resumes with the same data order, and a dry run resolves the rstar2 recipe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from micro_config import MICRO_DATA, MICRO_ENGINE, MICRO_MODEL, metric_rows, micro_rollout

from asyncrl import config
from asyncrl.cli.plan import dry_run
from asyncrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

MICRO = """
[run]
name = "micro"
seed = 3
""" + MICRO_MODEL + MICRO_DATA + micro_rollout() + """[algorithm]
lr = 1e-3
""" + MICRO_ENGINE + """[[stages]]
name = "sft"
kind = "sft"
steps = 2
batch_size = 4
lr_decay_steps = 2
[[stages]]
name = "rl"
steps = 4
[[stages]]
name = "hard"
steps = 1
data_filter = "hard"
hard_filter_k = 2
hard_filter_problems = 4
[eval]
every_steps = 2
max_problems = 4
[checkpoint]
every_steps = 1
keep_last = 2
[logging]
console = "json"
"""


def _write_config(tmp_path: Path) -> Path:
    p = tmp_path / "micro.toml"
    p.write_text(MICRO)
    return p


def _train(cfg: Path, run_dir: Path, *extra: str, wait: bool = True) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir", str(run_dir),
         *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if wait:
        _finish(proc)
    return proc


def _finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]


def _kill_after_step_2(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL `proc` once two RL steps are logged and step 2's checkpoint exists. The tests
    start the run that goes through beside it (two cores, one torch thread each)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        rows = metric_rows(run_dir, "rl_step")
        if len(rows) >= 2 and any((run_dir / "checkpoints").glob("step_*0002")):
            break
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _assert_resumed(run_dir: Path) -> dict:
    """What only a resume can show (a restart from step 1 would reproduce the problem ids of
    every step): a `resumed` row naming the checkpoint, the first RL step after it is the one
    after the checkpoint's, no SFT step runs again, and the history the report keeps holds each
    RL step once, in order. Returns the `resumed` row."""
    from asyncrl.observe.report import load_metrics

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (at,) = [i for i, r in enumerate(lines) if r["kind"] == "resumed"]
    resumed = lines[at]
    after = lines[at + 1:]
    assert resumed["checkpoint"] == f"step_{resumed['step']:08d}" and resumed["step"] >= 1
    assert next(r["step"] for r in after if r["kind"] == "rl_step") == resumed["step"] + 1
    assert not [r for r in after if r["kind"] == "sft_step"]
    kept = [r["step"] for r in load_metrics(run_dir / "metrics.jsonl") if r["kind"] == "rl_step"]
    assert kept == [1, 2, 3, 4, 5]
    return resumed


@pytest.mark.timeout(900)
def test_micro_curriculum_runs_and_resumes_after_sigkill(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path)
    full, part = tmp_path / "full", tmp_path / "part"
    # A second run is killed with SIGKILL once step 2's checkpoint exists, then resumed.
    running = _train(cfg, full, wait=False)
    _kill_after_step_2(_train(cfg, part, wait=False), part)
    _finish(running)
    steps = metric_rows(full, "rl_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["stage"] for r in steps] == ["rl"] * 4 + ["hard"]
    assert metric_rows(full, "sft_step") and metric_rows(full, "hard_filter")
    # lr_decay_steps = 2 of 2: the last SFT step runs at half the stage's rate
    assert metric_rows(full, "sft_step")[-1]["sft/lr"] == pytest.approx(5e-4)
    evals = [(r["label"], r["step"]) for r in metric_rows(full, "eval")]
    assert evals == [("after_sft", 0), ("step", 2), ("step", 4), ("final", 5)], evals
    assert (full / "config.json").exists() and (full / "final" / "config.json").exists()
    assert (full / "report" / "summary.md").exists()
    # the report reads the names the loop really writes
    from asyncrl.observe.report import FINAL_KEYS, LINE_PLOTS, STACKED_TIMES, sampled_key
    written = {"rl_step": set().union(*steps), "eval": set().union(*metric_rows(full, "eval"))}
    # (this micro run makes no policy update, so the trainer's own train/* losses are absent)
    missing = [k for k in (*FINAL_KEYS, *(k for k, _ in STACKED_TIMES))
               if k not in written["rl_step"] and k not in ("train/pg_loss", "train/clip_frac")]
    # maj@k is left out of an evaluation in which no sample gave an answer (a 24-token micro
    # model after two SFT steps may box none): it is not a vote of 0
    no_votes = all(any(k.endswith("no_answer_ratio") and v == 1.0 for k, v in r.items())
                   for r in metric_rows(full, "eval"))
    missing += [key for p in LINE_PLOTS for kind, pattern, _ in p.series
                if (key := sampled_key(metric_rows(full, kind), pattern)) not in written[kind]
                and not (no_votes and pattern == "eval/maj@*")]
    assert not missing, missing
    # every eval: k sampled answers at the training temperature and one greedy answer, both kept
    ev = metric_rows(full, "eval")[-1]
    assert ev["eval/temperature"] == 1.0 and "eval/avg@1" in set(ev)
    assert no_votes or "eval/maj@1" in set(ev)
    assert sorted(p.name for p in (full / "eval").glob("*-final*")) == [
        f"{ev['step']:06d}-final-greedy.jsonl", f"{ev['step']:06d}-final.jsonl"]
    ckpts = sorted(p.name for p in (full / "checkpoints").iterdir() if not p.name.startswith("."))
    assert len(ckpts) == 2  # keep_last

    # the killed run: no half-written checkpoint is visible: every checkpoint dir has its meta
    for d in (part / "checkpoints").iterdir():
        if not d.name.startswith("."):
            assert (d / "meta.json").exists(), d
    # the newest checkpoint is corrupt (a disk fault): the resume falls back to the one before,
    # with a warning, never to a silent restart from step 1
    from asyncrl.checkpoint import list_checkpoints

    (older, _), (newest, newest_dir) = list_checkpoints(part)[-2:]
    (newest_dir / "state.pkl").write_bytes(b"\x80\x04 cut short")
    _train(cfg, part, "--resume")
    assert _assert_resumed(part)["step"] == older < newest
    log = (part / "log.jsonl").read_text()
    assert '"checkpoint_unreadable"' in log and newest_dir.name in log
    resumed = metric_rows(part, "rl_step")
    by_step = {}
    for r in resumed:  # a step redone after the kill is logged twice; the last one counts
        by_step[r["step"]] = r["problem_ids"]
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    assert by_step == {r["step"]: r["problem_ids"] for r in steps}

    # every checkpoint's meta.json is lost: --resume refuses (exit 1, naming them), leaving the
    # checkpoints and the history as they were, never a restart from step 1 over them
    history = (part / "metrics.jsonl").read_text()
    for d in (part / "checkpoints").iterdir():
        if not d.name.startswith("."):
            (d / "meta.json").write_text("")
    proc = _train(cfg, part, "--resume", wait=False)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1 and "refusing to restart" in out, out[-3000:]
    assert (part / "metrics.jsonl").read_text() == history


def test_dry_run_resolves_rstar2_and_names_missing_paths(tmp_path: Path) -> None:
    base = ROOT / "curricula" / "rstar2.toml"
    with pytest.raises(ConfigError, match=r"model\.path"):
        dry_run(config.load(base))
    model = tmp_path / "model"
    model.mkdir()
    train = tmp_path / "train.jsonl"
    train.write_text('{"id": "a", "question": "1+1?", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"data\.eval"):
        dry_run(config.load(base, [f'model.path="{model}"', f'data.train="{train}"']))
    ok = [f'model.path="{model}"', f'data.train="{train}"', f'data.eval="{train}"']
    with pytest.raises(ConfigError, match=r"stages\[0\]\.chat\.train"):
        dry_run(config.load(base, ok))  # the cold-start SFT stage's chat files
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "assistant", "content": "hello"}]}\n')
    cfg = config.load(base, [*ok, f'stages.0.chat.train=["{chat}"]'])
    plan = dry_run(cfg)
    text = "\n".join(plan)
    assert "stage 0 cold-start-sft: sft" in text and "chat files: 1" in text
    assert "stage1-8k" in text and "budget 8192" in text and "budget 12288" in text
    assert "filter=hard" in text and "engine: sglang; trainer: megatron" in text


def test_dry_run_of_a_recipe_for_another_machine_warns_of_its_missing_paths() -> None:
    """`asyncrl train curricula/rstar2.toml --dry-run` where its model and data are absent:
    the whole plan is printed and each missing path is a warning naming its key, exit 0;
    an unknown component still fails."""
    base = str(ROOT / "curricula" / "rstar2.toml")
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "train", base, "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "stage 3 stage3-hard-12k: rl, 40 steps, budget 12288, lr 1e-06, filter=hard(k=8)" in lines
    assert ("warning: model.path: no such directory: checkpoints/Qwen3-14B-Base "
            "(a real run needs it)") in lines
    assert sum(ln.startswith("warning: stages[0].chat.train: no such file") for ln in lines) == 3
    assert lines[-1] == "dry run: ok, with 6 path(s) missing on this machine"
    bad = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "train", base, "--dry-run",
                          "--set", 'trainer.kind="nonesuch"'],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode != 0 and "trainer.kind" in bad.stderr + bad.stdout


@pytest.mark.timeout(600)
def test_staleness_one_overlaps_rollouts_with_the_update(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path)
    run = tmp_path / "stale1"
    _train(cfg, run, "--set", "rollout.max_staleness=1")
    steps = metric_rows(run, "rl_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    # rollouts of steps 2-4 were started under the previous version: one version stale at
    # most, so none is dropped; with staleness 0 every step samples the current version
    assert all(r["roc/groups_stale"] == 0 for r in steps)
    assert all(r["roc/versions_behind_max"] <= 1 for r in steps)
    versions = [r["policy_version"] for r in steps]
    assert versions == sorted(versions)


@pytest.mark.timeout(600)
def test_a_plateau_ends_only_its_own_stage(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path)
    run = tmp_path / "plateau"
    # eval accuracy stays flat on the micro model: the rl stage plateaus at its 2nd eval; the
    # hard stage, which has its own rule, must still run its steps
    _train(cfg, run, "--set", "stages.1.plateau.patience=1", "--set",
           "stages.2.plateau.patience=1", "--set", "stages.2.steps=2")
    steps = metric_rows(run, "rl_step")
    assert [r["stage"] for r in steps][-2:] == ["hard", "hard"]
    # the hard stage's 2nd step is due an evaluation, but it is the run's last: the final
    # evaluation scores those weights, once
    evals = [(r["label"], r["step"]) for r in metric_rows(run, "eval")]
    assert evals == [("after_sft", 0), ("step", 2), ("step", 4), ("final", 6)], evals


@pytest.mark.timeout(600)
def test_a_run_that_ends_in_its_cold_start_is_evaluated_once(tmp_path: Path) -> None:
    """An ablation's shared SFT run (`stages` cut to the cold start): the stage's evaluation
    scores the exported weights; a final one on the same weights would only repeat it."""
    cfg = _write_config(tmp_path)
    run = tmp_path / "sft-only"
    _train(cfg, run, "--set", 'stages=[{name = "sft", kind = "sft", steps = 2, batch_size = 4}]')
    evals = [(r["label"], r["step"]) for r in metric_rows(run, "eval")]
    assert evals == [("after_sft", 0)], evals
    assert (run / "final" / "config.json").exists() and (run / "report" / "summary.md").exists()


@pytest.mark.timeout(900)
def test_staleness_two_lags_two_versions_and_resumes_after_sigkill_mid_step(tmp_path: Path
                                                                            ) -> None:
    # Equal-reward groups are kept so that every step updates (the micro model rarely
    # solves anything): versions move on each step and staleness becomes visible.
    cfg = _write_config(tmp_path)
    args = ("--set", "rollout.max_staleness=2", "--set", "roc.reject_equal_reward=false",
            "--set", 'algorithm.correction="decoupled"')
    full, part = tmp_path / "full", tmp_path / "part"
    # A second run is killed with SIGKILL once step 2's checkpoint exists (waves 2 and 3 are
    # under way), then resumed: the waves under way are regenerated, every step trains the
    # problems of the clean run.
    running = _train(cfg, full, *args, wait=False)
    _kill_after_step_2(_train(cfg, part, *args, wait=False), part)
    _finish(running)
    steps = metric_rows(full, "rl_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    rl = [r for r in steps if r["stage"] == "rl"]
    # waves 0-2 start together under the SFT version; step 3 trains wave 2 two updates later
    assert [r["async/wave_version_lag"] for r in rl] == [0, 1, 2, 2]
    assert max(r["async/version_lag_max"] for r in rl) == 2
    assert all(r["async/version_lag_max"] <= 2 for r in steps)
    assert any(r["async/stale_token_frac"] > 0 for r in rl)
    assert all(r["async/groups_dropped_stale"] == 0 for r in steps)
    assert all(r["async/groups_kept"] == 2 for r in steps)
    assert any(r.get("train/stale_token_frac", 0) > 0 for r in rl)  # the loss saw the lags
    assert all("train/mismatch_ratio_p50" in r and "train/corr_coef" in r for r in steps)

    from asyncrl.checkpoint import load_checkpoint

    saved = load_checkpoint(next((part / "checkpoints").glob("step_*0002")), restore_rng=False)
    assert saved["pending_problem_ids"] == [p for r in steps[2:4] for p in r["problem_ids"]]
    _train(cfg, part, *args, "--resume")
    _assert_resumed(part)
    by_step = {}
    for r in metric_rows(part, "rl_step"):  # a step redone after the kill is logged twice
        by_step[r["step"]] = r["problem_ids"]
    assert by_step == {r["step"]: r["problem_ids"] for r in steps}
    trained = [p for s in sorted(by_step) for p in by_step[s]]
    assert len(trained) == len(set(trained))  # nothing trained twice


@pytest.mark.timeout(900)
def test_a_lora_run_trains_syncs_and_exports_adapters(tmp_path: Path) -> None:
    """`trainer.lora` through `asyncrl train` (with in-flight updates): adapters from the
    start (the SFT stage trains them too), no push refused, `final/` a PEFT directory plus
    the merged model, and no base export, since the run never trained the base."""
    pytest.importorskip("peft")
    cfg = _write_config(tmp_path)
    run = tmp_path / "lora"
    _train(cfg, run, "--set", "trainer.lora.rank=4", "--set", "trainer.lora.merge_on_export=true",
           "--set", "rollout.max_staleness=1")
    assert [r["step"] for r in metric_rows(run, "rl_step")] == [1, 2, 3, 4, 5]
    events = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x]
    attached = [e for e in events if e["event"] == "lora_attached"]
    assert len(attached) == 1 and attached[0]["adapter_params"] < attached[0]["base_params"]
    assert not [e for e in events if e["event"] == "weight_sync_failed"]
    final = run / "final"
    conf = json.loads((final / "adapter_config.json").read_text())
    assert conf["r"] == 4 and (final / "adapter_model.safetensors").exists()
    assert (final / "merged" / "config.json").exists() and not (final / "base").exists()
    assert not (final / "model.safetensors").exists()
    # every HF directory of final/ loads alone: merged/ has the tokenizer (an eval of it once
    # encoded every prompt to [] and scored 0% with exit 0)
    import torch

    from asyncrl import load_policy
    from asyncrl.modeling import load_tokenizer

    assert load_tokenizer(final / "merged")("What is 12+7?")["input_ids"]
    # load_policy(RUN) of a LoRA run: the merged model with the run's format and prompt
    policy = load_policy(run)
    assert policy.path == final / "merged" and policy.tool_format.name == "markdown"
    ids = torch.tensor([policy.tokenizer.encode("What is 12+7?")])
    with torch.no_grad():
        merged_logits = policy.model(ids).logits
    # a run written before merged/ had its tokenizer: `asyncrl eval --checkpoint` of it
    # takes final/'s, and its prompts are real
    from asyncrl.modeling import TOKENIZER_FILES

    for f in (final / "merged").iterdir():
        if f.name in TOKENIZER_FILES or f.name.endswith(".jinja"):
            f.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli.main", "eval", str(cfg), "--checkpoint",
         str(final / "merged"), "--k", "1", "--max-problems", "2", "--out", str(tmp_path / "ev")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x)
            for x in (tmp_path / "ev" / "eval_groups.jsonl").read_text().splitlines()]
    assert all(r["prompt_ids"] for g in rows for r in g["rollouts"])
    # without merged/: the adapter merged over the run's base (model-init/), same model
    for f in (final / "merged").iterdir():
        f.unlink()
    (final / "merged").rmdir()
    again = load_policy(run)
    assert again.path == final and again.tool_format.name == "markdown"
    with torch.no_grad():
        assert torch.allclose(again.model(ids).logits, merged_logits, atol=1e-4)



@pytest.mark.timeout(900)
def test_refills_replace_groups_without_signal_and_resume_onto_the_same_problems(tmp_path: Path
                                                                                 ) -> None:
    """`rollout.refill_equal_reward`: each group whose samples all got one reward (nearly all
    of the micro model's) draws the next problem into its step, up to the cap; a run killed
    after step 2's checkpoint (the next wave and maybe its refills under way) resumes onto the
    problems of the run that was not killed, and no problem is trained twice."""
    cfg = _write_config(tmp_path)
    args = ("--set", "rollout.refill_equal_reward=3", "--set", "rollout.seed_requests=true")
    full, part = tmp_path / "full", tmp_path / "part"
    running = _train(cfg, full, *args, wait=False)
    _kill_after_step_2(_train(cfg, part, *args, wait=False), part)
    _finish(running)
    steps = metric_rows(full, "rl_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        assert len(r["problem_ids"]) == 2 + r["async/refilled"]
        assert r["roc/groups"] == len(r["problem_ids"])
        # a refill is drawn for each group without signal, until the cap
        assert r["async/refilled"] == min(3, r["roc/groups_equal_reward"])
        assert r["rollout/failed_frac"] == 0  # a problem twice in a wave: two group ids
    assert sum(r["async/refilled"] for r in steps) > 0
    trained = [p for r in steps if r["stage"] == "rl" for p in r["problem_ids"]]
    assert len(trained) == len(set(trained))  # (the hard stage draws from its own 4 again)

    _train(cfg, part, *args, "--resume")
    _assert_resumed(part)
    by_step = {r["step"]: r["problem_ids"] for r in metric_rows(part, "rl_step")}
    assert by_step == {r["step"]: r["problem_ids"] for r in steps}
