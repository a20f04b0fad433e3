"""asyncrl.analysis.ablation_runs and .ablation_report: the stage split and its `--set`
rendering, the arms, the run-level ratios and the statistics over seeds (the runs themselves,
`bench/roc_ablation.py`, are minutes each)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from asyncrl import config
from asyncrl.algo.roc import POSITIVE_RULES, SELECT_KINDS
from asyncrl.analysis import ablation_report as report
from asyncrl.analysis import ablation_runs as runs
from asyncrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_stages_split_and_render_as_overrides_that_load_back() -> None:
    cur = ROOT / "curricula" / "evidence.toml"
    sft, rl = runs.split_stages(cur, ["stages.1.steps=7"])
    assert [s["kind"] for s in sft] == ["sft"] and all(s.get("kind", "rl") == "rl" for s in rl)
    assert rl[0]["steps"] == 7  # user overrides apply before the split
    raw = tomllib.loads(cur.read_text())
    for part in (sft, rl):
        cfg = config.from_dict(config.apply_overrides(raw, [f"stages={runs.toml_value(part)}"]))
        assert [config.to_dict(cfg)["stages"][i][k] for i, s in enumerate(part) for k in s] == [
            v for s in part for v in s.values()]
    with pytest.raises(ConfigError, match="SFT and RL"):
        runs.split_stages(ROOT / "curricula" / "tiny.toml", ["stages=[]"])


def test_every_arm_is_a_valid_selection_rule() -> None:
    raw = tomllib.loads((ROOT / "curricula" / "evidence.toml").read_text())
    seen = set()
    for sets in runs.ARMS.values():
        cfg = config.from_dict(config.apply_overrides(raw, sets))
        assert cfg.roc.kind in SELECT_KINDS and cfg.roc.positive in POSITIVE_RULES
        seen.add((cfg.roc.kind, cfg.roc.positive if cfg.roc.kind == "roc" else ""))
    assert seen == {("roc", "weighted"), ("roc", "lowest"), ("grpo_first", ""), ("grpo_all", "")}


def test_run_ratios_weigh_steps_by_their_calls() -> None:
    steps = [{"rollout/tool_calls_pos": 10.0, "rollout/tool_errors_pos": 5.0,
              "rollout/tool_calls_mean": 1.0, "rollout/count": 100.0,
              "rollout/tool_error_ratio": 0.5},
             {"rollout/tool_calls_pos": 30.0, "rollout/tool_errors_pos": 0.0,
              "rollout/tool_calls_mean": 3.0, "rollout/count": 100.0,
              "rollout/tool_error_ratio": 0.1}]
    assert runs.tool_error_ratio(steps, "pos") == pytest.approx(5 / 40)  # not the mean of 0.5 and 0
    assert runs.tool_error_ratio(steps, "all") == pytest.approx((50 + 30) / 400)
    assert runs.tool_error_ratio([], "pos") == 0.0


def test_a_resumed_arm_counts_each_step_once_and_every_attempts_time(tmp_path: Path) -> None:
    import json

    def step(n: int, t: float, err: float) -> dict:
        return {"kind": "rl_step", "step": n, "time_s": t, "reward/mean": 0.5,
                "rollout/tool_calls_pos": 10.0, "rollout/tool_errors_pos": 10.0 * err,
                "rollout/tool_calls_mean": 1.0, "rollout/count": 8.0,
                "rollout/tool_error_ratio": err, "roc/p_err_kept_pos": 0.0}

    rows = [step(1, 100.0, 0.0),
            step(2, 200.0, 1.0),  # written after the last checkpoint by an attempt that crashed
            {"kind": "resumed", "step": 1, "time_s": 20.0, "keep_rows": 1},
            step(2, 90.0, 0.5),
            {"kind": "eval", "step": 2, "time_s": 120.0, "label": "final", "eval/accuracy": 0.5},
            {"kind": "done", "step": 2, "time_s": 120.0, "wall_s": 120.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    arm = runs.read_arm(tmp_path, tail=5)
    assert arm["tool_error_pos_run"] == pytest.approx(0.25)  # steps 1 and the redone 2
    assert arm["wall_s"] == pytest.approx(100.0 + 120.0)


def test_stats_over_seeds() -> None:
    s = report.stats([0.2, 0.4, 0.6])
    assert s["mean"] == pytest.approx(0.4) and s["min"] == 0.2 and s["max"] == 0.6
    assert s["sd"] == pytest.approx((0.08 / 3) ** 0.5)
    lo, hi = s["ci95"]
    assert 0.2 <= lo <= 0.4 <= hi <= 0.6


def _arm_run(acc: float, avg: float, err_correct: float, sft_avg: float) -> dict:
    return {"final": {"accuracy": acc, "accuracy_L1": acc, "avg@8": avg, "avg@8_L1": avg,
                      "maj@8": 1.0, "pass@8": 1.0, "tool_error_ratio_correct": err_correct},
            "after_sft": {"accuracy": 0.5, "avg@8": sft_avg},
            "tool_error_pos_run": err_correct, "tool_error_pos_tail": err_correct,
            "tool_error_all_run": 0.2, "tool_error_all_tail": 0.2, "p_err_kept_pos_mean": 0.01,
            "response_tokens_mean": 60.0, "reward_mean": 0.8, "wall_s": 100.0}


def test_sampled_figures_gain_and_paired_differences_over_seeds() -> None:
    """avg@k is found whatever k the run used; RL's gain is final avg@k minus the seed's
    after-SFT avg@k; RoC - GRPO is paired by seed and starred only when its interval
    excludes zero."""
    results = {
        "roc-weighted": {s: _arm_run(1.0, 0.90 + s / 100, 0.01, 0.40) for s in range(5)},
        "grpo-all": {s: _arm_run(1.0, 0.90 + s / 100, 0.05 + s / 1000, 0.40) for s in range(5)},
    }
    assert runs.sampled(results["roc-weighted"][2]["final"], "avg") == pytest.approx(0.92)
    assert runs.sampled(results["roc-weighted"][2]["final"], "avg", 1) == pytest.approx(0.92)
    assert runs.sampled({"accuracy": 1.0}, "avg") is None  # a greedy-only run
    assert report.rl_gain(results["roc-weighted"][0]) == pytest.approx(0.50)
    pairs = report.paired(results)
    diff = pairs["roc-weighted - grpo-all"]
    assert diff["tool-err correct (eval)"]["mean"] == pytest.approx(-0.042)
    assert diff["tool-err correct (eval)"]["ci95"][1] < 0
    assert diff["avg@k"]["mean"] == pytest.approx(0.0) and diff["avg@k"]["seeds"] == [0, 1, 2, 3, 4]
    summary = report.summarise(results)
    assert summary["roc-weighted"]["avg@k gain over SFT"]["mean"] == pytest.approx(0.52)
    sft = {s: results["roc-weighted"][s]["after_sft"] for s in range(5)}
    text = report.markdown(summary, sft, {a: list(range(5)) for a in results}, pairs, results)
    row = next(line for line in text.splitlines() if line.startswith("| roc-weighted - grpo-all"))
    assert row.count(" *") == 3  # both tool-error columns and the run ratio; not avg@k or greedy
    assert "| 4 | 0.400 (0.500) | 0.940 (1.000) | 0.940 (1.000) |" in text
    two = {arm: {s: r for s, r in runs.items() if s < 2} for arm, runs in results.items()}
    text = report.markdown(report.summarise(two), sft, {a: [0, 1] for a in two}, report.paired(two),
                          two)
    row = next(line for line in text.splitlines() if line.startswith("| roc-weighted - grpo-all"))
    assert " *" not in row  # two seeds: no claim, whatever the interval says


def test_a_separate_sampled_evaluation_stands_in_for_the_runs_own_sampled_figures(
        tmp_path: Path) -> None:
    """`--eval-k`: a curriculum that evaluates greedily while it trains gets its avg@k and
    the tool errors of correct sampled answers from `<run>/eval-k{K}/eval.json`; the run's
    greedy accuracy stays, and its own k=1 figures go (one k per run, as `sampled` reads it)."""
    import json

    rows = [{"kind": "eval", "step": 0, "time_s": 5.0, "label": "after_sft",
             "eval/accuracy": 0.5, "eval/avg@1": 0.5, "eval/tool_error_ratio_correct": 0.0},
            {"kind": "done", "step": 0, "time_s": 5.0, "wall_s": 5.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # not evaluated yet: no sampled figures, never the greedy ones in their place
    assert runs.read_sft(tmp_path, eval_k=8) == {"accuracy": 0.5}
    d = runs.sampled_eval_dir(tmp_path, 8)
    d.mkdir()
    (d / "eval.json").write_text(json.dumps({
        "accuracy": 0.3, "avg@8": 0.3, "avg@8_L1": 0.3, "pass@8": 0.9, "maj@8": 0.4,
        "tool_error_ratio_correct": 0.125, "response_tokens_mean": 210.0, "seconds": 99.0,
        "rollout/count": 64.0}))
    figures = runs.read_sft(tmp_path, eval_k=8)
    assert figures == {"accuracy": 0.5, "avg@8": 0.3, "avg@8_L1": 0.3, "pass@8": 0.9,
                       "maj@8": 0.4, "tool_error_ratio_correct": 0.125,
                       "response_tokens_mean": 210.0}
    assert runs.sampled(figures, "avg") == pytest.approx(0.3)
    assert runs.read_sft(tmp_path) == {"accuracy": 0.5, "avg@1": 0.5,
                                       "tool_error_ratio_correct": 0.0}  # without --eval-k


def test_the_sampled_evaluation_command_is_one_asyncrl_eval_accepts(tmp_path: Path) -> None:
    import importlib.util

    from asyncrl.cli.main import build_parser

    spec = importlib.util.spec_from_file_location("roc_ablation", ROOT / "bench" / "roc_ablation.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cmd = bench.eval_command(tmp_path / "arm", ROOT / "curricula" / "tiny.toml",
                             ["engine.prefix_cache_tokens=32768", "run.seed=1"], 8, 1.0, 48)
    assert cmd[1:3] == ["-m", "asyncrl.cli.main"]
    args = build_parser().parse_args(cmd[3:])
    assert (args.k, args.temperature, args.greedy, args.max_problems) == (8, 1.0, False, 48)
    assert Path(args.checkpoint) == tmp_path / "arm" / "final"
    assert Path(args.out) == runs.sampled_eval_dir(tmp_path / "arm", 8)
    # the run's seed: a generator's held-out set follows it
    assert args.set == ["engine.prefix_cache_tokens=32768", "run.seed=1", "logging.console=none"]


def test_arms_sampled_apart_are_compared_per_seed_problem_by_problem(tmp_path: Path) -> None:
    """`--eval-k`: a RoC arm and a GRPO arm of one seed answered the same held-out problems, so
    the report pairs them by problem (GRPO as A); a seed one arm has not sampled is left out."""
    from asyncrl.records import Group, Problem, Rollout, ToolCall, ToolStatus, to_json

    def group(pid: str, rewards: list[float], failed: bool = False) -> Group:
        calls = [ToolCall(name="python", raw="c", status=ToolStatus.ERROR if failed
                          else ToolStatus.OK)]
        return Group(group_id=pid, problem=Problem(id=pid, question=pid, answer="1",
                                                   source="rg/gsm_symbolic"),
                     rollouts=[Rollout(rollout_id=f"{pid}{i}", prompt_id=pid, group_id=pid,
                                       policy_version=0, prompt_ids=[1], reward=w,
                                       tool_calls=calls) for i, w in enumerate(rewards)])

    def arm(name: str, seed: int, groups: list[Group]) -> Path:
        d = runs.sampled_eval_dir(tmp_path / f"{name}-seed{seed}", 8)
        d.mkdir(parents=True)
        (d / "eval_groups.jsonl").write_bytes(b"".join(to_json(g) + b"\n" for g in groups))
        return d.parent

    dirs = {"roc-weighted": {0: arm("roc-weighted", 0, [group("a", [1, 1]), group("b", [1, 0])]),
                             1: arm("roc-weighted", 1, [group("a", [1, 1])])},
            "grpo-first": {0: arm("grpo-first", 0, [group("a", [1, 0], failed=True),
                                                    group("b", [0, 0])]),
                           1: tmp_path / "grpo-first-seed1"}}  # seed 1 not sampled yet
    dirs["roc-weighted"][2] = arm("roc-weighted", 2, [group("a", [1])])
    other = group("a", [1])
    other.problem.question = "another held-out set"
    dirs["grpo-first"][2] = arm("grpo-first", 2, [other])  # does not pair: left out, not fatal
    by = runs.paired_by_problem(dirs, 8)
    assert list(by) == ["roc-weighted - grpo-first"] and list(by["roc-weighted - grpo-first"]) == [0]
    rows = by["roc-weighted - grpo-first"][0]
    assert list(rows) == ["all", "rg/gsm_symbolic"]
    assert (rows["all"]["avg_a"], rows["all"]["avg_b"], rows["all"]["diff"]) == (0.25, 0.75, 0.5)
    assert rows["all"]["tool_errors_correct_a"] == 1.0 and rows["all"]["tool_errors_correct_b"] == 0
    text = "\n".join(report.by_problem_lines(by))
    assert "| roc-weighted - grpo-first | 0 | all | 2 | 0.250 | 0.750 | +0.500 [" in text
    assert "| roc-weighted - grpo-first | 0 | gsm_symbolic | 2 |" in text
    assert "| 1.000 (1) -> 0.000 (3) |" in text
    assert report.by_problem_lines({}) == []
