"""The async rollout engine: agent loop, tools, admission policy, scheduler, group runner.

One event loop owns every rollout (`eventloop.run` uses uvloop when installed). A rollout is a
task (`agent.AgentLoop`) that streams tokens from an engine and fires tool calls the moment
they close; the scheduler (`admission` policy + `scheduler` shell) admits rollouts onto engines
as KV headroom frees; the runner (`runner.RolloutRunner`) rewards them and yields each 2G group
as soon as its last member ends. Prompts and tool outputs are tokenized off the loop where the
tokenizer allows it (`codec.Codec`: one worker thread per `tokenizers`-backed tokenizer).
"""

from asyncrl.rollout.admission import POLICIES, AdmissionPolicy, Ask, make_policy
from asyncrl.rollout.agent import AgentLoop, RolloutSettings, run_rollout
from asyncrl.rollout.runner import RewardFn, RolloutRunner
from asyncrl.rollout.scheduler import Lease, Scheduler
from asyncrl.rollout.tools import FunctionTool, PythonTool, Tool, ToolOutcome

__all__ = [
    "POLICIES",
    "AdmissionPolicy",
    "AgentLoop",
    "Ask",
    "FunctionTool",
    "Lease",
    "PythonTool",
    "RewardFn",
    "RolloutRunner",
    "RolloutSettings",
    "Scheduler",
    "Tool",
    "ToolOutcome",
    "make_policy",
    "run_rollout",
]
