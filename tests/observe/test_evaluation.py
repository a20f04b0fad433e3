"""Eval metrics: the pass@k estimator, maj@k voting and ties, and `summarize` over groups."""

from __future__ import annotations

import json
import math
import random
from itertools import combinations
from pathlib import Path

import pytest

from asyncrl.observe.evaluation import (
    all_failed,
    format_table,
    maj_at_k,
    pass_at_k,
    summarize,
    with_greedy,
    write_summary,
)
from asyncrl.records import Group, Problem, Rollout, RolloutStatus, ToolCall, ToolStatus


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (10, 0, 1, 0.0),
    (10, 10, 5, 1.0),
    (10, 3, 1, 0.3),                       # pass@1 = c / n
    (4, 1, 2, 0.5),                        # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),                        # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 0.9),                        # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, 1.0),                        # n - c < k: every draw of 4 hits a correct one
    (16, 1, 16, 1.0),
    (16, 1, 8, 0.5),
])
def test_pass_at_k_hand_computed(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_enumeration_and_stays_stable() -> None:
    # brute force over all k-subsets of a small sample
    samples = [1, 0, 0, 1, 0, 0, 0]
    for k in range(1, len(samples) + 1):
        subsets = list(combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(len(samples), sum(samples), k) == pytest.approx(brute, abs=1e-12)
    # large n: the comb ratio would overflow floats; the product form does not
    exact = 1 - math.comb(9000, 100) / math.comb(10000, 100)
    assert pass_at_k(10000, 1000, 100) == pytest.approx(exact, rel=1e-9)
    assert 0.0 < pass_at_k(2000, 1, 1) < 1e-3


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_impossible_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_maj_at_k_majority_and_correct_answers_vote_together() -> None:
    assert maj_at_k(["3", "5", "5", "3", "5"], [False, True, True, False, True]) == 1.0
    assert maj_at_k(["3", "5", "3 ", "3"], [False, True, False, False]) == 0.0  # "3 " is "3"
    # "1/2" and "\frac{1}{2}" were both judged correct: they vote as one class of 2 against "7"
    assert maj_at_k(["7", "1/2", "\\frac{1}{2}"], [False, True, True]) == 1.0
    # no answer does not vote
    assert maj_at_k([None, None, "4"], [False, False, True]) == 1.0
    assert maj_at_k([None, None], [False, False]) == 0.0


def test_maj_at_k_wrong_answers_in_different_notations_vote_together() -> None:
    # three wrong samples of one value in three notations outvote one right answer seen first
    assert maj_at_k(["1/3", "1/2", "0.5", "\\frac{1}{2}"], [True, False, False, False]) == 0.0
    assert maj_at_k(["1/2", "1/3", "0.5", "\\frac{1}{2}"], [False, True, False, False]) == 0.0
    # a tie of 2 and 2: "1,000" and "1000" are one vote, and it came first
    assert maj_at_k(["1,000", "7", "1000", "7"], [False, True, False, True]) == 0.0


def test_maj_at_k_ties_go_to_the_earliest_answer() -> None:
    assert maj_at_k(["8", "9", "9", "8"], [True, False, False, True]) == 1.0
    assert maj_at_k(["9", "8", "8", "9"], [False, True, True, False]) == 0.0
    assert maj_at_k(["2", "3", "4"], [False, True, False]) == 0.0  # three-way tie: "2" first
    with pytest.raises(ValueError, match="verdicts"):
        maj_at_k(["1"], [True, False])


def _rollout(i: int, answer: str | None, reward: float, tokens: int = 10,
             calls: tuple[ToolStatus, ...] = (), status: RolloutStatus = RolloutStatus.COMPLETED
             ) -> Rollout:
    return Rollout(rollout_id=f"r{i}", prompt_id="p", group_id="g", policy_version=0,
                   prompt_ids=[1], response_ids=[0] * tokens, loss_mask=[1] * tokens,
                   logprobs=[0.0] * tokens, answer=answer, reward=reward, status=status,
                   tool_calls=[ToolCall(name="python", status=s) for s in calls])


def _group(gid: str, rollouts: list[Rollout]) -> Group:
    return Group(group_id=gid, problem=Problem(id=gid, question="q", answer="5"),
                 rollouts=rollouts)


def test_summarize_hand_computed() -> None:
    ok, err = ToolStatus.OK, ToolStatus.ERROR
    g1 = _group("a", [_rollout(0, "5", 1.0, 10, (ok,)), _rollout(1, "4", 0.0, 20, (ok, err)),
                      _rollout(2, "5", 1.0, 30), _rollout(3, None, 0.0, 40, (),
                                                          RolloutStatus.TRUNCATED)])
    g2 = _group("b", [_rollout(4, "1", 0.0, 10, (err,)), _rollout(5, "2", 0.0, 10),
                      _rollout(6, "1", 0.0, 10), _rollout(7, "3", 0.0, 10)])
    s = summarize([g1, g2], k=2)
    assert s["problems"] == 2 and s["samples"] == 8 and s["k"] == 2
    assert s["avg@2"] == pytest.approx((2 / 4 + 0) / 2) == s["accuracy"]
    assert s["pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + 0) / 2)  # (5/6 + 0) / 2
    assert s["pass@2"] == pytest.approx(5 / 12)
    assert s["maj@2"] == pytest.approx((1 + 0) / 2)  # g1 first two: "5" vs "4" tie -> "5"
    assert s["response_tokens_mean"] == pytest.approx((100 + 40) / 8)
    assert s["tool_calls_per_problem"] == pytest.approx(4 / 8)
    assert s["tool_error_ratio"] == pytest.approx(2 / 4)
    assert s["no_answer_ratio"] == pytest.approx(1 / 8)
    assert s["truncated_ratio"] == pytest.approx(1 / 8)


def test_summarize_counts_failed_rollouts_apart_from_wrong_answers() -> None:
    failed = RolloutStatus.FAILED
    g = _group("a", [_rollout(0, "5", 1.0), _rollout(1, None, 0.0, 0, (), failed),
                     _rollout(2, "4", 0.0), _rollout(3, None, 0.0, 0, (), failed)])
    s = summarize([g], k=2)
    assert s["failed_ratio"] == 0.5 and s["accuracy"] == 0.25
    assert with_greedy(s, summarize([g], k=1))["greedy_failed_ratio"] == 0.5
    assert all_failed([g]) is None
    down = Rollout(rollout_id="r9", prompt_id="p", group_id="g", policy_version=0,
                   prompt_ids=[1], response_ids=[], loss_mask=[], logprobs=[], status=failed,
                   error="engine: request needs 156 KV tokens")
    assert all_failed([_group("b", [down, down])]) == "engine: request needs 156 KV tokens"
    assert all_failed([]) is None


def test_summarize_needs_k_samples_per_group() -> None:
    with pytest.raises(ValueError, match="fewer than k=3"):
        summarize([_group("a", [_rollout(0, "5", 1.0), _rollout(1, "5", 1.0)])], k=3)
    with pytest.raises(ValueError, match="no groups"):
        summarize([], k=1)


def test_table_and_json(tmp_path: Path) -> None:
    s = summarize([_group("a", [_rollout(0, "5", 1.0), _rollout(1, "4", 0.0)])], k=2)
    table = format_table(s)
    assert "pass@2" in table and "0.5000" in table and "problems" in table
    path = write_summary(s, tmp_path / "eval" / "results.json")
    assert json.loads(path.read_text()) == s


def test_summarize_reports_accuracy_per_level() -> None:
    def g(gid: str, level: float | None, rewards: list[float]) -> Group:
        return Group(group_id=gid, problem=Problem(id=gid, question="q", answer="5",
                                                   difficulty=level),
                     rollouts=[_rollout(i, "5", r) for i, r in enumerate(rewards)])

    s = summarize([g("a", 1.0, [1, 1]), g("b", 1.0, [0, 1]), g("c", 4.0, [0, 0]),
                   g("d", None, [1, 1])], k=2)
    assert s["accuracy_L1"] == pytest.approx(0.75)
    assert s["accuracy_L4"] == 0.0
    assert not any(k.startswith("accuracy_L") and k[-1] not in "14" for k in s)
    assert "accuracy_L1" not in summarize([g("d", None, [1, 1])], k=2)


def _level_group(gid: str, level: float | None, answers: list[tuple[str, float]],
                 calls: tuple[ToolStatus, ...] = ()) -> Group:
    return Group(group_id=gid, problem=Problem(id=gid, question="q", answer="5",
                                               difficulty=level),
                 rollouts=[_rollout(i, a, r, calls=calls) for i, (a, r) in enumerate(answers)])


def test_sampled_figures_per_level_and_the_tool_errors_of_correct_answers() -> None:
    ok, err = ToolStatus.OK, ToolStatus.ERROR
    a = _level_group("a", 1.0, [("5", 1), ("4", 0), ("5", 1), ("4", 0)])     # avg .5, maj 1
    b = _level_group("b", 1.0, [("4", 0), ("4", 0), ("5", 1), ("4", 0)])     # avg .25, maj 0
    c = _level_group("c", 2.0, [("5", 1), ("5", 1), ("5", 1), ("3", 0)])     # avg .75, maj 1
    c.rollouts[0].tool_calls[:] = [ToolCall(name="python", status=err),
                                   ToolCall(name="python", status=ok)]
    c.rollouts[3].tool_calls[:] = [ToolCall(name="python", status=err)] * 3  # a wrong answer's
    s = summarize([a, b, c], k=4)
    assert s["avg@4_L1"] == pytest.approx(0.375) == s["accuracy_L1"]
    assert s["maj@4_L1"] == pytest.approx(0.5)
    assert s["avg@4_L2"] == pytest.approx(0.75) and s["maj@4_L2"] == 1.0
    assert s["tool_error_ratio_correct"] == pytest.approx(1 / 2)   # 1 of the 2 calls of right ones
    assert s["tool_error_ratio"] == pytest.approx(4 / 5)
    assert "avg@1_L1" not in summarize([a], k=1)   # k = 1: accuracy_L1 alone


def test_with_greedy_takes_accuracy_from_the_greedy_pass_and_the_rest_from_the_samples() -> None:
    sampled = summarize([_level_group("a", 1.0, [("5", 1), ("4", 0), ("4", 0), ("4", 0)]),
                         _level_group("b", 2.0, [("5", 1), ("5", 1), ("5", 1), ("5", 1)])], k=4)
    greedy = summarize([_level_group("a", 1.0, [("5", 1)], (ToolStatus.ERROR,)),
                        _level_group("b", 2.0, [("4", 0)])], k=1)
    m = with_greedy(sampled, greedy)
    assert m["accuracy"] == 0.5 and m["accuracy_L1"] == 1.0 and m["accuracy_L2"] == 0.0
    assert m["avg@4"] == pytest.approx(0.625) and m["avg@4_L1"] == pytest.approx(0.25)
    assert m["maj@4_L1"] == 0.0 and m["maj@4_L2"] == 1.0
    assert m["greedy_tool_error_ratio"] == 1.0 and m["tool_error_ratio"] == 0.0


def _source_group(gid: str, source: str, answers: list[tuple[str, float]],
                  calls: tuple[ToolStatus, ...] = ()) -> Group:
    return Group(group_id=gid, problem=Problem(id=gid, question="q", answer="5", source=source),
                 rollouts=[_rollout(i, a, r, calls=calls) for i, (a, r) in enumerate(answers)])


def test_figures_per_source_when_the_problems_come_from_several() -> None:
    ok, err = ToolStatus.OK, ToolStatus.ERROR
    a = _source_group("a", "rg/gsm_symbolic", [("5", 1), ("4", 0), ("4", 0), ("4", 0)], (ok,))
    b = _source_group("b", "rg/gsm_symbolic", [("5", 1), ("5", 1), ("3", 0), ("3", 0)],
                      (ok, err))
    c = _source_group("c", "rg/simple_equations", [("5", 1)] * 4)
    d = _source_group("d", "", [("4", 0)] * 4)  # no source: in the totals, in no source's
    s = summarize([a, b, c, d], k=4)
    assert s["accuracy/gsm_symbolic"] == pytest.approx(0.375) == s["avg@4/gsm_symbolic"]
    assert s["maj@4/gsm_symbolic"] == pytest.approx(0.5)   # a: 4 wins 3-1; b: tie, 5 first
    assert s["accuracy/simple_equations"] == 1.0 == s["maj@4/simple_equations"]
    assert s["tool_calls_per_problem/gsm_symbolic"] == pytest.approx(12 / 8)
    assert s["tool_calls_per_problem/simple_equations"] == 0.0
    # the correct answers' calls: a's one (ok), b's two twice (one failed each): 2 of 5
    assert s["tool_error_ratio_correct/gsm_symbolic"] == pytest.approx(2 / 5)
    assert s["tool_error_ratio_correct/simple_equations"] == 0.0
    assert not any(k.endswith("/") for k in s)
    assert not any("/" in k for k in summarize([a, b, d], k=4))  # one source: the totals say it
    g1 = summarize([_source_group("a", "rg/gsm_symbolic", [("5", 1)])] * 1
                   + [_source_group("c", "rg/simple_equations", [("4", 0)])], k=1)
    assert "avg@1/gsm_symbolic" not in g1 and g1["accuracy/gsm_symbolic"] == 1.0
    m = with_greedy(s, g1)  # the greedy pass's accuracy per source, the samples' rest
    assert m["accuracy/gsm_symbolic"] == 1.0 and m["accuracy/simple_equations"] == 0.0
    assert m["avg@4/gsm_symbolic"] == pytest.approx(0.375)


def test_a_source_is_named_by_its_last_part_unless_two_end_the_same() -> None:
    from asyncrl.observe.evaluation import source_labels

    assert source_labels(["reasoning_gym/gsm_symbolic", "mine"]) == {
        "reasoning_gym/gsm_symbolic": "gsm_symbolic", "mine": "mine"}
    assert source_labels(["a/add", "b/add", "b/mul"]) == {"a/add": "a/add", "b/add": "b/add",
                                                         "b/mul": "mul"}
    assert source_labels(["x/", "y"]) == {"x/": "x/", "y": "y"}  # never an empty name


def test_a_run_stops_when_every_rollout_of_a_batch_failed() -> None:
    from asyncrl.errors import EngineError
    from asyncrl.observe.evaluation import some_answered

    down = _rollout(0, None, 0.0, 0, (), RolloutStatus.FAILED)
    down = Rollout(**{**{f: getattr(down, f) for f in Rollout.__struct_fields__},
                      "error": "engine: local-0: request needs 156 KV tokens"})
    one_ok = [_group("a", [down, _rollout(1, "4", 0.0)])]
    assert some_answered(one_ok, "RL step 3") is one_ok
    with pytest.raises(EngineError, match=r"every rollout of RL step 3 failed.*156 KV tokens"):
        some_answered([_group("a", [down, down])], "RL step 3")


def test_a_run_stops_when_no_rollout_of_a_batch_was_scored() -> None:
    """Issue 54 M3: a reward plugin (or a text environment stepped at reward time) that
    raised on every rollout trained 3 steps on nothing and exited 0."""
    from asyncrl.errors import RewardError
    from asyncrl.observe.evaluation import none_scored, some_answered

    def scored(i: int, status: str, errors: list[str]) -> Rollout:
        r = _rollout(i, None, 0.0)
        return Rollout(**{**{f: getattr(r, f) for f in Rollout.__struct_fields__},
                          "reward_status": status, "reward_errors": errors})

    bad = scored(0, "reward_error", ["KeyError(\"gold answer column 'solution' not found\")"])
    slow = scored(1, "reward_timeout", [])
    part = scored(2, "ok", ["broken: ValueError: bug"])  # one part raised; the rest counted
    assert none_scored([_group("a", [bad, part])]) is None
    some_answered([_group("a", [bad, part])], "RL step 1")
    assert none_scored([_group("a", [slow, bad])]) == "reward_timeout: no error recorded"
    with pytest.raises(RewardError, match=r"failed on every rollout of RL step 1.*"
                                          r"reward_error: KeyError"):
        some_answered([_group("a", [bad, slow])], "RL step 1")


def _texted(i: int, text: str, reward: float, *, answer: str | None = None,
            correct: bool | None = None) -> Rollout:
    return Rollout(rollout_id=f"r{i}", prompt_id="p", group_id="g", policy_version=0,
                   prompt_ids=[1], response_text=text, answer=answer, reward=reward,
                   correct=correct)


def test_a_shaping_term_alone_is_not_a_right_answer() -> None:
    """G7: "correct" meant reward > 0, so four wrong answers with a 0.1 format part read
    accuracy 1.0 and pass@4 1.0, and RoC took them as positives."""
    from asyncrl.algo import roc
    from asyncrl.config import RocSection

    wrong = _group("a", [_texted(i, f"\\boxed{{{i}}}", 0.1) for i in range(4)])
    s = summarize([wrong], k=4)
    assert (s["accuracy"], s["pass@4"], s["maj@4"]) == (0.0, 0.0, 0.0)
    assert s["correct_stated_ratio"] == 0.0
    assert roc.select(wrong, RocSection(), 4, random.Random(0)).positive == [False] * 4
    # a graded right answer (1 + a shaping part) is right; a reward's own verdict wins
    mixed = _group("b", [_texted(0, "\\boxed{5}", 1.1), _texted(1, "\\boxed{5}", 0.4,
                                                                     correct=True),
                         _texted(2, "\\boxed{6}", 1.0, correct=False),
                         _texted(3, "\\boxed{7}", 0.0)])
    s = summarize([mixed], k=4)
    assert s["accuracy"] == 0.5 and s["maj@4"] == 1.0 and s["correct_stated_ratio"] == 0.5


def test_maj_votes_with_the_answer_in_the_response_when_the_reward_gives_none() -> None:
    """G6: maj@k voted only with `RewardResult.answer`; a plugin reward returning a float, a
    rubric, skyrl_gym and openenv give none: every sample right read maj@4 = 0.0."""
    right = _group("a", [_texted(i, f"so it is \\boxed{{5}} ({i})", 1.0) for i in range(4)])
    s = summarize([right], k=4)
    assert (s["avg@4"], s["pass@4"], s["maj@4"]) == (1.0, 1.0, 1.0)
    assert s["no_answer_ratio"] == 0.0 and s["answer_from_response_ratio"] == 1.0
    # wrong answers that agree pool by their value, however the reply around them reads
    pooled = _group("b", [_texted(0, "\\boxed{5}", 1.0), _texted(1, "it is \\boxed{4}", 0.0),
                          _texted(2, "so: \\boxed{4.0}", 0.0)])
    assert summarize([pooled], k=3)["maj@3"] == 0.0
    # no sample has an answer anywhere: maj@k is not reported, rather than read 0
    silent = _group("c", [_texted(i, "#### 5", 1.0) for i in range(2)])
    s = summarize([silent], k=2)
    assert "maj@2" not in s and s["avg@2"] == 1.0 and s["no_answer_ratio"] == 1.0
    from asyncrl.observe.viewer import eval_figures

    assert eval_figures([silent])[0]["maj"] is None
