"""asyncrl: agentic RL with a Python tool (the rStar2-Agent method), asyncio-first.

The embeddable surface (`from asyncrl import ...`) is `asyncrl.api` (docs/embedding.md):
loading a trained policy, streaming rollouts with your own problems, tools and reward, the
sandbox as a library or a client, and tasks opened as a curriculum names them, written as plain
functions or as a verifiers-style environment (`asyncrl.tasks`); plus the engines, tools and
runner beneath them. Its names load on first use
(PEP 562), so `import asyncrl.config` or `import asyncrl.api` never pulls in torch; only the
names that need it (`LocalEngine`, `build_engines`) do, when touched.

The package, from the inside out: `errors`, `records`, `config` (import nothing of the project
beyond errors); `formats`, `templates`, `modeling`; the components `rollout/`, `engine/`,
`algo/`, `trainer/`, `sft/`, `tasks/`, `observe/`, `prepare/`; the orchestration `runtime`,
`stages`, `train`; and `cli/` on top. A component never imports the orchestration.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("asyncrl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+local"

# name -> the module that defines it
_EXPORTS = {
    "BudgetError": "asyncrl.api",
    "ModelError": "asyncrl.api",
    "Policy": "asyncrl.api",
    "Problem": "asyncrl.api",
    "RewardResult": "asyncrl.api",
    "Rollout": "asyncrl.api",
    "exact_match_reward": "asyncrl.api",
    "load_policy": "asyncrl.api",
    "open_task": "asyncrl.api",
    "rubric_reward": "asyncrl.api",
    "Task": "asyncrl.api",
    "local_sandbox": "asyncrl.api",
    "remote_sandbox": "asyncrl.api",
    "rollout_groups": "asyncrl.api",
    "rollouts": "asyncrl.api",
    "run_loop": "asyncrl.api",
    "from_environment": "asyncrl.api",
    "function_tool": "asyncrl.api",
    "LocalEngine": "asyncrl.engine.local.engine",
    "build_engines": "asyncrl.engine.registry",
    "FunctionTool": "asyncrl.rollout",
    "PythonTool": "asyncrl.rollout",
    "RolloutRunner": "asyncrl.rollout",
    "RolloutSettings": "asyncrl.rollout",
    "Tool": "asyncrl.rollout",
    "ToolOutcome": "asyncrl.rollout",
    "run_rollout": "asyncrl.rollout",
}

__all__ = [
    "BudgetError",
    "FunctionTool",
    "LocalEngine",
    "ModelError",
    "Policy",
    "Problem",
    "PythonTool",
    "RewardResult",
    "Rollout",
    "RolloutRunner",
    "RolloutSettings",
    "Task",
    "Tool",
    "ToolOutcome",
    "__version__",
    "build_engines",
    "exact_match_reward",
    "from_environment",
    "function_tool",
    "load_policy",
    "local_sandbox",
    "open_task",
    "remote_sandbox",
    "rollout_groups",
    "rollouts",
    "rubric_reward",
    "run_loop",
    "run_rollout",
]

if TYPE_CHECKING:
    from asyncrl.api import (
        BudgetError,
        ModelError,
        Policy,
        Problem,
        RewardResult,
        Rollout,
        Task,
        exact_match_reward,
        from_environment,
        function_tool,
        load_policy,
        local_sandbox,
        open_task,
        remote_sandbox,
        rollout_groups,
        rollouts,
        rubric_reward,
        run_loop,
    )
    from asyncrl.engine.local.engine import LocalEngine
    from asyncrl.engine.registry import build_engines
    from asyncrl.rollout import (
        FunctionTool,
        PythonTool,
        RolloutRunner,
        RolloutSettings,
        Tool,
        ToolOutcome,
        run_rollout,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
