"""The lenient eval score: the last number the model itself wrote."""

from __future__ import annotations

import json
from fractions import Fraction

from asyncrl.observe.lenient import last_number, rescore_file


def test_last_number_is_the_models_own_not_the_tools():
    assert last_number("The final answer is 4.") == 4
    assert last_number("So 1,234 minus 5 gives -1,229") == -1229
    assert last_number("It is 2.50 then") == Fraction(5, 2)
    assert last_number("no digits here") is None
    text = "Compute: 3 + 4\n```python\nprint(3+4)\n```\n```output\n7\n```\n"
    assert last_number(text) == 4  # the program's 4, not the 7 the sandbox printed
    assert last_number(text + "The result is 7.") == 7


def test_rescore_counts_strict_and_lenient_per_answer(tmp_path):
    rows = [{"problem": {"answer": "-2"}, "rollouts": [
        {"response_text": "The final answer is -2.", "reward": 0.0},
        {"response_text": "<answer>\\boxed{-2}</answer>", "reward": 1.0},
        {"response_text": "It is 3", "reward": 0.0},
        {"response_text": "", "reward": 0.0}]}]
    f = tmp_path / "e.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert rescore_file(f) == {"answers": 4.0, "strict": 0.25, "lenient": 0.5}
