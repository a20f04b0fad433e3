"""Roll out a trained policy over your own questions, with your own tool and reward.

    python examples/rollouts_custom.py [RUN_DIR]

RUN_DIR is what `asyncrl train curricula/tiny.toml` wrote (e.g. runs/tiny); without one, a
stand-in with a random model is made in a temporary directory (`standin.py`), so the answers
are nonsense but every step is real.
"""

import re
import sys
import tempfile
from pathlib import Path

from standin import make_run_dir

from asyncrl import (
    Problem,
    RewardResult,
    formats,
    function_tool,
    load_policy,
    local_sandbox,
    rollouts,
    run_loop,
)


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


async def my_reward(problem, rollout):
    """1.0 for the right number in the last \\boxed{}, 0.1 for having tried a tool."""
    boxed = re.findall(r"\\boxed\{([^}]*)\}", rollout.response_text)
    if boxed and boxed[-1].strip() == problem.answer:
        return RewardResult(reward=1.0, status="ok", answer=boxed[-1])
    return RewardResult(reward=0.1 if rollout.tool_calls else 0.0, status="ok")


def show(ro) -> None:
    print(f"rollout {ro.prompt_id} status={ro.status.value} reward={ro.reward} "
          f"tokens={len(ro.response_ids)} tool_calls={len(ro.tool_calls)}")


async def main(run_dir: Path) -> None:
    policy = load_policy(run_dir)  # the curriculum's prompt, tool format and budgets
    print(f"policy: format={policy.tool_format.name} max_turns={policy.settings.max_turns} "
          f"max_response_tokens={policy.settings.max_response_tokens}")
    problems = [Problem(id="q1", question="What is 17 times 23?", answer="391"),
                Problem(id="q2", question="What is 1234 plus 4321?", answer="5555")]
    mul = function_tool(multiply)  # schema from the signature and docstring
    print("direct call multiply(6, 7) ->", (await mul({"a": 6, "b": 7})).output)
    async with policy.engine(kv_token_budget=8192) as engine, local_sandbox(workers=1) as python:
        out = await python({"code": "print(17 * 23)"})
        print(f"direct call python -> {out.status.value} {out.stdout.strip()}")
        # As trained: the curriculum's format (```python blocks) and the sandbox.
        short = policy.settings_with(max_response_tokens=64)
        async for ro in rollouts(problems, engines=[engine], policy=policy, tools=[python],
                                 reward_fn=my_reward, samples_per_prompt=2, settings=short):
            show(ro)
        # Tools of your own need a format that names them: Hermes <tool_call> JSON, with the
        # format's default system text (system_prompt="") listing both tools.
        hermes = policy.settings_with(max_response_tokens=64, tool_format=formats.HERMES)
        async for ro in rollouts(problems, engines=[engine], policy=policy, tools=[python, mul],
                                 reward_fn=my_reward, settings=hermes, system_prompt=""):
            show(ro)
    print("done")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run_loop(main(Path(sys.argv[1])))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run_loop(main(make_run_dir(Path(tmp))))
