"""Run report: plots and summary from metrics.jsonl; tolerant of gaps; clear on empty runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from asyncrl.cli import main as cli
from asyncrl.errors import DataError
from asyncrl.observe import report

PNG = b"\x89PNG\r\n\x1a\n"


def _write(run_dir: Path, rows: list[dict], extra: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + extra
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def _rl_row(step: int, stage: str, reward: float) -> dict:
    return {
        "kind": "rl_step", "stage": stage, "step": step, "time_s": 30.0 + 10 * step,
        "reward/mean": reward, "train/accuracy": reward,
        "rollout/response_tokens_mean": 80 - step, "rollout/tool_calls_mean": 0.5 + step / 10,
        "rollout/tool_error_ratio": 0.3, "rollout/tool_error_ratio_pos": 0.1,
        "roc/rollouts_kept": 64, "roc/groups_trained": 2, "train/pg_loss": 0.01,
        "train/clip_frac": 0.02,
        "timing/rollout_s": 5.0, "timing/tool_wait_s": 1.0,
        "timing/update_s": 3.0, "timing/sync_s": 0.1, "timing/step_s": 8.4,
    }


def _full_run() -> list[dict]:
    rows: list[dict] = [{"kind": "stage", "stage": "sft", "step": 0, "time_s": 0.5}]
    rows += [{"kind": "sft_step", "stage": "sft", "step": 0, "time_s": 1.0 + i, "sft/loss": 3 - i}
             for i in range(3)]
    rows.append({"kind": "eval", "stage": "sft", "step": 0, "time_s": 20.0, "label": "after_sft",
                 "eval/accuracy": 0.25, "eval/response_tokens_mean": 30,
                 "eval/tool_calls_per_problem": 0.4, "eval/tool_error_ratio": 0.2})
    rows += [_rl_row(s, "rl-short", 0.3 + 0.05 * s) for s in range(1, 4)]
    rows.append({"kind": "eval", "stage": "rl-short", "step": 3, "time_s": 65.0, "label": "step",
                 "eval/accuracy": 0.5})
    rows += [_rl_row(s, "rl-long", 0.3 + 0.05 * s) for s in range(4, 7)]
    rows.append({"kind": "eval", "stage": "rl-long", "step": 6, "time_s": 95.5, "label": "final",
                 "eval/accuracy": 0.75, "eval/response_tokens_mean": 50,
                 "eval/tool_calls_per_problem": 1.0, "eval/tool_error_ratio": 0.05})
    return rows


def test_full_run_writes_plots_and_before_after(tmp_path: Path) -> None:
    run = _write(tmp_path / "run", _full_run())
    summary = report.write_report(run)
    assert summary == run / "report" / "summary.md"
    expected = ["reward.png", "eval_accuracy.png", "tool_error_ratio.png", "response_length.png",
                "tool_calls.png", "step_time.png", "sft_loss.png"]
    for name in expected:
        data = (run / "report" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    text = summary.read_text()
    assert "| before RL (`after_sft`) | 0 | 25.0% |" in text
    assert "| after RL (`final`) | 6 | 75.0% |" in text
    assert "+50.0 points" in text
    assert "| sft | sft | 3 |" in text
    assert "| rl-short | rl | 3 | 1-3 | 30s |" in text and "| rl-long | rl | 3 | 4-6 |" in text
    assert "Wall time: 1m 36s" in text
    # final figures: last value and mean of the last 5 RL steps
    assert "| `reward/mean` | 0.6 | 0.5 |" in text
    for name in expected:
        assert f"]({name})" in text


def test_without_labels_first_and_last_eval_are_before_and_after() -> None:
    rows = [{"kind": "eval", "step": s, "eval/accuracy": a} for s, a in [(0, 0.1), (5, 0.2),
                                                                          (9, 0.6)]]
    s = report.summarize(rows)
    assert s.before is rows[0] and s.after is rows[2]
    one = report.summarize(rows[:1])
    assert one.before is rows[0] and one.after is None
    assert "Change: n/a" in report.render_markdown(one, "x", [])


def test_an_rl_only_run_has_no_before_and_no_change_of_zero(tmp_path: Path) -> None:
    # an RL run from an exported cold start (an ablation arm): its one evaluation is the final
    # one, which is not also its "before"
    rows = [_rl_row(s, "rl", 0.5) for s in range(1, 4)]
    rows.append({"kind": "eval", "stage": "", "step": 3, "time_s": 70.0, "label": "final",
                 "eval/accuracy": 0.54})
    s = report.summarize(rows)
    assert s.before is None and s.after is rows[-1]
    text = report.write_report(_write(tmp_path / "run", rows)).read_text()
    assert "| before RL |  | n/a |" in text and "| after RL (`final`) | 3 | 54.0% |" in text
    assert "none before the first RL step" in text and "+0.0 points" not in text
    # an evaluation during RL is not "before RL" either; one before the first step is
    mid = [_rl_row(1, "rl", 0.5), {"kind": "eval", "step": 1, "eval/accuracy": 0.3},
           _rl_row(2, "rl", 0.5), {"kind": "eval", "step": 2, "eval/accuracy": 0.4}]
    assert report.summarize(mid).before is None
    first = [{"kind": "eval", "step": 0, "eval/accuracy": 0.2}, *mid]
    assert report.summarize(first).before is first[0]


def test_a_stopped_and_resumed_run_is_timed_over_all_its_attempts(tmp_path: Path) -> None:
    # each attempt's time_s starts at 0: the run took 100 + 60 s, its rl stage 90 + 30 s
    rows = [{"kind": "stage", "stage": "rl", "step": 0, "time_s": 10.0},
            {**_rl_row(1, "rl", 0.5), "time_s": 90.0},
            {"kind": "rl_step", "stage": "rl", "step": 2, "time_s": 95.0},  # after the checkpoint
            {"kind": "stopped", "stage": "rl", "step": 1, "time_s": 100.0},
            {"kind": "resumed", "step": 1, "time_s": 20.0, "keep_rows": 2},
            {"kind": "stage", "stage": "rl", "step": 1, "time_s": 20.0},
            {**_rl_row(2, "rl", 0.5), "time_s": 50.0},
            {"kind": "stage", "stage": "rl-anneal", "step": 2, "time_s": 50.0},
            {**_rl_row(3, "rl-anneal", 0.5), "time_s": 60.0}]
    # the step the stop interrupted is dropped (it is redone); the stop's time stays
    kept = report.load_metrics(_write(tmp_path / "run", rows) / "metrics.jsonl")
    assert [r["kind"] for r in kept[:3]] == ["stage", "rl_step", "stopped"]
    assert report.run_clock(kept) == [10.0, 90.0, 100.0, 120.0, 120.0, 150.0, 150.0, 160.0]
    text = report.write_report(tmp_path / "run").read_text()
    assert "Wall time: 2m 40s" in text
    assert "| rl | rl | 2 | 1-2 | 2m 20s |" in text and "| rl-anneal | rl | 1 | 3-3 | 10s |" in text


def test_missing_keys_and_bad_lines_do_not_crash(tmp_path: Path) -> None:
    rows = [
        {"kind": "rl_step", "stage": "rl", "step": 1},
        {"kind": "rl_step", "stage": "rl", "step": 2, "reward/mean": 0.5, "timing/step_s": None},
        {"kind": "rl_step", "step": "three", "reward/mean": "high"},
        {"kind": "eval"},
        {"no_kind": 1},
        [1, 2],
    ]
    run = _write(tmp_path / "run", rows, extra='{"kind": "rl_step", "step": 3, "rew')
    text = report.write_report(run).read_text()
    produced = sorted(p.name for p in (run / "report").glob("*.png"))
    assert produced == ["reward.png"]
    assert "| before RL |  | n/a |" in text and "Change: n/a" in text
    assert "| rl | rl | 2 | 1-2 |" in text


def test_empty_or_missing_metrics_is_a_clear_error(tmp_path: Path) -> None:
    run = _write(tmp_path / "empty", [], extra="\n")
    with pytest.raises(DataError, match="no metric rows"):
        report.write_report(run)
    with pytest.raises(DataError, match=r"cannot read .*metrics\.jsonl"):
        report.write_report(tmp_path / "nowhere")


def test_cli_command(tmp_path: Path, capsys) -> None:
    run = _write(tmp_path / "run", _full_run())
    assert cli.main(["report", str(run)]) == 0
    # the summary's and the viewer's paths are the command's last lines (logs may precede them)
    assert capsys.readouterr().out.strip().splitlines()[-2:] == [
        str(run / "report" / "summary.md"), str(run / "report" / "viewer.html")]
    assert (run / "report" / "viewer.html").stat().st_size > 10_000  # with the plots inline

    empty = _write(tmp_path / "empty", [])
    assert cli.main(["report", str(empty)]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "no metric rows" in err and "Traceback" not in err


def test_register_adds_the_subcommand() -> None:
    parser = argparse.ArgumentParser()
    cli._register_report(parser.add_subparsers())
    args = parser.parse_args(["report", "runs/tiny"])
    assert args.run_dir == "runs/tiny" and args.func is cli._cmd_report


def test_sampled_figures_beside_greedy_and_per_level(tmp_path: Path) -> None:
    """An eval with a sampled pass: greedy accuracy, avg@8, maj@8 and the tool errors of
    correct answers, before and after RL and per level; the accuracy plot draws all three."""
    def ev(step: int, label: str, greedy: float, avg: float, maj: float) -> dict:
        return {"kind": "eval", "stage": "rl", "step": step, "time_s": 10.0 + step,
                "label": label, "eval/temperature": 1.0, "eval/accuracy": greedy,
                "eval/avg@8": avg, "eval/maj@8": maj, "eval/tool_error_ratio_correct": 0.125,
                "eval/greedy_tool_error_ratio": 0.0, "eval/accuracy_L1": greedy, "eval/avg@8_L1": avg, "eval/maj@8_L1": maj,
                "eval/accuracy_L2": 1.0, "eval/avg@8_L2": 0.5, "eval/maj@8_L2": 0.75}

    rows = [ev(0, "after_sft", 0.25, 0.125, 0.375)]
    rows += [_rl_row(s, "rl", 0.5) for s in (1, 2)]
    rows.append(ev(2, "final", 0.75, 0.625, 0.875))
    run = _write(tmp_path / "run", rows)
    text = report.write_report(run).read_text()
    assert "| checkpoint | step | accuracy | avg@8 | maj@8 | tool errors (correct) |" in text
    assert "| before RL (`after_sft`) | 0 | 25.0% | 12.5% | 37.5% | 12.5% |" in text
    assert "| after RL (`final`) | 2 | 75.0% | 62.5% | 87.5% | 12.5% |" in text
    assert "sampled answers at temperature 1" in text
    assert "`accuracy` is one greedy answer per problem" in text
    assert "points** of greedy accuracy" in text and "Warning" not in text
    assert "| level | accuracy | avg@8 | maj@8 |" in text
    assert "| 1 | 25.0% -> 75.0% | 12.5% -> 62.5% | 37.5% -> 87.5% |" in text
    assert "| 2 | 100.0% -> 100.0% | 50.0% -> 50.0% | 75.0% -> 75.0% |" in text
    assert report.sampled_key(rows, "eval/avg@*") == "eval/avg@8"
    assert report.sampled_key(rows[1:3], "eval/avg@*") == "eval/avg@*"  # no eval row: as given
    xs, ys = report.series(rows, "eval", report.sampled_key(rows, "eval/maj@*"))
    assert (xs, ys) == ([0.0, 2.0], [0.375, 0.875])


def test_figures_per_source_before_and_after(tmp_path: Path) -> None:
    """An evaluation of problems from two sources: a table of each one's greedy accuracy,
    avg@8, maj@8 and tool calls per answer, before -> after RL."""
    def ev(step: int, label: str, gsm: float, eq: float, calls: float) -> dict:
        return {"kind": "eval", "stage": "rl", "step": step, "time_s": 10.0 + step,
                "label": label, "eval/temperature": 1.0, "eval/accuracy": (gsm + eq) / 2,
                "eval/avg@8": 0.5, "eval/maj@8": 0.5, "eval/greedy_tool_error_ratio": 0.0,
                "eval/accuracy/gsm_symbolic": gsm, "eval/avg@8/gsm_symbolic": gsm / 2,
                "eval/maj@8/gsm_symbolic": gsm, "eval/tool_calls_per_problem/gsm_symbolic": calls,
                "eval/accuracy/simple_equations": eq, "eval/avg@8/simple_equations": eq / 2,
                "eval/maj@8/simple_equations": eq,
                "eval/tool_calls_per_problem/simple_equations": 1.0,
                "eval/tool_error_ratio_correct/gsm_symbolic": 0.25,
                "eval/tool_error_ratio_correct/simple_equations": 0.0}

    rows = [ev(0, "after_sft", 0.125, 0.5, 1.75), _rl_row(1, "rl", 0.5),
            ev(1, "final", 0.25, 1.0, 1.125)]
    text = report.write_report(_write(tmp_path / "run", rows)).read_text()
    assert "By source (before RL -> after RL):" in text
    assert "| source | accuracy | avg@8 | maj@8 | tool calls | tool errors (correct) |" in text
    assert ("| gsm_symbolic | 12.5% -> 25.0% | 6.2% -> 12.5% | 12.5% -> 25.0% | 1.75 -> 1.12 "
            "| 25.0% -> 25.0% |") in text
    assert ("| simple_equations | 50.0% -> 100.0% | 25.0% -> 50.0% | 50.0% -> 100.0% "
            "| 1.00 -> 1.00 | 0.0% -> 0.0% |") in text
    assert "By level" not in text


def test_a_greedy_only_run_keeps_the_one_column_table(tmp_path: Path) -> None:
    text = report.write_report(_write(tmp_path / "run", _full_run())).read_text()
    assert "| checkpoint | step | accuracy |\n" in text and "avg@" not in text


def test_evals_sampled_at_temperature_zero_show_the_greedy_table_alone(tmp_path: Path) -> None:
    rows = [{"kind": "eval", "step": s, "label": lb, "eval/temperature": 0.0, "eval/accuracy": a,
             "eval/avg@1": a, "eval/maj@1": a, "eval/accuracy_L1": a}
            for s, lb, a in [(0, "after_sft", 0.25), (4, "final", 1.0)]]
    text = report.write_report(_write(tmp_path / "run", rows)).read_text()
    assert "| checkpoint | step | accuracy |\n" in text and "avg@1" not in text
    assert "| level | accuracy |\n" in text and "| 1 | 25.0% -> 100.0% |" in text


def test_without_a_greedy_pass_accuracy_is_never_called_greedy(tmp_path: Path) -> None:
    # eval.greedy = false: eval/accuracy is the sampled avg@k, and no greedy pass ran
    rows = [{"kind": "eval", "stage": "rl", "step": s, "time_s": 10.0 + s, "label": lb,
             "eval/temperature": 1.0, "eval/accuracy": a, "eval/avg@2": a, "eval/maj@2": a,
             "eval/failed_ratio": f}
            for s, lb, a, f in [(0, "after_sft", 0.25, 0.0), (2, "final", 0.5, 0.125)]]
    rows += [_rl_row(s, "rl", 0.5) for s in (1, 2)]
    text = report.write_report(_write(tmp_path / "run", rows)).read_text()
    assert "greedy answer" not in text and "greedy accuracy" not in text
    assert "`accuracy` is avg@2 itself (no greedy pass" in text
    assert "points** of sampled avg@2" in text
    # an eval whose rollouts partly failed says so beside the figures
    assert "12.5% of the rollouts of evaluation `final` failed" in text
    assert "evaluation `after_sft`" not in text
    assert not report.greedy_pass(rows[0])
