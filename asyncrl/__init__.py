"""asyncrl: agentic RL with a Python tool (the rStar2-Agent method), asyncio-first.

The embeddable surface (`from asyncrl import ...`) is the async rollout engine: engines,
tools, the agent loop, the scheduler and the records they produce.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("asyncrl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+local"

__all__ = ["__version__"]

# The async rollout engine (agent loop, tools, scheduler, runner, engines): embeddable surface.
from asyncrl.api import exact_match_reward, rollout_groups, run_loop
from asyncrl.engine.local import LocalEngine
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

__all__ += [
    "FunctionTool",
    "LocalEngine",
    "PythonTool",
    "RolloutRunner",
    "RolloutSettings",
    "Tool",
    "ToolOutcome",
    "build_engines",
    "exact_match_reward",
    "rollout_groups",
    "run_loop",
    "run_rollout",
]
