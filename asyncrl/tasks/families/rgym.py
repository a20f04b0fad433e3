"""The `reasoning_gym` task family: procedurally generated reasoning tasks from the reasoning-gym package.

Owns turning named reasoning-gym generators into asyncrl problems:
- `generators` (list of names, each a `reasoning_gym.create_dataset` name) with per-generator
  options in `generator_config` (`{ chain_sum = { min_terms = 2, max_digits = 3 } }`);
- training and held-out sets from **distant** seeds: reasoning-gym draws item i from
  `Random(seed + i)`, so adjacent seeds repeat each other shifted by one item; the held-out
  set is drawn at `seed + eval_seed_offset` (default 10^6), then deduplicated by question text
  against the training set (and each set within itself);
- unanswerable items dropped and counted (`simple_equations`' `0 = 0`, empty answers, a gold
  the generator's own rule does not credit), and
  items whose answer is not the value of the expression they show (`wrong_answer`: reasoning-gym
  0.1.25's `basic_arithmetic` without parentheses answers `983 + 374 * 296` with the value of
  `(983 + 374) * 296`);
- a problem's `source` is `reasoning_gym/<generator>` and its `difficulty` the generator's
  position in `generators` (1, 2, ...), so per-level metrics are per generator;
- the family's own answer check (`asyncrl.tasks.families.gym_checks`), right for each generator's
  answer format, used by `[task] reward = "auto"`;
- `solution_code`, the worked solutions a cold start's transcripts run: `print(<the
  expression>)` for the generators whose question carries it (`basic_arithmetic`,
  `chain_sum`, `products`), and checked programs made from the word problems' worked steps
  (`gsm_symbolic`, `simple_equations`: `asyncrl.tasks.families.worked`); None for the others.

Options: `generators`, `generator_config`, `train_size`, `eval_size` (totals; the held-out set
is split evenly over the generators, the training set by `train_weights`: `{ gsm_symbolic = 3 }`
gives that generator three shares of `train_size` to every other's one), `eval_seed_offset`,
`seed_offset` (added to the run seed).
Does not own: reasoning-gym itself (imported when a source is built), the answer checks.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from asyncrl.records import Problem
from asyncrl.tasks.families import gym_checks, worked
from asyncrl.tasks.families.base import TaskFamily
from asyncrl.tasks.task import WorkedSolution

NAME = "reasoning_gym"

DEFAULTS: dict[str, Any] = {
    "generators": ["basic_arithmetic"],
    "generator_config": {},
    "train_weights": {},
    "train_size": 2000,
    "eval_size": 128,
    "eval_seed_offset": 1_000_000,
    "seed_offset": 0,
}

_EXPRESSION = {
    "basic_arithmetic": re.compile(r"^Calculate (?P<e>[-+*/() 0-9]+)\.$"),
    "chain_sum": re.compile(r"^State the final answer to the following arithmetic problem: "
                            r"(?P<e>[-+ 0-9]+) =$"),
    "products": re.compile(r"^Solve the following multiplication: (?P<e>[-* 0-9]+)\. Give only "
                           r"the result as your final answer\.$"),
}
"""Generators whose question holds a Python expression whose value is the answer."""


class ProblemList(list[Problem]):
    """A split, with what was dropped from it by reason (read by `asyncrl.tasks.source`)."""

    dropped: dict[str, int]


_OPS: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: Fraction}


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div):
            return left / right
        return Fraction(_OPS[type(node.op)](left, right))
    raise ValueError("not plain arithmetic")


def expression_value(name: str, question: str) -> Fraction | None:
    """The exact value of the expression an expression generator's question holds (Python's
    precedence), or None for other generators and questions."""
    pattern = _EXPRESSION.get(name)
    m = pattern.match(question) if pattern is not None else None
    if m is None or len(m.group("e")) > 200:
        return None
    try:
        return _value(ast.parse(m.group("e").strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None


def _wrong_gold(name: str, entry: dict[str, Any]) -> bool:
    """The item's answer is not its expression's value. reasoning-gym 0.1.25's
    basic_arithmetic without parentheses writes `983 + 374 * 296` but answers 401672, the
    value of `(983 + 374) * 296`: such items would teach the wrong arithmetic."""
    value = expression_value(name, str(entry["question"]).strip())
    return value is not None and str(value) != str(entry["answer"]).strip()


def _unanswerable(name: str, entry: dict[str, Any]) -> bool:
    """No answer can score: an empty gold, `0 = 0`, or a gold its generator's own rule
    (`gym_checks.check`) does not credit, so that no item is kept that not even its gold
    solves."""
    gold = str(entry.get("answer", "")).strip()
    if not gold:
        return True
    meta = entry.get("metadata") or {}
    if name == "simple_equations" and str(meta.get("equation", "")).replace(" ", "") == "0=0":
        return True
    return gym_checks.check(name, gold, gold) is False


def _check(opts: dict[str, Any]) -> None:
    if not opts["generators"]:
        raise ValueError(f"{NAME}: option 'generators' must name at least one generator")
    if len(set(opts["generators"])) != len(opts["generators"]):
        raise ValueError(f"{NAME}: option 'generators' names a generator twice")
    extra = sorted(set(opts["generator_config"]) - set(opts["generators"]))
    if extra:
        raise ValueError(f"{NAME}: generator_config names {extra[0]!r}, which is not in "
                         "'generators'")
    for name, w in opts["train_weights"].items():
        if name not in opts["generators"]:
            raise ValueError(f"{NAME}: train_weights names {name!r}, which is not in 'generators'")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            raise ValueError(f"{NAME}: train_weights.{name} must be a number above 0, got {w!r}")
    if opts["eval_seed_offset"] < max(opts["train_size"], opts["eval_size"]) * 4:
        raise ValueError(f"{NAME}: option 'eval_seed_offset' must be far above the split sizes "
                         "(items are drawn from Random(seed + index): nearby seeds repeat "
                         "items)")


def _draw(name: str, config: dict[str, Any], seed: int, n: int, split: str,
          taken: set[str], dropped: Counter[str], level: int) -> list[Problem]:
    import difflib

    import reasoning_gym

    known = sorted(reasoning_gym.factory.DATASETS)
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{NAME}: unknown generator {name!r}{hint}")
    if n == 0:
        return []
    size = n * 3 + 16  # room for duplicates and dropped items
    try:
        ds = reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except Exception as e:  # reasoning-gym validates its own config with asserts / TypeErrors
        raise ValueError(f"{NAME}: generator_config.{name}: {type(e).__name__}: {e}") from None
    out: list[Problem] = []
    for idx in range(size):
        entry = ds[idx]
        question = str(entry["question"]).strip()
        if _unanswerable(name, entry):
            dropped["unanswerable"] += 1
            continue
        if _wrong_gold(name, entry):
            dropped["wrong_answer"] += 1
            continue
        if question in taken:
            dropped["duplicate_question"] += 1
            continue
        taken.add(question)
        gym_checks.remember(name, question, entry, ds)
        out.append(Problem(id=f"rg-{name}-{split}-{idx:06d}", question=question,
                           answer=str(entry["answer"]).strip(), source=f"{NAME}/{name}",
                           difficulty=float(level)))
        if len(out) == n:
            return out
    raise ValueError(f"{NAME}: {name} gave only {len(out)} distinct answerable {split} "
                     f"questions of {n}: ask for fewer, or widen its generator_config")


def _split_sizes(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders; ties to the earlier)."""
    exact = [total * w / sum(weights) for w in weights]
    sizes = [int(x) for x in exact]
    by_rest = sorted(range(len(weights)), key=lambda i: (sizes[i] - exact[i], i))
    for i in by_rest[:total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def make(opts: dict[str, Any], seed: int) -> tuple[ProblemList, ProblemList]:
    """(train, eval): eval drawn first at the distant seed, train never repeats its questions."""
    gens: list[str] = opts["generators"]
    base = seed + opts["seed_offset"]
    train, eval_ = ProblemList(), ProblemList()
    d_train: Counter[str] = Counter()
    d_eval: Counter[str] = Counter()
    taken: set[str] = set()
    weights = [float(opts["train_weights"].get(name, 1)) for name in gens]
    for level, (name, n) in enumerate(zip(gens, _split_sizes(opts["eval_size"], [1.0] * len(gens)),
                                          strict=True), start=1):
        eval_ += _draw(name, dict(opts["generator_config"].get(name, {})),
                       base + opts["eval_seed_offset"], n, "eval", taken, d_eval, level)
    for level, (name, n) in enumerate(zip(gens, _split_sizes(opts["train_size"], weights),
                                          strict=True), start=1):
        train += _draw(name, dict(opts["generator_config"].get(name, {})), base, n, "train",
                       taken, d_train, level)
    train.dropped, eval_.dropped = dict(d_train), dict(d_eval)
    return train, eval_


def solution_code(problem: Problem) -> str | WorkedSolution | None:
    """A problem's worked solution: `print(<the question's expression>)` for the expression
    generators (an integer result: reasoning-gym's `basic_arithmetic` divides exactly); for
    `gsm_symbolic` and `simple_equations` the checked `WorkedSolution` of
    `asyncrl.tasks.families.worked` (a `gsm_symbolic` problem needs the item this process
    drew, for its `answer_cot`: one read from a file has none); None for any other generator
    and for an item whose program does not print its answer. Raises ValueError for a problem
    that is not from this family."""
    family, _, gen = problem.source.partition("/")
    if family != NAME:
        raise ValueError(f"{NAME}: {problem.id} is a {problem.source!r} problem, not one of "
                         "this family's")
    pattern = _EXPRESSION.get(gen)
    if pattern is not None:
        m = pattern.match(problem.question)
        if m is None:
            return None
        expr = " ".join(m.group("e").split())
        return f"print({expr})" if "/" not in expr else f"print(round({expr}))"
    return _worked(gen, problem.question, problem.answer)


@functools.lru_cache(maxsize=65536)
def _worked(gen: str, question: str, answer: str) -> WorkedSolution | None:
    """The word generators' checked solutions, made once per item (a cold start asks for the
    same problem's many times, and the sandbox replay asks twice)."""
    entry = gym_checks.ENTRIES.get((gen, question))
    meta = (entry[0].get("metadata") or {}) if entry is not None else {}
    if gen == "gsm_symbolic":
        cot = meta.get("answer_cot")
        return worked.gsm_solution(question, cot, answer) if isinstance(cot, str) else None
    if gen == "simple_equations":
        return worked.equation_solution(question, answer, str(meta.get("equation", "")),
                                        str(meta.get("variable", "")))
    return None


def _reward(ctx: Any) -> Any:
    return gym_checks.GymReward(ctx.reward_host)


FAMILY = TaskFamily(
    name=NAME,
    description="reasoning-gym generators: distant-seed held-out sets, per-generator checks",
    defaults=DEFAULTS,
    make=make,
    solution_code=solution_code,
    check=_check,
    reward=_reward,
)
