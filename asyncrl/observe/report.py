"""Run report: PNG plots, a short Markdown summary and the trajectory viewer of a run.

Owns: reading the metric rows a run writes, summarising them (held-out accuracy before and
after RL, wall time, steps per stage, final figures), drawing the plots, and the
`asyncrl report RUN_DIR` command. `train` calls `write_report` at the end of a run; the
command rebuilds the report of any run directory, finished or not.

Input: one JSON object per line, `{"kind": "rl_step" | "sft_step" | "eval" | "stage",
"stage": str, "step": int (global RL step), "time_s": float (since the start of its attempt: a
resumed run's clock starts again at 0; `run_clock` joins the attempts), ...metrics}`.
Rows or keys that are missing, malformed or non-finite are skipped (a run killed mid-write
still gets a report); a file with no usable row is a `DataError` with a clear message.

Output, under `RUN_DIR/report/`: `summary.md`, for each plot that has data a PNG, and
`viewer.html`, the trajectory viewer (`asyncrl.observe.viewer`: the plots and every saved rollout,
self-contained, opens from disk). Plots are
drawn with matplotlib's object API on the Agg canvas (no pyplot, no global backend switch).
In the step-time plot the disjoint phases (rollout, reward, update, sync) are stacked and the
tool wait — which overlaps the rollout phase — is a separate line.

Does not own: writing metrics (the run's metrics sink) or deciding what a run logs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.errors import DataError
from asyncrl.log import get_logger

log = get_logger(__name__)

Row = dict[str, Any]

# the names the train loop writes (asyncrl.train, asyncrl.observe.metrics, asyncrl.algo.roc, the
# trainers); tests/train/test_train_loop.py checks every one appears in a real rl_step row
FINAL_KEYS = (
    "reward/mean", "train/accuracy", "rollout/response_tokens_mean", "rollout/tool_calls_mean",
    "rollout/tool_error_ratio", "rollout/tool_error_ratio_pos", "roc/rollouts_kept",
    "roc/groups_trained", "train/pg_loss", "train/clip_frac", "timing/step_s",
)
FAILURE_KEYS = (
    ("rollout/failed_count", "rollouts failed (engine, environment)"),
    ("rollout/env_error_count", "of them: a text environment raised"),
    ("rollout/reward_error_count", "rewards that raised (rollout scored 0)"),
    ("rollout/reward_part_error_count", "reward parts that raised (that part scored 0)"),
    ("rollout/reward_timeout_count", "reward checks past their deadline"),
)
STACKED_TIMES = (("timing/rollout_s", "rollout"), ("timing/update_s", "update"),
                 ("timing/sync_s", "weight sync"))


@dataclass(frozen=True)
class LinePlot:
    """One PNG: each series is (row kind, metric key, legend label), plotted against `step`."""

    file: str
    title: str
    ylabel: str
    series: tuple[tuple[str, str, str], ...]
    ylim: tuple[float, float] | None = None


LINE_PLOTS = (
    LinePlot("reward.png", "Training reward (mean over rollouts)", "reward",
             (("rl_step", "reward/mean", "reward"),), (-0.02, 1.02)),
    LinePlot("eval_accuracy.png", "Held-out accuracy", "accuracy",
             (("eval", "eval/accuracy", "greedy"), ("eval", "eval/avg@*", "avg@k, sampled"),
              ("eval", "eval/maj@*", "maj@k, sampled")), (-0.02, 1.02)),
    LinePlot("tool_error_ratio.png", "Tool-error ratio", "failed calls / calls",
             (("rl_step", "rollout/tool_error_ratio_pos", "positive rollouts"),
              ("rl_step", "rollout/tool_error_ratio", "all rollouts with calls"),
              ("eval", "eval/tool_error_ratio", "eval"),
              ("eval", "eval/tool_error_ratio_correct", "eval, correct answers")),
             (-0.02, 1.02)),
    LinePlot("response_length.png", "Response length", "tokens (mean)",
             (("rl_step", "rollout/response_tokens_mean", "training rollouts"),
              ("eval", "eval/response_tokens_mean", "eval"))),
    LinePlot("tool_calls.png", "Tool calls per rollout", "calls (mean)",
             (("rl_step", "rollout/tool_calls_mean", "training rollouts"),
              ("eval", "eval/tool_calls_per_problem", "eval"))),
)


# ------------------------------------------------------------------------------- reading
def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def load_metrics(path: Path) -> list[Row]:
    """The metric rows of `path`, in file order; malformed lines and rows are skipped, and so
    are the rows a `resumed` row replaces (those written after its checkpoint by the attempt
    that crashed: the file keeps them, the report shows the history that was kept).

    Raises `DataError` when the file is missing or holds no usable row.
    """
    try:
        # split on "\n" alone: the writer counts rows by it (splitlines also splits on U+2028)
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror} (is {path.parent} a run directory?)") \
            from None
    rows: list[Row] = []
    kept_lines: list[int] = []  # the line index of each row in `rows`
    bad = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("kind"), str):
            if row["kind"] == "resumed" and isinstance(row.get("keep_rows"), int):
                # the rows a crashed attempt wrote after its checkpoint were redone: drop them
                # (a `stopped` row stays: it marks where that attempt's clock ended)
                keep = [j for j, n in enumerate(kept_lines)
                        if n < row["keep_rows"] or rows[j]["kind"] == "stopped"]
                rows = [rows[j] for j in keep]
                kept_lines = [kept_lines[j] for j in keep]
            rows.append(row)
            kept_lines.append(i)
        else:
            bad += 1
    if bad:
        log.warning("metrics_rows_skipped", path=str(path), skipped=bad)
    if not rows:
        raise DataError(f"{path} has no metric rows: the run logged nothing to report yet "
                        "(it may have stopped before its first step)")
    return rows


def series(rows: Sequence[Row], kind: str, key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over the rows of `kind` that carry a finite value for it.
    SFT rows are indexed by their order (their `step` is the RL step, constant during SFT)."""
    xs: list[float] = []
    ys: list[float] = []
    n = 0
    for r in rows:
        if r.get("kind") != kind:
            continue
        n += 1
        y = _number(r.get(key))
        x = (_number(r.get("sft_step")) or float(n)) if kind == "sft_step" else _number(
            r.get("step"))
        if y is not None and x is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


# ----------------------------------------------------------------------------- summary
@dataclass
class StageSummary:
    name: str
    kind: str = ""
    """`sft` or `rl` (from the step rows seen), empty when the stage logged no step."""
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    start_s: float | None = None
    """The stage's first row on the run clock (`run_clock`)."""
    end_s: float | None = None
    """Where the next stage starts (the last stage: the run's last row)."""


@dataclass
class Summary:
    rows: int
    wall_time_s: float | None
    before: Row | None
    """The eval row labelled `after_sft`, else the last eval before the first RL step (None
    when RL started first: an RL-only run from an exported model)."""
    after: Row | None
    """The eval row labelled `final` (else the last eval, if it is not `before`)."""
    stages: list[StageSummary] = field(default_factory=list)
    final: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Key -> (value at the last RL step, mean over the last 5 RL steps)."""
    last_rl_step: int | None = None
    evals: int = 0
    failures: dict[str, float] = field(default_factory=dict)
    """`FAILURE_KEYS` summed over the RL steps, and `rollout/count` the rollouts they cover."""


def run_clock(rows: Sequence[Row]) -> list[float | None]:
    """Each row's time on one clock for the whole run: a row's `time_s` counts from the start
    of its attempt, and a resumed attempt's clock starts again at 0, so each attempt is
    placed after the ones before it (their last row). None where a row has no time."""
    out: list[float | None] = []
    offset = last = 0.0
    for r in rows:
        if r.get("kind") == "resumed":
            offset, last = offset + last, 0.0
        t = _number(r.get("time_s"))
        if t is not None:
            last = max(last, t)
        out.append(None if t is None else offset + t)
    return out


def _before_rl(evals: Sequence[Row], rows: Sequence[Row]) -> Row | None:
    """The evaluation before RL: the one labelled `after_sft`, else the last one before the
    first RL step (a run with no RL step: the first). None when RL started before any
    evaluation (an RL-only run from an exported model): its first evaluation is not a
    "before"."""
    labelled = next((r for r in evals if r.get("label") == "after_sft"), None)
    if labelled is not None:
        return labelled
    first_rl = next((st for r in rows if r["kind"] == "rl_step"
                     and isinstance(st := r.get("step"), int) and not isinstance(st, bool)), None)
    if first_rl is None:
        return evals[0] if evals else None
    return next((r for r in reversed(evals) if isinstance(st := r.get("step"), int)
                 and not isinstance(st, bool) and st < first_rl), None)


def summarize(rows: Sequence[Row]) -> Summary:
    """Pure: the figures `summary.md` reports."""
    clock = run_clock(rows)
    times = [t for t in clock if t is not None]
    evals = [r for r in rows if r["kind"] == "eval" and _number(r.get("eval/accuracy")) is not None]
    before = _before_rl(evals, rows)
    after = next((r for r in reversed(evals) if r.get("label") == "final"), None)
    if after is None and evals and evals[-1] is not before:
        after = evals[-1]

    stages: dict[str, StageSummary] = {}
    for r, t in zip(rows, clock, strict=True):
        name = r.get("stage")
        if not isinstance(name, str) or not name:
            continue
        st = stages.setdefault(name, StageSummary(name))
        if t is not None:
            st.start_s = t if st.start_s is None else min(st.start_s, t)
            st.end_s = t if st.end_s is None else max(st.end_s, t)
        if r["kind"] in ("rl_step", "sft_step"):
            st.kind = "rl" if r["kind"] == "rl_step" else "sft"
            # SFT rows are logged every few optimizer steps and carry their own count
            sft_n = r.get("sft_step")
            st.steps = (max(st.steps, int(sft_n)) if isinstance(sft_n, int | float)
                        and r["kind"] == "sft_step" else st.steps + 1)
            step = r.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                st.first_step = step if st.first_step is None else st.first_step
                st.last_step = step

    ordered = sorted((st for st in stages.values() if st.start_s is not None),
                     key=lambda st: st.start_s or 0.0)
    for i, st in enumerate(ordered):
        nxt = ordered[i + 1] if i + 1 < len(ordered) else None
        st.end_s = nxt.start_s if nxt is not None else (max(times) if times else st.end_s)

    rl = [r for r in rows if r["kind"] == "rl_step"]
    final: dict[str, tuple[float, float]] = {}
    for key in FINAL_KEYS:
        vals = [v for r in rl if (v := _number(r.get(key))) is not None]
        if vals:
            tail = vals[-5:]
            final[key] = (vals[-1], sum(tail) / len(tail))
    last_step = rl[-1].get("step") if rl else None
    failures = {k: sum(_number(r.get(k)) or 0.0 for r in rl)
                for k in ("rollout/count", *(k for k, _ in FAILURE_KEYS))}
    return Summary(rows=len(rows), wall_time_s=max(times) if times else None, before=before,
                   after=after, stages=list(stages.values()), final=final,
                   last_rl_step=last_step if isinstance(last_step, int) else None,
                   evals=len(evals), failures=failures)


def _pct(v: Any) -> str:
    x = _number(v)
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _count(v: Any) -> str:
    x = _number(v)
    return "n/a" if x is None else f"{x:.2f}"


def _duration(s: float | None) -> str:
    if s is None:
        return "n/a"
    m, sec = divmod(round(s), 60)
    return f"{m}m {sec:02d}s" if m else f"{sec}s"


def render_markdown(s: Summary, title: str, plots: Sequence[str]) -> str:
    """Pure: the text of `summary.md`; `plots` are the PNG file names written next to it."""
    out = [f"# Run report: {title}", ""]
    b = _number(s.before.get("eval/accuracy")) if s.before else None
    a = _number(s.after.get("eval/accuracy")) if s.after else None
    evals = [r for r in (s.before, s.after) if r]
    avg = sampled_key(evals, "eval/avg@*")
    maj = sampled_key(evals, "eval/maj@*")
    if maj.endswith("*") and not avg.endswith("*"):  # no sample had an answer: maj@k n/a
        maj = avg.replace("/avg@", "/maj@")
    temps = [_number(r.get("eval/temperature")) for r in evals]
    temp = next((x for x in temps if x is not None), None)
    # sampled columns when the evals sampled (at temperature 0 they are the greedy answer again)
    sampled = not avg.endswith("*") and temp != 0.0
    cols = ["checkpoint", "step", "accuracy"]
    if sampled:
        cols += [avg.removeprefix("eval/"), maj.removeprefix("eval/"), "tool errors (correct)"]
    out += ["## Held-out accuracy", "", "| " + " | ".join(cols) + " |",
            "|" + " --- |" * len(cols)]
    for name, row in (("before RL", s.before), ("after RL", s.after)):
        label = f" (`{row['label']}`)" if row and isinstance(row.get("label"), str) else ""
        step = row.get("step", "") if row else ""
        cells = [f"{name}{label}", str(step), _pct(row.get("eval/accuracy") if row else None)]
        if sampled:
            cells += [_pct(row.get(k) if row else None)
                      for k in (avg, maj, "eval/tool_error_ratio_correct")]
        out.append("| " + " | ".join(cells) + " |")
    greedy = all(greedy_pass(r) for r in evals)
    if sampled:
        how = f" at temperature {temp:g}" if temp is not None else ""
        what = ("one greedy answer per problem" if greedy else
                f"{avg.removeprefix('eval/')} itself (no greedy pass: `eval.greedy = false`)")
        out += ["", f"`accuracy` is {what}; {avg.removeprefix('eval/')} "
                f"and {maj.removeprefix('eval/')} are over sampled answers{how}; tool errors "
                "(correct) is the failed share of the tool calls in correct sampled answers."]
    failed = [(r.get("label", r.get("step")), share) for r in evals
              if (share := max(_number(r.get("eval/failed_ratio")) or 0.0,
                               _number(r.get("eval/greedy_failed_ratio")) or 0.0)) > 0]
    for which, share in failed:
        out += ["", f"**Warning:** {100 * share:.1f}% of the rollouts of evaluation `{which}` "
                "failed (the engine or the loop, not the model; `eval/failed_ratio`): they "
                "count as wrong answers above."]
    if a is not None and b is not None:
        measure = "greedy accuracy" if greedy else f"sampled {avg.removeprefix('eval/')}"
        out += ["", f"Change: **{100 * (a - b):+.1f} points** of {measure} ({s.evals} "
                "evaluations in all)."]
    elif s.before is None and s.after is not None:
        out += ["", f"Change: n/a ({s.evals} evaluations, none before the first RL step: a run "
                "that starts RL from an exported model is compared with the evaluation of the "
                "run that made it)."]
    else:
        out += ["", f"Change: n/a ({s.evals} evaluations; need one before and one after RL)."]
    out += _level_table(s, avg if sampled else "", maj if sampled else "")
    out += _source_table(s, avg if sampled else "", maj if sampled else "")

    last = "n/a" if s.last_rl_step is None else s.last_rl_step
    out += ["", "## Run", "", f"- Wall time: {_duration(s.wall_time_s)}",
            f"- Metric rows: {s.rows}", f"- Last RL step: {last}",
            "", "| stage | kind | steps | RL steps | time |", "| --- | --- | --- | --- | --- |"]
    for st in s.stages:
        span = (f"{st.first_step}-{st.last_step}" if st.kind == "rl" and st.first_step is not None
                else "")
        t = (_duration(st.end_s - st.start_s) if st.start_s is not None and st.end_s is not None
             else "n/a")
        out.append(f"| {st.name} | {st.kind or '-'} | {st.steps} | {span} | {t} |")

    out += _failures(s)
    if s.final:
        out += ["", "## Final figures", "", "| metric | last step | mean of last 5 |",
                "| --- | --- | --- |"]
        out += [f"| `{k}` | {last:.4g} | {mean:.4g} |" for k, (last, mean) in s.final.items()]
    out += ["", "## Plots", ""]
    out += [f"![{p.removesuffix('.png')}]({p})" for p in plots] or ["(no data to plot)"]
    return "\n".join(out) + "\n"




def _failures(s: Summary) -> list[str]:
    """What went wrong over the RL steps' rollouts, summed (built-in and plugin tasks alike);
    nothing when nothing did."""
    totals = s.failures
    if not any(totals.get(k) for k, _ in FAILURE_KEYS):
        return []
    out = ["", "## Failures", "", f"Over {totals.get('rollout/count', 0):.0f} training "
           "rollouts:", "",
           "| what | rollouts |", "| --- | --- |"]
    out += [f"| {label} | {totals[k]:.0f} |" for k, label in FAILURE_KEYS]
    return out


def _level_table(s: Summary, avg: str, maj: str) -> list[str]:
    """Per level (`eval/accuracy_L{n}`, and the sampled keys' `_L{n}` forms), before -> after."""
    rows = [r for r in (s.before, s.after) if r]
    levels = sorted({int(k.removeprefix("eval/accuracy_L")) for r in rows for k in r
                     if k.startswith("eval/accuracy_L") and k[15:].isdigit()})
    return _breakdown(s, avg, maj, "level", [str(lv) for lv in levels],
                      lambda fig, lv: f"{fig}_L{lv}")


def _source_table(s: Summary, avg: str, maj: str) -> list[str]:
    """Per problem source (`eval/accuracy/<source>`, and the sampled keys' `/<source>` forms,
    with the tool calls per answer), before -> after."""
    rows = [r for r in (s.before, s.after) if r]
    names = sorted({k.removeprefix("eval/accuracy/") for r in rows for k in r
                    if k.startswith("eval/accuracy/")})
    return _breakdown(s, avg, maj, "source", names, lambda fig, name: f"{fig}/{name}",
                      counts=("eval/tool_calls_per_problem", "tool calls"),
                      shares=("eval/tool_error_ratio_correct", "tool errors (correct)"))


def _breakdown(s: Summary, avg: str, maj: str, what: str, names: Sequence[str],
               key: Callable[[str, str], str], counts: tuple[str, str] | None = None,
               shares: tuple[str, str] | None = None) -> list[str]:
    """A table of the held-out figures per `what` (a level, a source), before -> after RL:
    `key(figure, name)` is the eval row's key of `figure` for `name`; `counts` and `shares`
    (key, column) are one more column each where a row has them, shown as a number and as a
    percentage."""
    rows = [r for r in (s.before, s.after) if r]
    if not names:
        return []
    more = [(k.removeprefix("eval/"), k) for k in (avg, maj) if k]
    more += [(extra[1], extra[0]) for extra in (counts, shares) if extra]
    figs = [("accuracy", "eval/accuracy")] + [
        (label, k) for label, k in more if any(key(k, n) in r for r in rows for n in names)]

    def cell(fig: str, name: str) -> str:
        shown = _count if counts and fig == counts[0] else _pct
        return " -> ".join(shown(r.get(key(fig, name)) if r else None)
                           for r in (s.before, s.after))

    def row_name(n: str) -> str:
        return n.replace("|", "\\|")  # a markdown cell

    out = ["", f"By {what} (before RL -> after RL):", "",
           f"| {what} | " + " | ".join(label for label, _ in figs) + " |",
           "| --- |" + " --- |" * len(figs)]
    out += [f"| {row_name(n)} | " + " | ".join(cell(fig, n) for _, fig in figs) + " |"
            for n in names]
    return out


# ------------------------------------------------------------------------------- plots
def _stage_starts(rows: Sequence[Row]) -> list[tuple[float, str]]:
    """(first RL step, stage name) where the RL stage changes."""
    out: list[tuple[float, str]] = []
    current = None
    for r in rows:
        if r.get("kind") == "rl_step" and r.get("stage") != current:
            current = r.get("stage")
            step = _number(r.get("step"))
            if step is not None:
                out.append((step, str(current)))
    return out


def _new_axes(title: str, ylabel: str, xlabel: str = "RL step") -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8), dpi=100, layout="tight")
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _mark_stages(ax: Any, starts: Sequence[tuple[float, str]]) -> None:
    for x, name in starts:
        ax.axvline(x, color="grey", linestyle=":", linewidth=1, zorder=3)
        ax.annotate(name, (x, 0.98), xycoords=("data", "axes fraction"), fontsize=7,
                    color="dimgrey", rotation=90, va="top", ha="right", zorder=4,
                    bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})


def greedy_pass(row: Row) -> bool:
    """Whether an eval row's `eval/accuracy` is a greedy answer per problem: a greedy pass
    ran beside the sampled one (its `eval/greedy_tool_error_ratio` is there), the sampled
    answers were greedy themselves (temperature 0), or the row predates sampled evals.
    Otherwise (`eval.greedy = false`) it is the sampled avg@k."""
    temp = _number(row.get("eval/temperature"))
    return temp is None or temp == 0.0 or "eval/greedy_tool_error_ratio" in row


def sampled_key(rows: Sequence[Row], pattern: str) -> str:
    """`eval/avg@*` -> the run's own key (`eval/avg@8`): the k of the first eval row that has
    one (per-level keys excluded); `pattern` itself when none has, or when it has no `*`."""
    if not pattern.endswith("*"):
        return pattern
    prefix = pattern[:-1]
    for r in rows:
        if r.get("kind") == "eval":
            for key in r:
                if key.startswith(prefix) and key[len(prefix):].isdigit():
                    return key
    return pattern


def _line_plot(rows: Sequence[Row], spec: LinePlot, path: Path,
               starts: Sequence[tuple[float, str]]) -> bool:
    data = []
    greedy = all(greedy_pass(r) for r in rows if r.get("kind") == "eval")
    for kind, pattern, label in spec.series:
        key = sampled_key(rows, pattern)
        if key == "eval/accuracy" and not greedy:
            label = "accuracy (sampled: no greedy pass)"
        if key != pattern:  # "avg@k" -> "avg@8"
            label = label.replace("@k", "@" + key.rpartition("@")[2])
        data.append((label, kind, *series(rows, kind, key)))
    data = [d for d in data if d[2]]
    if not data:
        return False
    fig, ax = _new_axes(spec.title, spec.ylabel)
    for label, kind, xs, ys in data:
        style = {"marker": "o", "markersize": 4} if kind == "eval" or len(xs) < 3 else {}
        ax.plot(xs, ys, label=label, **style)
    if spec.file == "eval_accuracy.png":
        for r in rows:
            x, y = _number(r.get("step")), _number(r.get("eval/accuracy"))
            if r["kind"] == "eval" and x is not None and y is not None and r.get("label") in (
                    "after_sft", "final"):
                ax.annotate(f"{r['label']}: {100 * y:.0f}%", (x, y), textcoords="offset points",
                            xytext=(4, 6), fontsize=8)
    if spec.ylim:
        ax.set_ylim(*spec.ylim)
    _mark_stages(ax, starts)
    if len(data) > 1:
        ax.legend(fontsize=8)
    fig.savefig(path)
    return True


def _step_time_plot(rows: Sequence[Row], path: Path, starts: Sequence[tuple[float, str]]) -> bool:
    rl = [r for r in rows if r["kind"] == "rl_step" and _number(r.get("step")) is not None]
    keys = [(k, lbl) for k, lbl in STACKED_TIMES if any(_number(r.get(k)) is not None for r in rl)]
    wait_x, wait_y = series(rows, "rl_step", "timing/tool_wait_s")
    step_x, step_y = series(rows, "rl_step", "timing/step_s")
    if not keys and not wait_x and not step_x:
        return False
    fig, ax = _new_axes("Step time breakdown", "seconds")
    xs = [float(r["step"]) for r in rl]
    bottom = [0.0] * len(rl)
    for key, label in keys:
        vals = [_number(r.get(key)) or 0.0 for r in rl]
        ax.bar(xs, vals, bottom=bottom, width=0.8, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if wait_x:
        ax.plot(wait_x, wait_y, color="black", linestyle="--", label="tool wait (within rollout)")
    if step_x:
        ax.plot(step_x, step_y, color="black", label="whole step")
    _mark_stages(ax, starts)
    ax.legend(fontsize=8)
    fig.savefig(path)
    return True


def _sft_loss_plot(rows: Sequence[Row], path: Path) -> bool:
    xs, ys = series(rows, "sft_step", "sft/loss")
    if not xs:
        return False
    fig, ax = _new_axes("SFT cold start: loss", "loss (token mean)", xlabel="SFT step")
    ax.plot(xs, ys)
    fig.savefig(path)
    return True


# ------------------------------------------------------------------------------ entry
def write_report(run_dir: Path) -> Path:
    """Write `run_dir/report/` (PNGs, `summary.md`, `viewer.html`) from `run_dir/metrics.jsonl`
    and the rollouts under `run_dir/eval/` and `run_dir/rollouts/`.

    Returns the path of `summary.md`. Raises `DataError` when there are no metrics to report.
    """
    run_dir = Path(run_dir)
    rows = load_metrics(run_dir / "metrics.jsonl")
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    starts = _stage_starts(rows)
    plots = [spec.file for spec in LINE_PLOTS if _line_plot(rows, spec, out / spec.file, starts)]
    if _step_time_plot(rows, out / "step_time.png", starts):
        plots.append("step_time.png")
    if _sft_loss_plot(rows, out / "sft_loss.png"):
        plots.append("sft_loss.png")
    summary = summarize(rows)
    path = out / "summary.md"
    path.write_text(render_markdown(summary, run_dir.resolve().name, plots), encoding="utf-8")
    from asyncrl.observe.viewer import write_viewer

    write_viewer(run_dir, [out / p for p in plots])
    log.info("report_written", path=str(path), plots=len(plots), rows=summary.rows)
    return path
