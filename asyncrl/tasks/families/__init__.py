"""The built-in task families, chosen by name (`data.train = "generator:NAME"`): `tiny_math`,
`reasoning_gym` (the reasoning-gym package's generators).

Owns: the registry `TASK_FAMILIES` and the three things a run asks of a family — `generate`
its (train, eval) problems and the `solution_code` of a problem (for SFT transcripts). Does not
own: reading problems from files, batching them, or the tokenizer corpus built from their
transcripts (`asyncrl.sft.coldstart.corpus`), or any plugin source (`asyncrl.tasks.source`).

    train, eval_set = generate("tiny_math", {"train_size": 4000, "eval_size": 128}, seed=0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncrl.records import Problem
from asyncrl.tasks.families import rgym, tiny_math
from asyncrl.tasks.families.base import TaskFamily
from asyncrl.tasks.task import WorkedSolution

__all__ = ["TASK_FAMILIES", "TaskFamily", "corpus", "generate", "get_family", "solution_code"]

TASK_FAMILIES: dict[str, TaskFamily] = {tiny_math.FAMILY.name: tiny_math.FAMILY,
                                         rgym.FAMILY.name: rgym.FAMILY}


def get_family(name: str) -> TaskFamily:
    try:
        return TASK_FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown task family {name!r}; known: {', '.join(sorted(TASK_FAMILIES))}"
        ) from None


def generate(name: str, options: Mapping[str, Any],
             seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) problems of family `name`: disjoint questions, deterministic for a seed.

    Unknown option names and bad values raise `ValueError` naming the option.
    """
    family = get_family(name)
    return family.make(family.resolve_options(options), seed)


def solution_code(problem: Problem) -> str | WorkedSolution | None:
    """The worked solution of `problem` (a program whose stdout is `problem.answer`, a
    `WorkedSolution`, or None where its family has none); the family is `problem.source` up
    to its first `/` (`reasoning_gym/chain_sum` is the `reasoning_gym` family's)."""
    return get_family(problem.source.split("/", 1)[0]).solution_code(problem)
