"""Evaluation metrics over rewarded groups: avg@k, pass@k, maj@k and tool-use statistics.

Owns: the estimators and their edge cases, `summarize` (every metric of an eval pass from its
groups), the printed table and the JSON results file. Does not own: sampling the rollouts or
rewarding them (`asyncrl eval` and the train loop do that, then call `summarize`).

Definitions, per problem with n samples of which c are correct, averaged over problems. A
sample is correct by `Rollout.is_correct`: the reward's own verdict when it states one
(`RewardResult.correct`), else full credit, `reward >= 1` (so a shaping term alone, a rubric's
format part or a verifiers `weight=0.1` reward, is not a right answer). `correct_stated_ratio`
says how many samples were judged by the reward's verdict rather than by the threshold.
A sample's answer (its maj@k vote, and `no_answer_ratio`) is the reward's `answer` when it
gives one, else the final answer the format marks in the response (`formats.extract_answer`:
the last `\\boxed{}`, inside the last `<answer>` block when there is one), as a plugin reward
returning a number, a rubric or a text environment give none; `answer_from_response_ratio`
says how many were read that way.
- avg@k: c / n, the mean pass@1 over the samples (the report's "average of k samples").
- pass@k: the unbiased estimator of Chen et al. 2021, 1 - C(n-c, k) / C(n, k), computed as a
  product so it neither overflows nor loses precision for large n.
- maj@k: 1 if the most frequent answer among the first k samples is correct. Answers the
  reward judged correct are all equivalent to the ground truth, so they vote as one class;
  other answers vote by their text (whitespace removed); samples with no answer do not vote.
  Ties go to the class whose first vote came earliest in sample order. A problem where no
  sample votes counts 0; when no sample of the whole evaluation has an answer (an environment
  whose answers are not `\\boxed{}`), maj@k is not reported at all rather than read 0.
- tool_error_ratio_correct: failed / all tool calls of the *correct* samples: how clean the
  policy's own right answers are (the policy-level form of RoC's claim, which the trained-on
  positives show only after RoC's selection).

An evaluation in training runs two passes over the same problems (`with_greedy`): k samples at
the training temperature (avg@k, maj@k, pass@k, per level too) and one greedy answer
(`accuracy`, `accuracy_L{n}`, `accuracy/<source>`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from asyncrl.errors import EngineError, RewardError
from asyncrl.formats import extract_answer
from asyncrl.records import Group, Rollout, RolloutStatus
from asyncrl.tasks.rewards.math import plain_number


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct)
    is correct: 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass@k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


_CORRECT = object()
"""The vote key shared by every correct sample."""


def _vote_key(answer: str, correct: bool) -> object:
    """Correct answers vote as one class (the reward's equivalence); a wrong one by its exact
    value when it is a plain number (`1/2`, `0.5` and `\\frac{1}{2}` are one vote, as they
    would be if right), else by its text without whitespace."""
    if correct:
        return _CORRECT
    value = plain_number(answer)
    return ("number", value) if value is not None else "".join(answer.split())


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool]) -> float:
    """1.0 if the majority answer among `answers` is correct, else 0.0 (0.0 if none answered).

    `correct[i]` is the reward's verdict on `answers[i]`. Ties go to the answer class whose
    first sample comes earliest.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj@k: {len(answers)} answers but {len(correct)} verdicts")
    votes: dict[object, int] = {}  # insertion order = order of first vote
    for ans, ok in zip(answers, correct, strict=True):
        if ans is None or not ans.strip():
            continue
        key = _vote_key(ans, ok)
        votes[key] = votes.get(key, 0) + 1
    if not votes:
        return 0.0
    best = max(votes.values())
    winner = next(key for key, n in votes.items() if n == best)  # earliest among the tied
    return 1.0 if winner is _CORRECT else 0.0


def final_answer(r: Rollout) -> str | None:
    """The sample's answer: the reward's, else the one the format marks in the response."""
    return r.answer if r.answer is not None else extract_answer(r.response_text)


def all_failed(groups: Sequence[Group]) -> str | None:
    """The first rollout's error when every rollout of `groups` failed (status `failed`: the
    engine or the loop, never the model), else None. Such a batch holds no answer at all: a
    run that went on would report 0% as if the model had answered wrong."""
    rollouts = [r for g in groups for r in g.rollouts]
    if rollouts and all(r.status == RolloutStatus.FAILED for r in rollouts):
        return rollouts[0].error or "no error recorded"
    return None


SCORING_FAILED = ("reward_error", "reward_timeout")
"""`Rollout.reward_status` values that mean the reward (or the environment step it ran)
failed as a whole: no score of the model's answer exists."""


def none_scored(groups: Sequence[Group]) -> str | None:
    """The first failure when no rollout of `groups` was scored (each one failed, or its
    reward raised or timed out as a whole), else None. A reward or environment that fails on
    every rollout trains on nothing and reports 0% as the model's: a run must stop instead.
    A reward part that raised while the others counted (`reward_errors` with status `ok`)
    is a score."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts or not all(r.status == RolloutStatus.FAILED
                               or r.reward_status in SCORING_FAILED for r in rollouts):
        return None
    r = rollouts[0]
    if r.status == RolloutStatus.FAILED:
        return r.error or "no error recorded"
    return f"{r.reward_status}: {r.reward_errors[0] if r.reward_errors else 'no error recorded'}"


def some_answered(groups: list[Group], what: str) -> list[Group]:
    """`groups`, unless every rollout in them failed (`all_failed`): then `EngineError`; or
    unless none was scored (`none_scored`: the reward or the environment failed on each):
    then `RewardError`. Either way a run stops (exit 1) rather than train on nothing and
    report 0% as the model's."""
    if (error := all_failed(groups)) is not None:
        raise EngineError(f"every rollout of {what} failed, so the run stops rather than "
                          f"report it as wrong answers; the first error: {error}")
    if (error := none_scored(groups)) is not None:
        raise RewardError(f"the reward (or the environment) failed on every rollout of "
                          f"{what}, so the run stops rather than train on nothing; the first "
                          f"failure: {error}")
    return groups


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(groups: Sequence[Group], k: int) -> dict[str, float]:
    """Every eval metric from rewarded groups (one per problem, all its samples in `rollouts`).

    Each group needs at least k rollouts; failed or truncated rollouts count as samples (with
    the reward they were given). pass@k and avg@k use all n samples of a group; maj@k uses the
    first k. Keys: problems, samples, k, accuracy (= avg@k), avg@K, pass@K, maj@K (absent when
    no sample has an answer), response_tokens_mean, tool_calls_per_problem (mean calls per
    sample), tool_error_ratio (failed / all calls), tool_error_ratio_correct (the same over
    correct samples), no_answer_ratio, answer_from_response_ratio and correct_stated_ratio
    (which rule gave the answers and the verdicts: module docstring), truncated_ratio,
    failed_ratio (rollouts that failed in the engine or the loop, not in the model: they count
    as wrong answers, and this says how many of the wrong ones are no answer of the model's at
    all); then, when problems carry a difficulty (a generator's level), per level n:
    `accuracy_L{n}` = avg@k over its problems and, for k > 1, `avg@K_L{n}` (the same) and
    `maj@K_L{n}`; then, when the problems come from more than one `Problem.source`, per source
    (`source_labels`: `gsm_symbolic` for `reasoning_gym/gsm_symbolic`): `accuracy/<source>`,
    for k > 1 `avg@K/<source>` and `maj@K/<source>`, `tool_calls_per_problem/<source>` and
    `tool_error_ratio_correct/<source>`.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not groups:
        raise ValueError("no groups to summarize")
    avg, pass_k, maj = [], [], []
    for g in groups:
        rs = g.rollouts
        if len(rs) < k:
            raise ValueError(f"group {g.group_id} (problem {g.problem.id}) has {len(rs)} "
                             f"samples, fewer than k={k}")
        ok = [r.is_correct for r in rs]
        avg.append(sum(ok) / len(rs))
        pass_k.append(pass_at_k(len(rs), sum(ok), k))
        maj.append(maj_at_k([final_answer(r) for r in rs[:k]], ok[:k]))
    rollouts = [r for g in groups for r in g.rollouts]
    answers = [final_answer(r) for r in rollouts]
    voted = any(a is not None and a.strip() for a in answers)
    calls = sum(len(r.tool_calls) for r in rollouts)
    failed = sum(c.failed for r in rollouts for c in r.tool_calls)
    accuracy = _mean(avg)
    by_level: dict[int, list[tuple[float, float]]] = {}
    for g, a, m in zip(groups, avg, maj, strict=True):
        if g.problem.difficulty is not None:
            by_level.setdefault(int(g.problem.difficulty), []).append((a, m))
    levels: dict[str, float] = {}
    for lv, xs in sorted(by_level.items()):
        levels[f"accuracy_L{lv}"] = _mean([a for a, _ in xs])
        if k > 1:
            levels[f"avg@{k}_L{lv}"] = _mean([a for a, _ in xs])
            if voted:
                levels[f"maj@{k}_L{lv}"] = _mean([m for _, m in xs])
    by_source: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        if g.problem.source:
            by_source.setdefault(g.problem.source, []).append(i)
    sources: dict[str, float] = {}
    # per source when there are two or more (problems without one count in the totals only)
    if len(by_source) > 1:
        labels = source_labels(by_source)
        for src in sorted(by_source, key=labels.__getitem__):
            idx, name = by_source[src], labels[src]
            sources[f"accuracy/{name}"] = _mean([avg[i] for i in idx])
            if k > 1:
                sources[f"avg@{k}/{name}"] = sources[f"accuracy/{name}"]
                if voted:
                    sources[f"maj@{k}/{name}"] = _mean([maj[i] for i in idx])
            rs = [r for i in idx for r in groups[i].rollouts]
            sources[f"tool_calls_per_problem/{name}"] = sum(len(r.tool_calls) for r in rs) / len(rs)
            sources[f"tool_error_ratio_correct/{name}"] = _failed_in_correct(rs)
    return {
        "problems": float(len(groups)),
        "samples": float(len(rollouts)),
        "k": float(k),
        "accuracy": accuracy,
        f"avg@{k}": accuracy,
        f"pass@{k}": _mean(pass_k),
        **({f"maj@{k}": _mean(maj)} if voted else {}),
        "response_tokens_mean": _mean([float(r.num_response_tokens) for r in rollouts]),
        "tool_calls_per_problem": calls / len(rollouts),
        "tool_error_ratio": failed / calls if calls else 0.0,
        "tool_error_ratio_correct": _failed_in_correct(rollouts),
        "no_answer_ratio": _mean([float(a is None) for a in answers]),
        "answer_from_response_ratio": _mean([float(r.answer is None and a is not None)
                                             for r, a in zip(rollouts, answers, strict=True)]),
        "correct_stated_ratio": _mean([float(r.correct is not None) for r in rollouts]),
        "truncated_ratio": _mean([float(r.status == RolloutStatus.TRUNCATED) for r in rollouts]),
        "failed_ratio": _mean([float(r.status == RolloutStatus.FAILED) for r in rollouts]),
        **levels,
        **sources,
    }


def _failed_in_correct(rollouts: Sequence[Rollout]) -> float:
    """Failed / all tool calls of the correct ones of `rollouts` (0 when they made none)."""
    calls = [c for r in rollouts if r.is_correct for c in r.tool_calls]
    return sum(c.failed for c in calls) / len(calls) if calls else 0.0


def source_labels(sources: Iterable[str]) -> dict[str, str]:
    """A short name per problem source for the per-source keys: its last part
    (`reasoning_gym/gsm_symbolic` -> `gsm_symbolic`) unless another source ends the same or
    it is empty (`x/`), then the whole name."""
    names = sorted(set(sources))
    last = [n.rsplit("/", 1)[-1] for n in names]
    return {n: tail if tail and last.count(tail) == 1 else n
            for n, tail in zip(names, last, strict=True)}


def with_greedy(sampled: dict[str, float], greedy: dict[str, float]) -> dict[str, float]:
    """One evaluation's figures from its two passes over the same problems: the sampled pass's
    (avg@k, maj@k, pass@k and their per-level forms, tool use, lengths), with `accuracy` and
    `accuracy_L{n}` and `accuracy/<source>` taken from the greedy pass
    (`summarize(greedy_groups, 1)`), and the greedy pass's tool-error ratio and failed share as
    `greedy_tool_error_ratio` and `greedy_failed_ratio`."""
    out = {key: v for key, v in sampled.items() if not key.startswith("accuracy")}
    out["accuracy"] = greedy["accuracy"]
    out.update({key: v for key, v in greedy.items() if key.startswith(("accuracy_L", "accuracy/"))})
    out["greedy_tool_error_ratio"] = greedy["tool_error_ratio"]
    out["greedy_failed_ratio"] = greedy["failed_ratio"]
    return out


_COUNTS = {"problems", "samples", "k"}


def format_table(summary: dict[str, float], title: str = "eval") -> str:
    """A two-column text table of a summary, in its key order."""
    width = max([len(title), *(len(key) for key in summary)])
    lines = [f"{title:<{width}}  {'value':>10}", f"{'-' * width}  {'-' * 10}"]
    for key, value in summary.items():
        shown = f"{int(value):d}" if key in _COUNTS else (
            f"{value:.1f}" if key == "response_tokens_mean" else f"{value:.4f}")
        lines.append(f"{key:<{width}}  {shown:>10}")
    return "\n".join(lines)


def write_summary(summary: dict[str, float], path: str | Path) -> Path:
    """Write the summary as a JSON object (keys in order) and return the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return p
