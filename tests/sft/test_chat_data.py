"""Chat files for SFT: every layout converts, bad rows are counted by `path:line`, the built-in
renderer and the exporter reproduce the generator's tokens, and the batch plan resumes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from asyncrl import formats as F
from asyncrl.errors import DataError
from asyncrl.sft import coldstart as sft
from asyncrl.sft.chat import load_chat
from asyncrl.sft.layouts import BadRow, _python_calls, detect_layout, to_conversation
from asyncrl.sft.render import render
from asyncrl.sft.stage import SFTPlan
from asyncrl.tasks import families as tasks
from asyncrl.tasks.families import solution_code

FIX = Path(__file__).parents[1] / "data" / "fixtures" / "chat"
OPTS = {"train_size": 300, "eval_size": 10, "levels": [1, 2, 3]}


@pytest.fixture(scope="module")
def problems():
    return tasks.generate("tiny_math", OPTS, seed=0)[0]


@pytest.fixture(scope="module")
def tok():
    from asyncrl.modeling import train_tokenizer

    return train_tokenizer(sft.corpus("tiny_math", tasks.generate("tiny_math", OPTS, 0)[0], solution_code, 0), vocab_size=512)


def _convs(name: str) -> list:
    return [to_conversation(json.loads(line)) for line in (FIX / name).read_text().splitlines()]


def _calls(msg: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]


def test_each_public_layout_is_detected_and_converted() -> None:
    for name, layout in [("openai", "openai"), ("sharegpt", "sharegpt"), ("hermes", "hermes"),
                         ("glaive", "glaive"), ("toolace", "toolace"), ("xlam", "xlam"),
                         ("alpaca", "alpaca")]:
        row = json.loads((FIX / f"{name}.jsonl").read_text().splitlines()[0])
        assert detect_layout(row) == layout, name

    oa, oa_plain = _convs("openai.jsonl")
    assert [m["role"] for m in oa.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert _calls(oa.messages[2]) == [("get_weather", {"city": "Paris"})]  # JSON string decoded
    assert oa.tools[0]["function"]["name"] == "get_weather"
    assert oa_plain.messages[1]["content"] == "Hi!"  # content parts joined

    chat, fc = _convs("sharegpt.jsonl")
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert _calls(fc.messages[1]) == [("get_weather", {"city": "Oslo"})]
    assert fc.messages[2] == {"role": "tool", "content": '{"temp_c": 3}'}
    assert fc.tools[0]["function"]["name"] == "get_weather"  # bare schema wrapped

    (h,) = _convs("hermes.jsonl")
    assert [m["role"] for m in h.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert _calls(h.messages[1]) == [("get_weather", {"city": "Rome"}),
                                     ("get_weather", {"city": "Madrid"})]  # python-dict calls
    assert h.messages[2]["content"].startswith('{"name": "get_weather"')
    assert h.tools[0]["function"]["name"] == "get_weather"  # lifted out of the system text

    g, g_plain = _convs("glaive.jsonl")
    assert [m["role"] for m in g.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert g.messages[0]["content"].endswith("Use them if required")
    assert _calls(g.messages[2]) == [("calculate_bmi", {"weight": 70, "height": 1.75})]
    assert g.messages[4]["content"] == "Your BMI is 22.86, which is normal."
    assert g.tools[0]["function"]["name"] == "calculate_bmi" and not g_plain.tools

    (t,) = _convs("toolace.jsonl")
    assert _calls(t.messages[1]) == [("Market Trends API", {"trend_type": "losers", "country": "us"})]
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    assert t.tools[0]["function"]["name"] == "Market Trends API"

    (x,) = _convs("xlam.jsonl")
    assert _calls(x.messages[1]) == [("live_giveaways_by_type", {"type": "beta"})]
    params = x.tools[0]["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == []  # has a default
    assert "default" not in params["properties"]["type"]

    a, a_input = _convs("alpaca.jsonl")
    assert a.messages[0] == {"role": "user", "content": "Give three tips for staying healthy."}
    assert a_input.messages[0]["content"] == "Translate to French.\n\nGood morning"


def test_bad_rows_are_counted_by_line_and_never_crash(tok, tmp_path) -> None:
    path = FIX / "bad_rows.jsonl"
    res = load_chat([str(path)], F.HERMES, tok, max_tokens=512)
    assert res.rows == 7 and len(res.train) == 2
    assert res.skipped == {"bad_arguments": 1, "bad_json": 1, "missing_role": 1, "too_long": 1,
                           "tool_without_call": 1}
    lines = {e.split(": ")[0]: e.split(": ")[1] for e in res.errors}
    assert lines == {f"{path}:2": "missing_role", f"{path}:3": "tool_without_call",
                     f"{path}:4": "bad_arguments", f"{path}:5": "too_long",
                     f"{path}:6": "bad_json"}
    assert [e.source for e in res.train] == [f"{path}:1", f"{path}:7"]
    with pytest.raises(DataError, match=r"5 of 7 chat rows are bad .*missing_role"):
        load_chat([str(path)], F.HERMES, tok, max_tokens=512, max_bad_fraction=0.5)
    with pytest.raises(BadRow, match="no known chat layout"):
        to_conversation({"text": "just text"})


@pytest.mark.parametrize("fmt", [F.MARKDOWN, F.HERMES], ids=lambda f: f.name)
@pytest.mark.parametrize("kind", sft.KINDS)
def test_builtin_renderer_reproduces_the_generator(problems, tok, fmt, kind) -> None:
    """Two independent writers of the same transcript: the generator's segments and the chat
    row rendered by the built-in renderer give the same ids and mask."""
    for p in problems[:25]:
        want = sft.tokenize(sft.render_transcript(p, fmt, kind, random.Random(p.id), code=solution_code(p)), tok)
        row = sft.transcript_messages(p, fmt, kind, random.Random(p.id), code=solution_code(p))
        (segs,) = render(to_conversation(json.loads(json.dumps(row))), fmt)
        assert sft.tokenize(segs, tok) == want


def test_exported_transcripts_train_as_the_same_examples(problems, tok, tmp_path) -> None:
    kw = {"tool_fraction": 0.6, "fail_fix_fraction": 0.3,
          "system_prompt": "Solve it. Use ```python blocks."}
    gen = sft.build_sft_examples(problems, F.MARKDOWN, tok, random.Random(5), code_for=solution_code, **kw)
    out = tmp_path / "sft.jsonl"
    assert sft.export_chat(problems, F.MARKDOWN, random.Random(5), out,
                           code_for=solution_code, **kw) == len(problems)
    res = load_chat([str(out)], F.MARKDOWN, tok, max_tokens=4096)
    assert res.num_bad == 0
    assert [e.pair() for e in res.train] == [(e.input_ids, e.loss_mask) for e in gen]
    assert {json.loads(x)["kind"] for x in out.read_text().splitlines()} == set(sft.KINDS)


def test_parquet_rows_and_a_held_out_split(tok, tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"instruction": f"Echo {i}.", "output": f"{i}"} for i in range(200)]
    path = tmp_path / "alpaca.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    res = load_chat([str(path)], F.HERMES, tok, valid_fraction=0.1, seed=1)
    assert len(res.train) + len(res.valid) == 200 and 8 <= len(res.valid) <= 35
    again = load_chat([str(path)], F.HERMES, tok, valid_fraction=0.1, seed=1)
    assert [e.source for e in again.valid] == [e.source for e in res.valid]  # stable split
    assert res.valid[0].source.startswith(f"{path}:")


def test_batch_plan_buckets_under_budgets_and_resumes() -> None:
    lengths = [random.Random(i).randint(10, 300) for i in range(500)]
    plain = SFTPlan(lengths, seed=3, batch_size=16, batch_tokens=2000).epoch_batches(0)
    assert sorted(i for b in plain for i in b) == list(range(500))
    plan = SFTPlan(lengths, seed=3, batch_size=16, batch_tokens=2000, bucket=True)
    epoch0 = plan.epoch_batches(0)
    assert sorted(i for b in epoch0 for i in b) == list(range(500))  # each row once an epoch
    assert all(len(b) <= 16 and (sum(lengths[i] for i in b) <= 2000 or len(b) == 1)
               for b in epoch0)
    assert epoch0 != plan.epoch_batches(1)  # reshuffled per epoch
    # bucketing: rows in a batch are closer in length than random batches would be
    def spread(batches: list[list[int]]) -> float:
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b)
                   for b in batches) / len(batches)

    assert spread(epoch0) < 60 < spread(plain)
    taken = [plan.next_batch() for _ in range(len(epoch0) + 5)]
    resumed = SFTPlan(lengths, seed=3, batch_size=16, batch_tokens=2000, bucket=True,
                      cursor=SFTPlan(lengths, 3, 16, 2000).cursor())
    assert [resumed.next_batch() for _ in range(3)] == taken[:3]
    mid = SFTPlan(lengths, 3, 16, 2000, bucket=True)
    for _ in range(len(epoch0) + 2):
        mid.next_batch()
    cont = SFTPlan(lengths, 3, 16, 2000, cursor=mid.cursor(), bucket=True)
    assert [cont.next_batch() for _ in range(3)] == taken[len(epoch0) + 2:len(epoch0) + 5]
    with pytest.raises(DataError, match="differ"):
        SFTPlan(lengths[:-1], 3, 16, 2000, cursor=mid.cursor())


def test_builtin_formats_write_other_tools_as_hermes_json(tok) -> None:
    """The tiny curriculum's markdown format has no syntax for a weather tool: such a chat is
    still trained (the call written as Hermes JSON, its result in the format's wrapper)."""
    (oa, _) = _convs("openai.jsonl")
    (segs,) = render(oa, F.MARKDOWN)
    trained = [s.text for s in segs if s.trained]
    assert trained[0] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert any(s.text.startswith("```output\n{\"temp_c\": 18}") for s in segs if not s.trained)
    legacy = to_conversation({"messages": [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}},
        {"role": "function", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]})
    assert [m["role"] for m in legacy.messages] == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("call", ["{[1]: 2}", "{'name': 'f', 'arguments': {{1}: 2}}",
                                  "[" * 5000 + "]" * 5000], ids=["key", "nested-key", "deep"])
def test_a_call_that_breaks_the_literal_parser_is_a_counted_bad_row(tok, tmp_path, call) -> None:
    # ast.literal_eval raises TypeError (unhashable key) or RecursionError (deep nesting), not
    # only ValueError/SyntaxError: each must be one bad row with its line, not an aborted load
    good = json.loads((FIX / "hermes.jsonl").read_text().splitlines()[0])
    bad = {"id": "x", "conversations": [
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": f"<tool_call>\n{call}\n</tool_call>"}]}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    res = load_chat([str(path)], F.HERMES, tok, max_tokens=512)
    assert res.rows == 2 and len(res.train) == 1
    assert res.skipped == {"bad_arguments": 1}
    assert res.errors[0].startswith(f"{path}:2: bad_arguments")


def test_toolace_call_with_an_unhashable_literal_is_a_counted_bad_row() -> None:
    with pytest.raises(BadRow, match="arguments are not literals"):
        _python_calls("[f(a={[1]: 2})]")
