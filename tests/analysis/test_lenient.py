"""The lenient eval score: the last number the model itself wrote."""

from __future__ import annotations

from fractions import Fraction

from asyncrl.analysis.lenient import last_number, rescore_by_source, rescore_file
from asyncrl.records import Group, Problem, Rollout, ToolCall, ToolStatus, save_jsonl


def test_last_number_is_the_models_own_not_the_tools():
    assert last_number("The final answer is 4.") == 4
    assert last_number("So 1,234 minus 5 gives -1,229") == -1229
    assert last_number("It is 2.50 then") == Fraction(5, 2)
    assert last_number("no digits here") is None
    text = "Compute: 3 + 4\n```python\nprint(3+4)\n```\n```output\n7\n```\n"
    assert last_number(text) == 4  # the program's 4, not the 7 the sandbox printed
    assert last_number(text + "The result is 7.") == 7


def test_rescore_counts_strict_and_lenient_per_answer(tmp_path):
    texts = [("The final answer is -2.", 0.0), ("<answer>\\boxed{-2}</answer>", 1.0),
             ("It is 3", 0.0), ("", 0.0)]
    group = Group(group_id="g", problem=Problem(id="p", question="0 - 2 =", answer="-2"),
                  rollouts=[Rollout(rollout_id=f"r{i}", prompt_id="p", group_id="g",
                                    policy_version=0, prompt_ids=[1], response_text=t,
                                    reward=w) for i, (t, w) in enumerate(texts)])
    f = tmp_path / "eval" / "000000-final.jsonl"
    save_jsonl(f, [group])  # as a run writes its eval groups
    assert rescore_file(f) == {"answers": 4.0, "strict": 0.25, "lenient": 0.5,
                              "tool_calls": 0.0, "tool_errors": 0.0}


def test_rescore_by_source_splits_generators_and_counts_tool_calls():
    def group(source: str, calls: list[list[ToolStatus]]) -> Group:
        return Group(group_id=source, problem=Problem(id=source, question="?", answer="7",
                                                      source=source),
                     rollouts=[Rollout(rollout_id=f"{source}{i}", prompt_id=source,
                                       group_id=source, policy_version=0, prompt_ids=[1],
                                       response_text="it is 7",
                                       tool_calls=[ToolCall(name="python", raw=f"c{j}",
                                                            status=st)
                                                   for j, st in enumerate(sts)])
                               for i, sts in enumerate(calls)])

    ok, bad = ToolStatus.OK, ToolStatus.ERROR
    got = rescore_by_source([group("rg/a", [[ok], [bad, ok]]), group("rg/b", [[]])])
    assert list(got) == ["all", "rg/a", "rg/b"]
    assert got["rg/a"]["tool_calls"] == 1.5 and got["rg/a"]["tool_errors"] == 1 / 3
    assert got["rg/b"] == {"answers": 1.0, "strict": 0.0, "lenient": 1.0, "tool_calls": 0.0,
                           "tool_errors": 0.0}
    assert got["all"]["answers"] == 3 and got["all"]["tool_calls"] == 1.0
