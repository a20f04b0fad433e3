"""Cold-start SFT transcripts: masks, token-exact text, parseable calls, kind mix, length."""

from __future__ import annotations

import random
import re

import msgspec
import pytest

from asyncrl import formats as F
from asyncrl.records import Problem
from asyncrl.sft import coldstart as sft
from asyncrl.tasks import families as tasks
from asyncrl.tasks.families import solution_code

OPTS = {"train_size": 600, "eval_size": 20, "levels": [1, 2, 3]}


@pytest.fixture(scope="module")
def problems():
    return tasks.generate("tiny_math", OPTS, seed=0)[0]


@pytest.fixture(scope="module")
def task_tokenizer():
    """The tiny curriculum's tokenizer: trained on the task corpus, vocab 1024."""
    from asyncrl.modeling import train_tokenizer

    return train_tokenizer(sft.corpus("tiny_math", tasks.generate("tiny_math", OPTS, 0)[0], solution_code, 0), vocab_size=1024)


def _runs(ex: sft.SFTExample, tok) -> list[tuple[int, str]]:
    """Maximal runs of equal mask value, decoded: [(mask, text), ...]."""
    out: list[tuple[int, list[int]]] = []
    for i, m in zip(ex.input_ids, ex.loss_mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(i)
        else:
            out.append((m, [i]))
    return [(m, tok.decode(ids, skip_special_tokens=False)) for m, ids in out]


@pytest.mark.parametrize("fmt", [F.MARKDOWN, F.HERMES], ids=lambda f: f.name)
@pytest.mark.parametrize("kind", sft.KINDS)
def test_tokens_decode_to_the_rendered_text(problems, task_tokenizer, fmt, kind) -> None:
    for p in problems[:30]:
        segs = sft.render_transcript(p, fmt, kind, random.Random(p.id), code=solution_code(p))
        ids, mask = sft.tokenize(segs, task_tokenizer)
        assert len(ids) == len(mask)
        # token-in/token-out: each segment on its own, as the agent loop appends tool outputs
        assert ids == [i for s in segs for i in task_tokenizer.encode(s.text,
                                                                      add_special_tokens=False)]
        text = "".join(s.text for s in segs)
        assert task_tokenizer.decode(ids, skip_special_tokens=False) == text
        # the prompt is exactly what the agent loop renders
        assert segs[0] == (F.render_prompt(p.question, fmt, [F.PYTHON_TOOL_SCHEMA]), False)


@pytest.mark.parametrize("fmt", [F.MARKDOWN, F.HERMES], ids=lambda f: f.name)
def test_masks_calls_and_outputs_line_up(problems, task_tokenizer, fmt) -> None:
    examples = sft.build_sft_examples(problems[:200], fmt, task_tokenizer, random.Random(0), code_for=solution_code)
    eos = task_tokenizer.eos_token_id
    seen = set()
    times = []
    for ex, p in zip(examples, problems[:200], strict=True):
        seen.add(ex.kind)
        assert ex.problem_id == p.id and len(ex.input_ids) == len(ex.loss_mask)
        assert ex.input_ids[-1] == eos and ex.loss_mask[-1] == 1
        runs = _runs(ex, task_tokenizer)
        assert runs[0] == (0, F.render_prompt(p.question, fmt, [F.PYTHON_TOOL_SCHEMA]))
        assistant = [t for m, t in runs if m == 1]
        tool_out = [t for m, t in runs[1:] if m == 0]
        assert all(t.startswith("<reason>") for t in assistant[:-1])
        assert assistant[-1].endswith(f"<answer>\\boxed{{{p.answer}}}</answer><|im_end|>")
        assert F.extract_answer("".join(assistant)) == p.answer
        calls = {"direct": 0, "tool": 1, "fail_fix": 2}[ex.kind]
        assert len(tool_out) == calls and len(assistant) == calls + 1
        for turn, out in zip(assistant, tool_out, strict=False):
            # each calling turn ends where the engine stops, and parses as a python call
            assert turn.endswith(fmt.stop_strings[0])
            call = fmt.parse(turn)
            assert isinstance(call, F.Call) and call.name == F.PYTHON_TOOL
            status, stdout, stderr = sft.run_trusted(call.arguments["code"])
            shown = re.search(r"\nTime: (\d+\.\d\d)s", out)
            assert shown is not None, out
            times.append(float(shown.group(1)))
            assert out == fmt.tool_response(F.render_tool_result(status, stdout, stderr,
                                                                 times[-1], 256))
        if ex.kind == "fail_fix":
            assert "Execution failed (error)." in tool_out[0]
            assert "Error: " in tool_out[0]
        if calls:
            assert "Execution succeeded." in tool_out[-1] and p.answer in tool_out[-1]
    assert seen == set(sft.KINDS)
    # the clock shown varies as a sandbox's does, from an idle node's 0.00s to a loaded one's
    # tenths: a cold start that reads one constant ties its copy of the output to it
    assert min(times) == 0.0 and max(times) >= 0.5 and len(set(times)) >= 20


def test_kind_fractions_follow_the_arguments(problems, task_tokenizer) -> None:
    def mix(**kw) -> dict[str, float]:
        ex = sft.build_sft_examples(problems, F.MARKDOWN, task_tokenizer, random.Random(1), code_for=solution_code, **kw)
        return {k: sum(e.kind == k for e in ex) / len(ex) for k in sft.KINDS}

    m = mix()
    assert m["direct"] == pytest.approx(0.5, abs=0.06)
    assert m["fail_fix"] == pytest.approx(0.5 * 0.15, abs=0.03)
    m = mix(tool_fraction=0.2, fail_fix_fraction=0.5)
    assert m["direct"] == pytest.approx(0.8, abs=0.05)
    assert m["fail_fix"] == pytest.approx(0.1, abs=0.04)
    # direct answers only where a small model could compute them
    ex = sft.build_sft_examples(problems, F.MARKDOWN, task_tokenizer, random.Random(1), code_for=solution_code,
                                direct_wrong_ok=False)
    by_id = {p.id: p for p in problems}
    direct = [e for e in ex if e.kind == "direct"]
    assert direct and all(by_id[e.problem_id].difficulty == 1 for e in direct)


def test_deterministic_for_the_rng_state(problems, task_tokenizer) -> None:
    a = sft.build_sft_examples(problems[:50], F.MARKDOWN, task_tokenizer, random.Random(5), code_for=solution_code)
    b = sft.build_sft_examples(problems[:50], F.MARKDOWN, task_tokenizer, random.Random(5), code_for=solution_code)
    assert a == b


def test_transcripts_fit_the_tiny_response_budgets(problems, task_tokenizer) -> None:
    """tiny.toml: 96 response tokens in the first RL stage, 160 after; prompts <= 256."""
    ex = sft.build_sft_examples(problems, F.MARKDOWN, task_tokenizer, random.Random(2), code_for=solution_code)
    resp = {k: [len(e.loss_mask) - e.loss_mask.index(1) for e in ex if e.kind == k]
            for k in sft.KINDS}
    assert max(resp["direct"]) <= 32
    assert max(resp["tool"]) <= 96
    assert max(resp["fail_fix"]) <= 200
    every = [n for v in resp.values() for n in v]
    assert sum(every) / len(every) <= 60
    assert max(e.loss_mask.index(1) for e in ex) <= 256


def test_broken_code_really_fails() -> None:
    rng = random.Random(0)
    for code in ["print(12 * 34)", "print(sum(range(3, 90 + 1)))", "print(pow(3, 40, 7))",
                 "print(sum(int(d) for d in str(7 ** 30)))"]:
        for _ in range(20):
            status, _, stderr = sft.run_trusted(sft.break_code(code, rng))
            assert status == "error"
            assert "NameError: name" in stderr or "SyntaxError: " in stderr


def test_bad_arguments_are_rejected(problems, task_tokenizer) -> None:
    with pytest.raises(ValueError, match="tool_fraction"):
        sft.build_sft_examples(problems[:2], F.MARKDOWN, task_tokenizer, random.Random(0), code_for=solution_code,
                               tool_fraction=1.5)
    with pytest.raises(ValueError, match="tool"):
        sft.build_sft_examples(problems[:2], F.MARKDOWN, task_tokenizer, random.Random(0), code_for=solution_code,
                               tools=None)
    wrong = msgspec.structs.replace(problems[0], answer="-1")
    with pytest.raises(ValueError, match="expected '-1'"):
        sft.render_transcript(wrong, F.MARKDOWN, "tool", random.Random(0), code=solution_code(wrong))


def test_fail_fix_by_level_overrides_the_fraction_for_those_levels(task_tokenizer) -> None:
    probs = tasks.generate("tiny_math", {"train_size": 800, "eval_size": 0,
                                         "levels": [3, 4]}, seed=0)[0]
    ex = sft.build_sft_examples(probs, F.MARKDOWN, task_tokenizer, random.Random(3), code_for=solution_code,
                                tool_fraction=1.0, fail_fix_fraction=0.1,
                                fail_fix_by_level={4: 0.8})
    level = {p.id: p.difficulty for p in probs}

    def share(lv: int) -> float:
        kinds = [e.kind for e in ex if level[e.problem_id] == lv]
        return kinds.count("fail_fix") / len(kinds)

    assert share(3) == pytest.approx(0.1, abs=0.05)
    assert share(4) == pytest.approx(0.8, abs=0.06)
    with pytest.raises(ValueError, match=r"fail_fix_by_level\[4\]"):
        sft.build_sft_examples(probs[:2], F.MARKDOWN, task_tokenizer, random.Random(3), code_for=solution_code,
                               fail_fix_by_level={4: 1.5})


def test_tool_fraction_by_level_overrides_the_share_of_tool_transcripts(task_tokenizer) -> None:
    """tiny.toml's cold start: easy problems mostly answered directly, hard ones with the tool."""
    probs = tasks.generate("tiny_math", {"train_size": 900, "eval_size": 0,
                                         "levels": [1, 2, 3]}, seed=0)[0]
    ex = sft.build_sft_examples(probs, F.MARKDOWN, task_tokenizer, random.Random(4), code_for=solution_code,
                                tool_fraction=0.5, tool_fraction_by_level={1: 0.2, 3: 0.8})
    level = {p.id: p.difficulty for p in probs}

    def tool_share(lv: int) -> float:
        kinds = [e.kind for e in ex if level[e.problem_id] == lv]
        return 1 - kinds.count("direct") / len(kinds)

    assert tool_share(1) == pytest.approx(0.2, abs=0.06)
    assert tool_share(2) == pytest.approx(0.5, abs=0.07)  # not listed: keeps tool_fraction
    assert tool_share(3) == pytest.approx(0.8, abs=0.06)
    with pytest.raises(ValueError, match=r"tool_fraction_by_level\[1\]"):
        sft.build_sft_examples(probs[:2], F.MARKDOWN, task_tokenizer, random.Random(3), code_for=solution_code,
                               tool_fraction_by_level={1: -0.1})


def test_level_4_transcripts_fit_the_evidence_budget() -> None:
    """evidence.toml: 200 response tokens in every RL stage, level 4 included (its fail-fix
    transcripts carry two multi-line programs and their outputs)."""
    from asyncrl.modeling import train_tokenizer

    opts = {"train_size": 400, "eval_size": 0, "levels": [1, 2, 3, 4]}
    tok = train_tokenizer(sft.corpus("tiny_math", tasks.generate("tiny_math", opts, 0)[0], solution_code, 0), vocab_size=1024)
    probs = [p for p in tasks.generate("tiny_math", opts, seed=0)[0] if p.difficulty == 4]
    ex = sft.build_sft_examples(probs, F.MARKDOWN, tok, random.Random(2), code_for=solution_code, tool_fraction=1.0,
                                fail_fix_fraction=1.0)
    longest = max(len(e.loss_mask) - e.loss_mask.index(1) for e in ex)
    assert longest <= 200, longest


def test_a_generated_cold_start_draws_from_every_group_of_a_grouped_source() -> None:
    """reasoning-gym lists its training problems by generator: a cold start of fewer
    transcripts than problems must not render the first generator's alone (issue 55's word
    cold start taught `simple_equations` only). Each pass is a seeded permutation; with
    `data.shuffle` off, list order."""
    from asyncrl.sft.stage import draw_problems

    probs = [Problem(id=f"{g}{i}", question=f"{g} {i}", answer="1", source=g)
             for g in ("eq", "gsm") for i in range(50)]
    drawn = draw_problems(probs, 40, seed=0)
    assert 10 <= sum(p.source == "gsm" for p in drawn) <= 30
    assert len({p.id for p in drawn}) == 40 and drawn == draw_problems(probs, 40, seed=0)
    assert drawn != draw_problems(probs, 40, seed=1)
    long = draw_problems(probs, 250, seed=0)  # every pass visits every problem once
    for k in range(2):
        assert {p.id for p in long[100 * k:100 * (k + 1)]} == {p.id for p in probs}
    assert long[:100] != long[100:200]
    assert draw_problems(probs, 120, seed=0, shuffle=False) == probs + probs[:20]
