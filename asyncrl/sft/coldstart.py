"""Non-reasoning cold-start SFT data: generated transcripts that teach the format, not the math.

Owns: rendering a problem into a short transcript of one of three kinds, and tokenizing it with
a loss mask exactly as the agent loop will see a rollout:
- `direct`: a one-line reason, then the answer — no tool;
- `tool`: a reason, one Python call, its output, the answer;
- `fail_fix`: a call that fails (a misspelt builtin or variable, or an unclosed parenthesis),
  its error, a one-line fix note, the corrected call, its output, the answer.

The program and the reasoning come from the task's worked solution (`Task.solution_code`: a
program, or an `asyncrl.tasks.task.WorkedSolution` whose sentences are said before the call);
a problem the task has no solution for gets no tool transcript (left out, and counted by the
caller).

Every answer is true (SFT data never teaches wrong facts). The policy it gives is imperfect on
purpose: it answers directly about as often as `1 - tool_fraction`, and for large numbers a
small model cannot reproduce the answer from the question — which RL then fixes by preferring
the tool.

Token-in, token-out: a transcript is a list of segments, each tokenized on its own and the ids
concatenated — the prompt (mask 0), each assistant span (mask 1), each tool output (mask 0,
tokenized alone as the agent loop does), the end-of-turn token (mask 1). Calls are written with
`fmt.render_call`, outputs with `fmt.tool_response(formats.render_tool_result(...))`, so SFT
text matches RL text byte for byte. Tool outputs are computed by running the (trusted,
generated) solution program in-process with a handful of builtins, not through the sandbox.

`corpus` gives the text a local tokenizer is trained on: these transcripts for a task family's
train problems, in every tool-call format.

`transcript_messages` / `export_chat` give the same transcripts as OpenAI-style chat rows (for
training them through a chat-file SFT stage, `asyncrl.sft.render` renders them back into the
same tokens).

Does not own: the training step (the trainer), the problems (`asyncrl.tasks`, which never
imports this package), the formats.
"""

from __future__ import annotations

import functools
import io
import json
import keyword
import random
import re
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from asyncrl import formats
from asyncrl.records import Problem
from asyncrl.tasks.task import SolutionCode, WorkedSolution, worked_solution

KINDS = ("direct", "tool", "fail_fix")
REASON_DIRECT = "<reason>Answer directly.</reason>\n"
REASON_TOOL = "<reason>Compute it with Python.</reason>\n"
REASON_FIX = "<reason>Fix the code.</reason>\n"
TOOL_DURATION_RANGE_S = (0.001, 1.0)
"""Execution times shown in generated tool outputs are drawn log-uniformly from this range, one
draw per call from the transcript's rng: the sandbox reports 0.00s on an idle node and tenths of
a second on a loaded one, and a cold start that only ever read one value (it was always 0.01s)
tied its copy of the output to that string. One such tiny model copied outputs at 0.01s and
0.16s alike; another miscopied 9 in 10 level-2 answers at 0.16s (docs/evidence.md, "The
tool's clock")."""
DEFAULT_TOOLS: tuple[dict[str, Any], ...] = (formats.PYTHON_TOOL_SCHEMA,)
STYLES = ("markup", "natural")
"""`markup`: the tiny model's terse `<reason>...</reason>` lines. `natural`: sentences a real
instruction-tuned model writes (drawn from a few phrasings), the same calls and answers."""
_NATURAL = {
    "direct": ("This is small enough to work out directly.\n",
               "I can answer this without running code.\n"),
    "tool": ("Let me compute this with Python.\n", "I'll work it out in Python.\n",
             "I will calculate it with a short Python program.\n"),
    "fix": ("The code failed. Let me fix it and run it again.\n",
            "That raised an error; here is the corrected program.\n"),
    "answer": ("The program printed {a}, so the answer is ", "The result is {a}. The answer is "),
}

Executor = Callable[[str], "tuple[str, str, str, float | None]"]
"""`execute(code) -> (status, stdout, stderr, duration_s or None)`: how a transcript's programs
run. The default is `run_trusted` with the time drawn from the transcript's rng (None);
`sandbox_executor` replays what the run's real sandbox printed, with its own time."""


class SFTExample(msgspec.Struct, frozen=True, kw_only=True):
    """One tokenized transcript. `loss_mask[i]` is 1 where token i is trained on."""

    input_ids: list[int]
    loss_mask: list[int]
    kind: str = ""
    """`direct`, `tool` or `fail_fix`."""
    problem_id: str = ""


class Segment(NamedTuple):
    """A span of transcript text, tokenized on its own; `trained` spans get loss mask 1."""

    text: str
    trained: bool


# ------------------------------------------------------------------------------ execution
_BUILTINS: dict[str, Any] = {f.__name__: f for f in (range, sum, len, pow, int, str, abs, min, max,
                                                     round)}


def run_trusted(code: str) -> tuple[str, str, str]:
    """Run generated, trusted code in-process: (status, stdout, stderr).

    Only a few builtins are visible. A failure gives status `error` and, as stderr, the
    traceback Python would print for `python -c` (the program's frames only).
    Never use this for model-written code: that goes to the sandbox.
    """
    out = io.StringIO()
    env = {"__builtins__": {**_BUILTINS, "print": functools.partial(print, file=out)}}
    try:
        exec(compile(code, "<string>", "exec"), env)
    except Exception as e:  # the failure is the transcript's content, whatever it is
        # Rendered as the sandbox renders it (as `python -c` would): the program's frames only.
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        return "error", out.getvalue(), "".join(traceback.format_exception(type(e), e, tb))
    return "ok", out.getvalue(), ""


def break_code(code: str, rng: random.Random) -> str:
    """A realistic broken version of `code`: a misspelt builtin (NameError) or a dropped
    closing parenthesis (SyntaxError); in a program of several steps, as often a misspelt
    later use of one of its variables (NameError). The caller checks that it really fails."""
    later = _later_uses(code)
    if later and rng.random() < 0.5:
        name, spots = rng.choice(later)
        typos = _typos(name, code)
        if typos:
            at = rng.choice(spots)
            return code[:at] + rng.choice(typos) + code[at + len(name):]
    names = [n for n in ("print", "sum", "range", "pow", "str", "int")
             if re.search(rf"\b{n}\(", code)]
    if names and rng.random() < 0.6:
        name = rng.choice(names)
        i = rng.randrange(1, len(name))
        # drop a letter, or swap two neighbours; never another visible builtin or a keyword
        typos = sorted(t for t in {name[:i] + name[i + 1:],
                                   name[: i - 1] + name[i] + name[i - 1] + name[i + 1:]}
                       if t != name and t not in _BUILTINS and not keyword.iskeyword(t))
        if typos:
            return re.sub(rf"\b{name}\(", rng.choice(typos) + "(", code, count=1)
    j = code.rstrip().rfind(")")
    return code[:j] + code[j + 1:]


def _later_uses(code: str) -> list[tuple[str, list[int]]]:
    """The variables a program assigns (names of 3 or more letters, `total = ...`) with where
    each is used after its assignment, outside comments: the places a misspelling raises a
    NameError."""
    out = []
    for m in re.finditer(r"^([A-Za-z_]\w{2,}) = ", code, re.MULTILINE):
        name = m.group(1)
        spots = [u.start() for u in re.finditer(rf"\b{name}\b", code[m.end():])
                 if not _in_comment(code, m.end() + u.start())]
        if spots and name not in _BUILTINS:
            out.append((name, [m.end() + at for at in spots]))
    return out


def _in_comment(code: str, at: int) -> bool:
    """Whether position `at` of `code` is inside a `#` comment (a misspelling there fails
    nothing). The programs here have no `#` inside a string."""
    return "#" in code[code.rfind("\n", 0, at) + 1:at]


def _typos(name: str, code: str) -> list[str]:
    """Misspellings of `name` (a letter dropped, two swapped) that name nothing in `code`, no
    builtin and no keyword."""
    taken = set(re.findall(r"\w+", code)) | set(_BUILTINS) | {"print"}
    found = set()
    for i in range(1, len(name)):
        found |= {name[:i] + name[i + 1:], name[: i - 1] + name[i] + name[i - 1] + name[i + 1:]}
    return sorted(t for t in found if t.isidentifier() and t not in taken
                  and not keyword.iskeyword(t) and t != name)


def tool_duration(rng: random.Random) -> float:
    """An execution time for a generated tool output (`TOOL_DURATION_RANGE_S`)."""
    lo, hi = TOOL_DURATION_RANGE_S
    return lo * (hi / lo) ** rng.random()


def _trusted(code: str) -> tuple[str, str, str, float | None]:
    return (*run_trusted(code), None)


def _tool_output(fmt: formats.ToolFormat, code: str, max_chars: int, rng: random.Random,
                 duration_s: float | None = None, execute: Executor | None = None,
                 show_time: bool = True) -> tuple[str, str, str]:
    """(text appended after the call, status, stdout) for running `code`; the time shown is
    `duration_s`, else the executor's, else drawn (`tool_duration`; drawn even when not
    shown, so `show_time` changes nothing else of a transcript)."""
    status, stdout, stderr, took = (execute or _trusted)(code)
    if duration_s is None:
        duration_s = took if took is not None else tool_duration(rng)
    result = formats.render_tool_result(status, stdout, stderr,
                                        duration_s if show_time else None, max_chars)
    return fmt.tool_response(result), status, stdout


# ---------------------------------------------------------------------------- transcripts
def _tool_reason(solution: WorkedSolution, stock: str, natural: bool) -> str:
    """What is said before the (first) call: the worked solution's reasoning, then in the
    natural style the stock phrase (`Let me compute this with Python.`); the stock text alone
    when it has none."""
    if not solution.reasoning:
        return stock
    if natural:
        return f"{solution.reasoning.strip()}\n{stock}"
    return f"<reason>{solution.reasoning.strip()}</reason>\n"


def render_transcript(problem: Problem, fmt: formats.ToolFormat, kind: str, rng: random.Random, *,
                      code: str | WorkedSolution | None = None,
                      tools: Sequence[dict[str, Any]] | None = DEFAULT_TOOLS,
                      system_prompt: str = "", max_chars: int = 256,
                      duration_s: float | None = None, style: str = "markup",
                      execute: Executor | None = None, show_time: bool = True) -> list[Segment]:
    """The segments of one transcript of `kind` for `problem` (prompt first, end-of-turn last).

    `code` is the worked solution (the task's, `Task.solution_code`: a program or a
    `WorkedSolution`, whose reasoning is said before the call; needed by tool kinds). Each
    tool output shows the execution time `duration_s`, or the executor's, or one drawn from
    `rng` per call (`tool_duration`); with `show_time` False none is shown (the rollouts'
    `rollout.tool_time`). `style` is one of `STYLES`; `execute` runs the programs
    (default `run_trusted`). Raises ValueError when the program does not print the problem's
    answer.
    """
    if style not in STYLES:
        raise ValueError(f"unknown transcript style {style!r}; expected one of {STYLES}")
    natural = style == "natural"
    if kind not in KINDS:
        raise ValueError(f"unknown transcript kind {kind!r}; expected one of {KINDS}")
    segs = [Segment(formats.render_prompt(problem.question, fmt, list(tools) if tools else None,
                                          system_prompt), False)]
    answer = f"<answer>\\boxed{{{problem.answer}}}</answer>"

    def say(what: str, fallback: str) -> str:
        return rng.choice(_NATURAL[what]) if natural else fallback

    if kind == "direct":
        return [*segs, Segment(say("direct", REASON_DIRECT) + answer, True),
                Segment(fmt.end_of_turn, True)]
    if not tools:
        raise ValueError("tool transcripts need the Python tool in the prompt (tools is empty)")
    solution = worked_solution(code)
    if solution is None:
        raise ValueError(f"problem {problem.id}: a tool transcript needs its solution program "
                         "(the task source supplies none)")
    code = solution.program
    reason = _tool_reason(solution, say("tool", REASON_TOOL), natural)
    if kind == "fail_fix":
        broken = break_code(code, rng)
        response, status, _ = _tool_output(fmt, broken, max_chars, rng, duration_s, execute,
                                            show_time)
        if status == "ok":
            raise ValueError(f"problem {problem.id}: broken program {broken!r} did not fail")
        segs += [Segment(reason + fmt.render_call(broken), True), Segment(response, False)]
        reason = say("fix", REASON_FIX)
    response, status, stdout = _tool_output(fmt, code, max_chars, rng, duration_s, execute,
                                           show_time)
    if status != "ok" or stdout.strip() != problem.answer:
        raise ValueError(f"problem {problem.id}: program {code!r} printed {stdout.strip()!r}, "
                         f"expected {problem.answer!r}")
    lead = say("answer", "").format(a=problem.answer)
    return [*segs, Segment(reason + fmt.render_call(code), True), Segment(response, False),
            Segment(lead + answer, True), Segment(fmt.end_of_turn, True)]


def transcript_messages(problem: Problem, fmt: formats.ToolFormat, kind: str,
                        rng: random.Random, *, code: str | WorkedSolution | None = None,
                        tools: Sequence[dict[str, Any]] | None = DEFAULT_TOOLS,
                        system_prompt: str = "", max_chars: int = 256) -> dict[str, Any]:
    """The transcript `render_transcript` makes (same arguments, same draws from `rng`), as an
    OpenAI-style chat row `{"messages": [...], "tools": [...]}`: what `export_chat` writes and
    `asyncrl.sft.render` renders back into the same tokens."""
    if kind not in KINDS:
        raise ValueError(f"unknown transcript kind {kind!r}; expected one of {KINDS}")
    schemas = list(tools) if tools else []
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt or fmt.system_prompt(schemas or None)},
        {"role": "user", "content": problem.question}]
    answer = f"<answer>\\boxed{{{problem.answer}}}</answer>"
    if kind == "direct":
        msgs.append({"role": "assistant", "content": REASON_DIRECT + answer})
        return {"messages": msgs, "tools": schemas}
    if not tools:
        raise ValueError("tool transcripts need the Python tool in the prompt (tools is empty)")
    solution = worked_solution(code)
    if solution is None:
        raise ValueError(f"problem {problem.id}: a tool transcript needs its solution program "
                         "(the task source supplies none)")
    code = solution.program

    def called(reason: str, program: str) -> tuple[str, str]:
        status, stdout, stderr = run_trusted(program)
        msgs.append({"role": "assistant", "content": reason, "tool_calls": [
            {"type": "function", "function": {"name": formats.PYTHON_TOOL,
                                              "arguments": {"code": program, "input": ""}}}]})
        msgs.append({"role": "tool", "content": formats.render_tool_result(
            status, stdout, stderr, tool_duration(rng), max_chars)})
        return status, stdout

    reason = _tool_reason(solution, REASON_TOOL, natural=False)
    if kind == "fail_fix":
        broken = break_code(code, rng)
        if called(reason, broken)[0] == "ok":
            raise ValueError(f"problem {problem.id}: broken program {broken!r} did not fail")
        reason = REASON_FIX
    status, stdout = called(reason, code)
    if status != "ok" or stdout.strip() != problem.answer:
        raise ValueError(f"problem {problem.id}: program {code!r} printed {stdout.strip()!r}, "
                         f"expected {problem.answer!r}")
    msgs.append({"role": "assistant", "content": answer})
    return {"messages": msgs, "tools": schemas}


def export_chat(problems: Sequence[Problem], fmt: formats.ToolFormat, rng: random.Random,
                path: str | Path, tool_fraction: float = 0.5, fail_fix_fraction: float = 0.15,
                direct_wrong_ok: bool = True, *,
                tools: Sequence[dict[str, Any]] | None = DEFAULT_TOOLS, system_prompt: str = "",
                max_chars: int = 256, code_for: SolutionCode | None,
                fail_fix_by_level: Mapping[int, float] | None = None,
                tool_fraction_by_level: Mapping[int, float] | None = None) -> int:
    """Write the transcripts `build_sft_examples` would make (same arguments and `rng` state:
    the same kinds, programs and failures, in order) as chat JSONL, one row per problem with
    its `id`; returns the row count. Trained through a chat SFT stage they are the same
    examples, token for token; a problem drawn a tool kind that has no worked solution is
    left out, as there)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = 0
    with out.open("w", encoding="utf-8") as fp:
        for p in problems:
            kind = choose_kind(p, rng, tool_fraction, fail_fix_fraction, direct_wrong_ok,
                               fail_fix_by_level, tool_fraction_by_level)
            code = solution_for(p, code_for) if kind != "direct" else None
            if kind != "direct" and code is None and code_for is not None:
                continue
            rows += 1
            row = transcript_messages(p, fmt, kind, rng, code=code, tools=tools,
                                      system_prompt=system_prompt, max_chars=max_chars)
            fp.write(json.dumps({"id": p.id, "kind": kind, **row}, ensure_ascii=False) + "\n")
    return rows


def solution_for(problem: Problem, code_for: SolutionCode | None) -> WorkedSolution | None:
    """`problem`'s worked solution from `code_for` (None when there is no `code_for`, or it has
    none for this problem)."""
    return worked_solution(code_for(problem)) if code_for is not None else None


def choose_kind(problem: Problem, rng: random.Random, tool_fraction: float,
                fail_fix_fraction: float, direct_wrong_ok: bool = True,
                fail_fix_by_level: Mapping[int, float] | None = None,
                tool_fraction_by_level: Mapping[int, float] | None = None) -> str:
    """Draw a transcript kind: the tool with probability `tool_fraction` (then, with probability
    `fail_fix_fraction`, a failing call fixed); else a direct answer. With `direct_wrong_ok`
    False, problems above level 1 always use the tool (direct answers only where a small model
    can plausibly compute them). `fail_fix_by_level` overrides `fail_fix_fraction` for problems
    of the listed levels (`Problem.difficulty`): a cold start that often calls the tool wrong at
    the harder levels leaves RL tool errors to remove there, as a real model's first steps do.
    `tool_fraction_by_level` likewise overrides `tool_fraction`: a cold start that answers easy
    problems in its head and calls the tool for hard ones, as a real model does."""
    level = int(problem.difficulty or 0)
    use_tool = rng.random() < (tool_fraction_by_level or {}).get(level, tool_fraction)
    if not direct_wrong_ok and (problem.difficulty or 0) > 1:
        use_tool = True
    if not use_tool:
        return "direct"
    frac = (fail_fix_by_level or {}).get(level, fail_fix_fraction)
    return "fail_fix" if rng.random() < frac else "tool"


def tokenize(segments: Iterable[Segment], tokenizer: Any) -> tuple[list[int], list[int]]:
    """(ids, mask): each segment tokenized on its own (no special tokens added), concatenated."""
    return tokenize_many([list(segments)], tokenizer)[0]


def tokenize_many(transcripts: Sequence[Sequence[Segment]],
                  tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """`tokenize` for many transcripts: each distinct segment text is encoded once, in one
    batched call (per-call overhead dominated building a few thousand examples one by one)."""
    texts = list(dict.fromkeys(seg.text for segs in transcripts for seg in segs))
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    ids_of = dict(zip(texts, encoded, strict=True))
    out = []
    for segs in transcripts:
        ids: list[int] = []
        mask: list[int] = []
        for seg in segs:
            part = ids_of[seg.text]
            ids += part
            mask += [int(seg.trained)] * len(part)
        out.append((ids, mask))
    return out


def build_sft_examples(problems: Sequence[Problem], fmt: formats.ToolFormat, tokenizer: Any,
                       rng: random.Random, tool_fraction: float = 0.5,
                       fail_fix_fraction: float = 0.15, direct_wrong_ok: bool = True, *,
                       tools: Sequence[dict[str, Any]] | None = DEFAULT_TOOLS,
                       system_prompt: str = "", max_chars: int = 256,
                       code_for: SolutionCode | None,
                       fail_fix_by_level: Mapping[int, float] | None = None,
                       tool_fraction_by_level: Mapping[int, float] | None = None,
                       style: str = "markup", execute: Executor | None = None,
                       show_time: bool = True) -> list[SFTExample]:
    """One tokenized SFT example per problem, in order; kinds drawn by `choose_kind`. A problem
    drawn a tool kind for which `code_for` has no worked solution (None) is left out: the
    caller counts them (`len(problems) - len(examples)`).

    `fail_fix_fraction` is a share of the tool-using examples; `fail_fix_by_level` replaces it
    (and `tool_fraction_by_level` replaces `tool_fraction`) for the problems of the levels it
    lists. `tools`, `system_prompt`, `max_chars` and `show_time` must be what the rollouts use
    (`rollout.tools`, `data.system_prompt`, `rollout.tool_output_max_chars`,
    `rollout.tool_time`) so the text matches. `code_for` gives a problem's worked solution
    (the task's `solution_code`; None only when no transcript calls the tool). `style`
    and `execute` as in `render_transcript`. Deterministic for the same `rng` state (and the same executor's answers).
    """
    checked = [("tool_fraction", tool_fraction), ("fail_fix_fraction", fail_fix_fraction),
               *((f"fail_fix_by_level[{lv}]", v) for lv, v in (fail_fix_by_level or {}).items()),
               *((f"tool_fraction_by_level[{lv}]", v)
                 for lv, v in (tool_fraction_by_level or {}).items())]
    for name, v in checked:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
    if not tools and (tool_fraction > 0 or not direct_wrong_ok):
        raise ValueError("tool transcripts need the Python tool: set tool_fraction=0 "
                         "and direct_wrong_ok=True when tools are off")
    kept, kinds, rendered = [], [], []
    for p in problems:
        kind = choose_kind(p, rng, tool_fraction, fail_fix_fraction, direct_wrong_ok,
                           fail_fix_by_level, tool_fraction_by_level)
        code = solution_for(p, code_for) if kind != "direct" else None
        if kind != "direct" and code is None and code_for is not None:
            continue  # no worked solution for this problem: no tool transcript of it
        kept.append(p)
        kinds.append(kind)
        rendered.append(render_transcript(p, fmt, kind, rng, code=code, tools=tools,
                                          system_prompt=system_prompt, max_chars=max_chars,
                                          style=style, execute=execute, show_time=show_time))
    return [SFTExample(input_ids=ids, loss_mask=mask, kind=kind, problem_id=p.id)
            for p, kind, (ids, mask) in zip(kept, kinds, tokenize_many(rendered, tokenizer),
                                            strict=True)]


def corpus_texts(problems: Iterable[Problem], fmts: Sequence[formats.ToolFormat],
                 rng: random.Random, code_for: SolutionCode) -> Iterator[str]:
    """Whole transcript texts for a tokenizer corpus: kinds and formats taken in turn, so every
    string a rollout can contain (prompts, calls, errors, outputs, answers) is represented.
    `code_for` gives a problem's worked solution (one without: a direct transcript)."""
    for i, p in enumerate(problems):
        kind = KINDS[i % len(KINDS)]
        fmt = fmts[(i // len(KINDS)) % len(fmts)]
        code = None if kind == "direct" else solution_for(p, code_for)
        kind = kind if code is not None else "direct"
        yield "".join(s.text for s in render_transcript(p, fmt, kind, rng, code=code))


def corpus(name: str, problems: Sequence[Problem], code_for: SolutionCode,
           seed: int, *, tool_formats: Sequence[str] = ("markdown", "hermes"),
           max_transcripts: int = 3000) -> Iterator[str]:
    """Text to train a local tokenizer on: every string the model will read or write.

    Full SFT transcripts (system prompt, question, reasoning markup, tool calls, tool outputs,
    failing calls, answers, end of turn) of up to `max_transcripts` train problems, each kind of
    transcript and each tool-call format in turn. Eval problems are left out: they share the
    templates, so nothing is missing, and no eval text shapes the vocabulary. `problems` are
    task `name`'s training problems, `code_for` its solution programs (`Task.solution_code`).
    """
    train = list(problems)
    fmts = [formats.get_format(f) for f in tool_formats]
    rng = random.Random(f"{name}/corpus/{seed}")
    yield from corpus_texts(train[:max_transcripts], fmts, rng, code_for)


# --------------------------------------------------------------------- real sandbox outputs
class SandboxOutputs:
    """Transcript programs run in the run's real sandbox, so SFT shows the model what RL will:
    the sandbox's tracebacks and its measured times. Two passes over the same rng draws:
    `record` (as the executor) notes each program and answers with `run_trusted` (no rng draw
    for the time, as in the replay), `await run(tool)` executes every distinct program once
    in the sandbox, and `replay` (as the executor) gives the sandbox's results."""

    def __init__(self) -> None:
        self.programs: dict[str, tuple[str, str, str, float | None] | None] = {}

    def record(self, code: str) -> tuple[str, str, str, float | None]:
        self.programs.setdefault(code, None)
        status, stdout, stderr = run_trusted(code)
        return status, stdout, stderr, 0.0

    async def run(self, tool: Any, concurrency: int = 8) -> None:
        """Execute each recorded program with `tool` (a `PythonTool`): its `ToolOutcome`'s
        status, stdout, stderr and duration are what the transcripts show."""
        import asyncio

        sem = asyncio.Semaphore(concurrency)

        async def one(code: str) -> None:
            async with sem:
                out = await tool({"code": code, "input": ""})
            self.programs[code] = (str(out.status.value), out.stdout, out.stderr,
                                   float(out.duration_s))

        async with asyncio.TaskGroup() as tg:
            for code in self.programs:
                tg.create_task(one(code))

    def replay(self, code: str) -> tuple[str, str, str, float | None]:
        got = self.programs.get(code)
        if got is None:
            raise ValueError(f"program {code!r} was not run in the sandbox")
        return got
