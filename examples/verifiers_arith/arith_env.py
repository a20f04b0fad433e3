"""A verifiers 0.4 environment (`verifiers.v1`), written as for prime-rl, trained by asyncrl.

Nothing here knows about asyncrl: a `Taskset` of multiplication questions, a `Task` whose
`@vf.reward` checks the boxed answer with verifiers' own math scorer, a `@vf.metric`, and a
`Toolset` with a calculator the model may call. `curriculum.toml` beside it trains on it:

    asyncrl config check examples/verifiers_arith/curriculum.toml
    asyncrl train examples/verifiers_arith/curriculum.toml

(run from the repository root: `data.train = "generator:examples.verifiers_arith.arith_env:ArithTaskset"`
imports this file by module path.)
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf
from verifiers.v1.utils.score import verify_boxed_math_answer

SYSTEM = "Multiply. You may call the calculator. Give the final answer as \\boxed{N}."


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return verify_boxed_math_answer(trace.last_reply, self.data.answer)

    @vf.metric
    async def used_calculator(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class Calculator(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the model sees `multiply`, not `calculator_multiply`

    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b


class ArithConfig(vf.TasksetConfig):
    size: int = 400
    """Questions in the taskset."""
    digits: int = 2
    """Digits of each factor."""
    seed: int = 0
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> Iterator[ArithTask]:
        rng = random.Random(self.config.seed)
        lo, hi = 10 ** (self.config.digits - 1), 10 ** self.config.digits - 1
        for i in range(self.config.size):
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            yield ArithTask(ArithData(id=f"mul-{i}", prompt=f"What is {a} times {b}?",
                                      answer=str(a * b), system_prompt=SYSTEM),
                            self.config.task)

    @classmethod
    def toolsets(cls, config: ArithConfig) -> list[vf.Toolset]:
        return [Calculator(config.tools)]


__all__ = ["ArithTaskset"]
