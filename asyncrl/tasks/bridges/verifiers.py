"""verifiers >= 0.4 (`verifiers.v1`) tasksets as asyncrl task sources, scored by verifiers.

Owns `source(taskset, ...)`: a `vf.Taskset` (class or instance) as a `TaskSource`:
- **problems**: the taskset's tasks in `load()` order (bounded by `size`), shuffled with the
  run's seed and cut into a held-out split (`eval_size`) and the training split; a problem's
  question is the task's prompt text, its answer the task data's `answer` field when it has
  one (for reports; the scoring never reads it);
- **reward**: `Task.score(trace)`, verifiers' own scoring (`@vf.reward` weights, `@vf.metric`,
  plugged functions, judges that need no runtime), on a `vf.Trace` rebuilt from the rollout:
  the task's system and user messages, then one assistant message per model turn (its tool
  call as a `ToolCall`) and one tool message per tool answer. The rollout's reward is
  `trace.reward`; each named reward and metric goes to `reward_detail`. A reward or metric
  function that raises scores 0 and is named in `reward_errors` (verifiers itself would fail
  the whole score); the rollout is never failed for it;
- **tools**: every `@vf.tool` of `Taskset.toolsets(config)` and the task class's
  `Task.toolsets(config.task)`, named as verifiers names them for the model
  (`<server>_<tool>`, or bare with `TOOL_PREFIX = None`), called in-process. A stateful
  toolset (one with a `State` type: its state travels over verifiers' HTTP state channel)
  is refused with a clear error.

Not supported (said, not hidden): signals that need a `runtime` (files in a sandbox; verifiers
skips them when scoring without one, and so does this), `Env` subclasses (multi-agent,
user simulators), custom harnesses, group scoring, and tasks with different system prompts
(the most common one is used, the others counted in the log). verifiers' reward functions run
on asyncrl's event loop: a slow synchronous one stalls it.

Options (`data.generator_options`): `size` (tasks read from the taskset, 0 = all; required
for an infinite taskset), `eval_size` (held-out tasks, default 32), `config` (fields of the
taskset's `TasksetConfig`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
from collections import Counter
from typing import Any

from asyncrl.errors import ConfigError
from asyncrl.formats import extract_answer
from asyncrl.log import get_logger
from asyncrl.records import Problem, RewardResult, Rollout
from asyncrl.tasks.task import TaskContext, TaskSource

log = get_logger(__name__)

OPTIONS = {"size": 0, "eval_size": 32, "config": {}}


def _options(options: dict[str, Any], key: str) -> dict[str, Any]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError("data.generator_options", f"unknown option {unknown[0]!r} for a "
                          f"verifiers taskset; known: {', '.join(OPTIONS)} (the taskset's "
                          "own fields go under `config`)")
    return {**OPTIONS, **options}


def _taskset(obj: Any, config: dict[str, Any], key: str) -> Any:
    import verifiers.v1 as vf
    from verifiers.v1.utils.generic import concrete_type

    if isinstance(obj, vf.Taskset):
        if config:
            raise ConfigError("data.generator_options.config", "the taskset is already built; "
                              "name its class to configure it")
        return obj
    if not (isinstance(obj, type) and issubclass(obj, vf.Taskset)):
        raise ConfigError(key, f"{obj!r} is from verifiers.v1 but not a Taskset (class or "
                          "instance); an Env's rollouts are driven by verifiers, not asyncrl")
    cfg_type = concrete_type(obj, vf.TasksetConfig) or vf.TasksetConfig
    try:
        return obj(cfg_type(**config))
    except Exception as e:  # pydantic's ValidationError, the taskset's own checks
        raise ConfigError("data.generator_options.config", f"{obj.__name__}: {e}") from None


def source(obj: Any, name: str, options: dict[str, Any], seed: int, *,
           key: str = "data.train") -> TaskSource:
    """The taskset `obj` as a `TaskSource` (see the module docstring)."""
    opts = _options(options, key)
    ts = _taskset(obj, dict(opts["config"]), key)
    if not ts.bounded and not opts["size"]:
        raise ConfigError("data.generator_options.size", f"{type(ts).__name__} is infinite: "
                          "set `size`, the number of tasks to read")
    view = ts.take(opts["size"]) if opts["size"] else ts
    try:
        tasks = list(view)
    except Exception as e:  # the taskset's own load(): say whose failure it is
        raise ConfigError(key, f"{type(ts).__name__}.load() raised {type(e).__name__}: "
                          f"{e}") from e
    by_id: dict[str, Any] = {}
    problems: list[Problem] = []
    dropped: Counter[str] = Counter()
    for task in tasks:
        pid = str(task.data.id if task.data.id is not None else task.key)
        question = task.data.prompt_text
        if pid in by_id:
            dropped["duplicate_id"] += 1
            continue
        if not question:
            dropped["no_prompt"] += 1
            continue
        by_id[pid] = task
        answer = getattr(task.data, "answer", "")
        problems.append(Problem(id=pid, question=question, answer="" if answer is None
                                else str(answer), source=name))
    random.Random(f"asyncrl.verifiers:{seed}").shuffle(problems)
    n_eval = min(int(opts["eval_size"]), len(problems) // 2)
    prompts = Counter(t.data.system_prompt or "" for t in by_id.values())
    system = prompts.most_common(1)[0][0] if prompts else ""
    if len(prompts) > 1:
        log.warning("verifiers_system_prompts_differ", used=system[:80],
                    others=sum(prompts.values()) - prompts[system])
    task_cls = type(tasks[0]) if tasks else None
    return TaskSource(
        name=name, train=problems[n_eval:], eval=problems[:n_eval], dropped=dict(dropped),
        reward=functools.partial(_reward, by_id),
        tools=functools.partial(_tools, type(ts), ts.config, task_cls),
        system_prompt=system)


# ----------------------------------------------------------------------------- reward
def _isolated(fn: Any, errors: list[str]) -> Any:
    """`fn` (an async verifiers signal) scoring 0 instead of raising; the error recorded."""

    @functools.wraps(fn)
    async def safe(*args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(*args, **kwargs)
            return await out if asyncio.iscoroutine(out) or asyncio.isfuture(out) else out
        except Exception as e:  # verifiers' gather would fail every signal for this one
            errors.append(f"{fn.__name__}: {type(e).__name__}: {e}"[:300])
            return 0.0

    return safe


def _messages(task: Any, problem: Problem, rollout: Rollout, tokenizer: Any) -> list[Any]:
    from verifiers.v1.types import (
        AssistantMessage,
        SystemMessage,
        ToolCall,
        ToolMessage,
        UserMessage,
    )

    out: list[Any] = []
    if task.data.system_prompt:
        out.append(SystemMessage(content=task.data.system_prompt))
    prompt = task.data.prompt
    if isinstance(prompt, str):
        out.append(UserMessage(content=prompt))
    else:
        out.extend(prompt or [])
    if not rollout.turns:  # no spans (a hand-made rollout): the whole response is one reply
        out.append(AssistantMessage(content=rollout.response_text))
        return out
    for turn in rollout.turns:
        ids = rollout.response_ids[turn.start:turn.end]
        call = rollout.tool_calls[turn.tool_call] if turn.tool_call is not None else None
        if turn.role == "tool":
            assert call is not None
            out.append(ToolMessage(tool_call_id=f"call_{turn.tool_call}", name=call.name,
                                   content=call.output))
            continue
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if call is None:
            out.append(AssistantMessage(content=text))
            continue
        content = text.replace(call.raw, "").strip() if call.raw else text
        out.append(AssistantMessage(content=content or None, tool_calls=[ToolCall(
            id=f"call_{turn.tool_call}", name=call.name,
            arguments=json.dumps(call.arguments))]))
    return out


def trace_of(task: Any, problem: Problem, rollout: Rollout, tokenizer: Any) -> Any:
    """The `vf.Trace` of a rollout: a single branch of message nodes (model turns sampled)."""
    import verifiers.v1 as vf
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage

    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                 hash=task.hash),
                  agent=AgentInfo(config=vf.AgentConfig()))
    for i, msg in enumerate(_messages(task, problem, rollout, tokenizer)):
        trace.nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=msg,
                                          sampled=isinstance(msg, AssistantMessage)))
    trace.is_completed = True
    trace.ok = rollout.status.value != "failed"
    trace.stop_condition = {"max_turns": "max_turns", "budget": "max_output_tokens"}.get(
        rollout.stop_reason.value)
    return trace


def _reward(by_id: dict[str, Any], ctx: TaskContext) -> Any:
    tokenizer = ctx.tokenizer

    async def reward(problem: Problem, rollout: Rollout) -> RewardResult:
        task = by_id.get(problem.id)
        if task is None:
            raise KeyError(f"problem {problem.id!r} is not a task of this taskset")
        if rollout.turns and tokenizer is None:
            raise ValueError("scoring a verifiers task needs the tokenizer (TaskContext)")
        trace = trace_of(task, problem, rollout, tokenizer)
        errors: list[str] = []
        scorer = task.with_data()  # a copy: its signals are wrapped, the task is untouched
        hooks = type(task).hooks
        scorer.hooks = lambda attr: [_isolated(fn, errors) for fn in hooks(task, attr)]
        await scorer.score(trace)
        detail = {k: float(r.score) for k, r in trace.rewards.items() if r is not None}
        detail.update({k: float(v) for k, v in trace.metrics.items() if v is not None})
        if errors:
            log.warning("reward_function_raised", rollout_id=rollout.rollout_id,
                        errors=errors)
        return RewardResult(reward=float(trace.reward), status="ok",
                            answer=extract_answer(trace.last_reply), detail=detail,
                            errors=errors)

    return reward


# ------------------------------------------------------------------------------ tools
def _tools(ts_cls: Any, config: Any, task_cls: Any, ctx: TaskContext) -> list[Any]:
    from verifiers.v1.state import State
    from verifiers.v1.utils.decorators import discover_decorated

    from asyncrl.tasks.bridges.functions import function_tool

    servers = list(ts_cls.toolsets(config))
    if task_cls is not None:
        servers += list(task_cls.toolsets(config.task))
    tools = []
    for server in servers:
        if server._state_cls is not State:
            raise ConfigError("task.tools", f"toolset {type(server).__name__} keeps state "
                              f"({server._state_cls.__name__}) over verifiers' state "
                              "channel, which asyncrl does not run: only stateless toolsets "
                              "can be called in-process")
        prefix = server.server_name
        for fn in discover_decorated(server, "tool"):
            base = getattr(fn, "tool_name", None) or fn.__name__
            tools.append(function_tool(fn, name=f"{prefix}_{base}" if prefix else base,
                                       max_output_chars=ctx.max_output_chars,
                                       timeout_s=ctx.tool_timeout_s))
    return tools
