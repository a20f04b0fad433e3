"""The RoC ablation's statistics over seeds and its report: per arm, mean, sd, min, max and a
95% bootstrap interval of each figure (`SCALARS`); each RoC arm minus each GRPO arm, paired by
seed (the arms of a seed share the cold start); the markdown tables `bench/roc_ablation.py`
prints and writes.

Pure functions of the figures `ablation_runs.read_arm` and `read_sft` return; no file is read.
"""

from __future__ import annotations

import random
from statistics import fmean, pstdev
from typing import Any

from asyncrl.analysis.ablation_runs import sampled
from asyncrl.observe.evaluation import source_labels


def rl_gain(r: dict) -> float | None:
    """Final avg@k minus the seed's after-SFT avg@k: what RL added to the sampled policy."""
    after = r.get("after_sft") or {}
    end, start = sampled(r["final"], "avg"), sampled(after, "avg")
    return None if end is None or start is None else end - start


def stats(xs: list[float], seed: int = 0) -> dict[str, Any]:
    """Mean, population sd, min, max and a 95% bootstrap interval of the mean over seeds."""
    rng = random.Random(seed)
    boots = sorted(fmean(rng.choices(xs, k=len(xs))) for _ in range(2000))
    return {"mean": fmean(xs), "sd": pstdev(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "ci95": (boots[50], boots[1949])}


def _level(lv: int) -> Any:
    """The getter of the final greedy accuracy at level `lv`."""
    return lambda r: r["final"].get(f"accuracy_L{lv}")


SCALARS = [
    ("greedy", lambda r: r["final"]["accuracy"]),
    *((f"greedy L{lv}", _level(lv)) for lv in (1, 2, 3, 4)),
    ("avg@k", lambda r: sampled(r["final"], "avg")),
    *((f"avg@k L{lv}", lambda r, lv=lv: sampled(r["final"], "avg", lv)) for lv in (1, 2, 3, 4)),
    ("maj@k", lambda r: sampled(r["final"], "maj")),
    ("avg@k gain over SFT", rl_gain),
    ("tool-err correct (eval)", lambda r: r["final"].get("tool_error_ratio_correct")),
    ("tool-err pos (run)", lambda r: r["tool_error_pos_run"]),
    ("tool-err pos (tail)", lambda r: r["tool_error_pos_tail"]),
    ("tool-err all (run)", lambda r: r["tool_error_all_run"]),
    ("tool-err all (tail)", lambda r: r["tool_error_all_tail"]),
    ("p_err trained pos", lambda r: r["p_err_kept_pos_mean"]),
    ("resp tokens", lambda r: r["response_tokens_mean"]),
    ("RL wall s", lambda r: r["wall_s"]),
]


def summarise(results: dict[str, dict[int, dict]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per arm, `stats` of each `SCALARS` figure over the seeds that have it."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm, by_seed in results.items():
        out[arm] = {}
        for name, get in SCALARS:
            xs = [get(r) for r in by_seed.values()]
            xs = [float(x) for x in xs if x is not None]
            if xs:
                out[arm][name] = stats(xs)
    return out


HEADLINE = ["greedy", "avg@k", "avg@k gain over SFT", "maj@k", "tool-err correct (eval)",
            "tool-err pos (tail)", "p_err trained pos"]
# RoC's claim at the policy level: a RoC arm's correct answers make fewer tool errors than a
# GRPO arm's. Paired by seed (the arms of a seed share the cold start), RoC minus GRPO.
MIN_SEEDS_FOR_STAR = 3  # a one- or two-seed bootstrap interval is the seeds themselves
PAIRED = ["tool-err correct (eval)", "tool-err pos (tail)", "tool-err pos (run)", "avg@k",
          "greedy"]


def paired(results: dict[str, dict[int, dict]]) -> dict[str, dict[str, dict[str, Any]]]:
    """For each RoC arm against each GRPO arm, the per-seed differences (RoC - GRPO) of the
    `PAIRED` figures over the seeds both finished: mean, sd and a 95% bootstrap interval."""
    getters = dict(SCALARS)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for roc in (a for a in results if a.startswith("roc")):
        for grpo in (a for a in results if a.startswith("grpo")):
            common = sorted(set(results[roc]) & set(results[grpo]))
            pair: dict[str, dict[str, Any]] = {}
            for name in PAIRED:
                diffs = []
                for seed in common:
                    x, y = getters[name](results[roc][seed]), getters[name](results[grpo][seed])
                    if x is not None and y is not None:
                        diffs.append(float(x) - float(y))
                if diffs:
                    pair[name] = {**stats(diffs), "seeds": common}
            if pair:
                out[f"{roc} - {grpo}"] = pair
    return out


def _cell(name: str, st: dict[str, Any], ci: bool = False) -> str:
    if name in ("resp tokens", "RL wall s"):
        return f"{st['mean']:.0f} ± {st['sd']:.0f}"
    text = f"{st['mean']:.3f} ± {st['sd']:.3f}"
    return text + (f" [{st['ci95'][0]:.3f}, {st['ci95'][1]:.3f}]" if ci else "")


def by_problem_lines(by_problem: dict[str, dict[int, dict[str, dict[str, float]]]]
                     ) -> list[str]:
    """The table of `ablation_runs.paired_by_problem`: per pair, seed and problem source (all
    first), RoC - GRPO over the held-out problems both answered."""
    if not by_problem:
        return []
    lines = ["", "RoC against GRPO per seed, paired by held-out problem (the arms of a seed answer "
             "the same problems): avg@k of each, RoC - GRPO [95% bootstrap interval over the "
             "problems], and the failed share of the tool calls inside correct answers (calls "
             "in brackets).", "",
             "| pair | seed | source | problems | GRPO | RoC | RoC - GRPO | failed calls in "
             "correct, GRPO -> RoC |", "|---|---|---|---|---|---|---|---|"]
    for pair, by_seed in by_problem.items():
        for seed, rows in sorted(by_seed.items()):
            names = source_labels(s for s in rows if s != "all")
            for source, r in rows.items():
                name = names.get(source, source).replace("|", "\\|")
                lines.append(
                    f"| {pair} | {seed} | {name} | {r['problems']:.0f} | {r['avg_a']:.3f} | "
                    f"{r['avg_b']:.3f} | {r['diff']:+.3f} [{r['diff_lo']:+.3f}, "
                    f"{r['diff_hi']:+.3f}] | {r['tool_errors_correct_a']:.3f} "
                    f"({r['calls_correct_a']:.0f}) -> {r['tool_errors_correct_b']:.3f} "
                    f"({r['calls_correct_b']:.0f}) |")
    return lines


def markdown(summary: dict, sft: dict[int, dict], seeds: dict[str, list[int]],
             pairs: dict | None = None, results: dict | None = None,
             by_problem: dict | None = None) -> str:
    """The report: headline figures per arm, the paired RoC - GRPO differences (starred where the
    interval excludes zero over `MIN_SEEDS_FOR_STAR` or more seeds), the same per seed paired by
    problem when the arms were sampled apart (`by_problem_lines`), avg@k per seed after SFT and
    per arm, and every figure per arm."""
    lines = ["Headline figures per arm: mean ± sd over seeds [95% bootstrap interval of the "
             "mean].", "", "| arm | seeds | " + " | ".join(HEADLINE) + " |",
             "|---|---|" + "---|" * len(HEADLINE)]
    for arm, by_name in summary.items():
        cells = [_cell(n, by_name[n], ci=True) if n in by_name else "–" for n in HEADLINE]
        lines.append(f"| {arm} | {','.join(map(str, seeds[arm]))} | " + " | ".join(cells) + " |")
    if pairs:
        lines += ["", "RoC minus GRPO, paired by seed: mean ± sd [95% bootstrap interval]; "
                  f"`*` where the interval excludes zero over {MIN_SEEDS_FOR_STAR} or more seeds.", "",
                  "| pair | seeds | " + " | ".join(PAIRED) + " |", "|---|---|" + "---|" * len(PAIRED)]
        for pair, by_name in pairs.items():
            cells = []
            for n in PAIRED:
                st = by_name.get(n)
                if st is None:
                    cells.append("–")
                    continue
                lo, hi = st["ci95"]
                star = " *" if st["n"] >= MIN_SEEDS_FOR_STAR and (lo > 0 or hi < 0) else ""
                cells.append(f"{st['mean']:+.3f} ± {st['sd']:.3f} [{lo:+.3f}, {hi:+.3f}]{star}")
            some = next(iter(by_name.values()))
            lines.append(f"| {pair} | {','.join(map(str, some['seeds']))} | "
                         + " | ".join(cells) + " |")
    lines += by_problem_lines(by_problem or {})
    if results and sft:
        arms = list(results)
        lines += ["", "Per seed, avg@k after SFT (the arms' common start) and each arm's final "
                  "avg@k (greedy in brackets):", "",
                  "| seed | after SFT | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
        for seed, r in sorted(sft.items()):
            cells = []
            for arm in arms:
                run = results[arm].get(seed)
                avg = sampled(run["final"], "avg") if run else None
                cells.append("–" if run is None else
                             f"{avg:.3f} ({run['final']['accuracy']:.3f})" if avg is not None
                             else f"– ({run['final']['accuracy']:.3f})")
            start = sampled(r, "avg")
            lines.append(f"| {seed} | " + (f"{start:.3f}" if start is not None else "–")
                         + f" ({r['accuracy']:.3f}) | " + " | ".join(cells) + " |")
    names = [n for n, _ in SCALARS]
    lines += ["", "Every figure per arm: mean ± sd over seeds.", "",
              "| arm | seeds | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for arm, by_name in summary.items():
        cells = [_cell(n, by_name[n]) if n in by_name else "–" for n in names]
        lines.append(f"| {arm} | {','.join(map(str, seeds[arm]))} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
