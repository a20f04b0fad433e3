"""A cold start from worked solutions: a source's `solution_code` may give a `WorkedSolution`
(reasoning and a program) or None per problem; transcripts say the reasoning, run the program
(a broken multi-line one first, in `fail_fix`), and leave out the problems without one. Also
through `asyncrl train` on a plugin source and the micro model."""

from __future__ import annotations

import json
import random
import sys
import textwrap
from pathlib import Path

import pytest
from micro_config import MICRO_MODEL, ROOT, metric_rows, micro_rollout, run_ok

from asyncrl import formats as F
from asyncrl.records import Problem
from asyncrl.sft import coldstart as sft
from asyncrl.tasks.task import WorkedSolution

PROGRAM = "bags = 3\nper_bag = 4\ntotal = bags * per_bag\nprint(total)"
WORKED = WorkedSolution(program=PROGRAM, reasoning="Each bag holds the same number, so I "
                                                   "multiply the bags by the apples per bag.")
PROBLEM = Problem(id="b1", question="Ann has 3 bags of 4 apples. How many apples?", answer="12",
                  source="bags")


def _text(kind: str, style: str, code: object, seed: int = 0) -> str:
    segs = sft.render_transcript(PROBLEM, F.MARKDOWN, kind, random.Random(seed), code=code,
                                 style=style)
    return "".join(s.text for s in segs)


def test_a_worked_solution_is_said_before_its_program_runs() -> None:
    reply = _text("tool", "natural", WORKED).split("<|im_start|>assistant", 1)[1]
    said, _, rest = reply.partition("```python")
    assert WORKED.reasoning in said and PROGRAM in rest and "\\boxed{12}" in rest
    assert f"<reason>{WORKED.reasoning}</reason>" in _text("tool", "markup", WORKED)
    # a bare program is the same transcript as before: the stock phrase only
    assert _text("tool", "natural", PROGRAM) == _text("tool", "natural",
                                                      WorkedSolution(program=PROGRAM))
    assert WORKED.reasoning not in _text("tool", "natural", PROGRAM)


def test_fail_fix_misspells_a_variable_of_a_multi_line_program() -> None:
    errors = set()
    for seed in range(40):
        broken = sft.break_code(PROGRAM, random.Random(seed))
        status, _, stderr = sft.run_trusted(broken)
        assert status == "error" and broken != PROGRAM, broken
        errors.add(stderr.strip().splitlines()[-1].split(":")[0])
        if "name 'per_bg'" in stderr or "name 'bgas'" in stderr:
            assert "line 3" in stderr  # the later use raises, where the traceback says
    assert errors == {"NameError", "SyntaxError"}
    text = _text("fail_fix", "natural", WORKED, seed=1).split("<|im_start|>assistant", 1)[1]
    assert text.count("```python") == 2 and "Error" in text and text.count(PROGRAM) == 1


def test_fail_fix_never_misspells_inside_a_comment() -> None:
    # a step's words above its line name its variable; a typo there would fail nothing
    commented = ("# Ann has 3 bags\nbags = 3\n# Each bag holds 4, and the bags hold bags "
                 "times that\ntotal = bags * 4\nprint(total)")
    for seed in range(60):
        broken = sft.break_code(commented, random.Random(seed))
        assert [ln for ln in broken.splitlines() if ln.startswith("#")] == \
            [ln for ln in commented.splitlines() if ln.startswith("#")], broken
        assert sft.run_trusted(broken)[0] == "error", broken


def test_problems_without_a_worked_solution_get_no_tool_transcript() -> None:
    from asyncrl.modeling import train_tokenizer

    probs = [Problem(id=f"p{i}", question=f"What is {i} times 3?", answer=str(3 * i))
             for i in range(20)]

    def solution(p: Problem) -> WorkedSolution | None:
        i = int(p.id[1:])
        return None if i % 4 == 0 else WorkedSolution(program=f"print({i} * 3)",
                                                      reasoning=f"Multiply {i} by 3.")

    tok = train_tokenizer([p.question for p in probs], vocab_size=300)
    ex = sft.build_sft_examples(probs, F.MARKDOWN, tok, random.Random(0), tool_fraction=1.0,
                                code_for=solution, style="natural")
    assert sorted(e.problem_id for e in ex) == sorted(p.id for p in probs
                                                      if int(p.id[1:]) % 4)
    # drawn direct, a problem without one still gets a (direct) transcript
    mixed = sft.build_sft_examples(probs, F.MARKDOWN, tok, random.Random(0), tool_fraction=0.5,
                                   code_for=solution)
    assert any(e.kind == "direct" and int(e.problem_id[1:]) % 4 == 0 for e in mixed)
    with pytest.raises(TypeError, match="got a int"):
        sft.build_sft_examples(probs[1:2], F.MARKDOWN, tok, random.Random(0),
                               tool_fraction=1.0, code_for=lambda p: 7)


PLUGIN = '''
from asyncrl.records import Problem
from asyncrl.tasks.task import TaskSource, WorkedSolution


def _rows(n, first):
    rows = []
    for i in range(first, first + n):
        a, b = 2 + i % 7, 3 + (i * 5) % 6
        rows.append(Problem(id=f"w{i}", question=f"Ann has {a} bags of {b} apples. How many "
                            "apples?", answer=str(a * b), source="bags"))
    return rows


def solution(problem):
    if problem.id.endswith("3"):
        return None  # this source has no worked solution for these
    a, b = (int(w) for w in problem.question.split() if w.isdigit())
    return WorkedSolution(reasoning="Multiply the bags by the apples in each.",
                          program=f"bags = {a}\\nper_bag = {b}\\nprint(bags * per_bag)")


def make(options, seed):
    return TaskSource(name="bags", train=_rows(20, 0), eval=_rows(4, 100),
                      solution_code=solution)
'''


@pytest.mark.timeout(600)
def test_a_plugin_source_with_worked_solutions_cold_starts_through_train(
        tmp_path: Path) -> None:
    """`asyncrl train` on a plugin `TaskSource` whose `solution_code` gives `WorkedSolution`s:
    natural transcripts with the programs run in the real sandbox, the problems without one
    left out and counted, and the SFT loss falls."""
    (tmp_path / "bags.py").write_text(PLUGIN)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\nname = \"worked\"\nseed = 0\n" + MICRO_MODEL + textwrap.dedent("""
        [data]
        train = "generator:bags:make"
        max_prompt_tokens = 256
        [task]
        reward = "math"
        tools = ["python"]
        """) + micro_rollout() + textwrap.dedent("""
        [engine]
        kv_token_budget = 8192
        [sandbox]
        workers = 1
        [[stages]]
        name = "cold"
        kind = "sft"
        steps = 80
        batch_size = 4
        lr = 3e-3
        tool_fraction = 1.0
        fail_fix_fraction = 0.3
        transcript_style = "natural"
        sandbox_outputs = true
        [checkpoint]
        every_steps = 0
        [logging]
        console = "json"
        """))
    run_dir = tmp_path / "run"
    run_ok([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir",
            str(run_dir)], cwd=tmp_path, python_path=f"{ROOT}:{tmp_path}")
    (data,) = metric_rows(run_dir, "sft_data")
    # 320 transcripts drawn over 20 problems, 2 of which (w3, w13) have no worked solution
    assert data["rows"] == 320 and data["no_solution"] == 32
    assert data["train"] == 288
    logs = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    (ran,) = [e for e in logs if e.get("event") == "sft_sandbox_outputs"]
    assert ran["programs"] > 18  # the 18 worked programs and their broken first tries
    losses = [r["sft/loss"] for r in metric_rows(run_dir, "sft_step")]
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.timeout(300)
async def test_word_problems_cold_start_in_smollm2s_template_with_real_sandbox_outputs(
        tmp_path: Path) -> None:
    """reasoning-gym word problems in SmolLM2's own template, natural style: every program
    (the failing first tries included) run once in the real sandbox; each transcript says its
    reasoning, shows what the sandbox printed, and answers with the gold."""
    import gzip
    import shutil

    from transformers import AutoTokenizer

    from asyncrl.rollout import PythonTool
    from asyncrl.tasks.families import generate, solution_code
    from asyncrl.templates import bind_format

    sandbox = pytest.importorskip("sandbox")
    pytest.importorskip("reasoning_gym")
    files = ROOT / "tests" / "templates" / "smollm2"
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(files / name, tmp_path / name)
    (tmp_path / "tokenizer.json").write_bytes(
        gzip.decompress((files / "tokenizer.json.gz").read_bytes()))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    fmt = bind_format(F.MARKDOWN, tok, "model")
    problems, _ = generate("reasoning_gym", {"generators": ["gsm_symbolic", "simple_equations"],
                                             "train_size": 32, "eval_size": 4}, 0)
    args = {"tool_fraction": 1.0, "fail_fix_fraction": 0.5, "style": "natural",
            "system_prompt": "Solve the problem. To run Python, write a ```python block."}
    outputs = sft.SandboxOutputs()
    recorded = sft.build_sft_examples(problems, fmt, tok, random.Random(0),
                                      code_for=solution_code, execute=outputs.record, **args)
    async with sandbox.SandboxPool(sandbox.PoolConfig(workers=1, time_limit_s=4.0)) as pool:
        async with sandbox.LocalSandboxClient(pool) as client:
            await outputs.run(PythonTool(client))
    real = sft.build_sft_examples(problems, fmt, tok, random.Random(0), code_for=solution_code,
                                  execute=outputs.replay, **args)
    assert [e.problem_id for e in real] == [e.problem_id for e in recorded]
    with_solution = [p for p in problems if solution_code(p) is not None]
    assert len(real) == len(with_solution) >= 28
    by_id = {p.id: p for p in problems}
    for e in real:
        p = by_id[e.problem_id]
        text = tok.decode(e.input_ids)
        reply = text.split("<|im_start|>assistant", 1)[1]
        assert reply.startswith("\n" + solution_code(p).reasoning)
        assert f"```output\nExecution succeeded.\n{p.answer}\n" in reply
        assert reply.endswith(f"<answer>\\boxed{{{p.answer}}}</answer><|im_end|>")
        if e.kind == "fail_fix":
            assert "Execution failed (error)." in reply
    assert {"tool", "fail_fix"} == {e.kind for e in real}
