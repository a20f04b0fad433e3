"""Text environments in the agent loop: an environment answers a turn with an observation and
ends the episode with a reward (the shape of skyrl-gym's `BaseTextEnv` and SkyRL's generator).

Owns `text_env_source(train, eval, make_env)`, a `TaskSource` whose problems each get a fresh
environment per rollout, and the built-in `skyrl_gym` source over skyrl-gym's registered
environments. An environment is any object with skyrl-gym's methods:
- `init(prompt_messages) -> (messages, info)` (called once; its messages are not used: the
  prompt is the problem's question rendered by the run's format);
- `step(action_text) -> {"observations": [messages], "reward": float, "done": bool, ...}`;
- `close()` (optional).
Each assistant turn that ends without a tool call is the action of one `step`: while `done` is
False the observations' text becomes the next user turn (tokens with loss mask 0, turn role
`environment`), as SkyRL appends observation tokens; `done` ends the rollout. A turn cut by the
response budget is stepped when the rollout is rewarded. The rollout's reward is the sum of its
step rewards (each in `reward_detail` as `step_N`). Sync methods run on daemon threads
(`asyncrl.rollout.blocking`: a step that never returns is cut by its deadline and does not
keep the process alive);
an environment that raises fails that rollout only (status `failed`, `error` says
`environment: ...`), never the run.

`skyrl_gym` options: `env` (a registered id: `gsm8k`, `gsm8k_multi_turn`, `aime`, ...),
`env_config` (its config dict), `extras` (merged into each problem's extras; the problem's
answer is `extras.reward_spec.ground_truth`), `train_file`, `eval_file` (SkyRL dataset files,
`.parquet` or `.jsonl`: SkyRL's layout, `prompt` messages with `reward_spec.ground_truth` and
`extra_info`, or asyncrl's `id`, `question`, `answer`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.errors import ConfigError
from asyncrl.records import Problem, RewardResult, Rollout
from asyncrl.rollout.blocking import call_sync
from asyncrl.tasks.task import TaskSource


@dataclass
class _Session:
    env: Any
    rewards: list[float] = field(default_factory=list)
    done: bool = False
    steps_at: set[int] = field(default_factory=set)
    """Assistant turn indices already stepped."""


STEP_SHAPE = ('{"observations": [{"role": "user", "content": str}, ...], "reward": float, '
              '"done": bool, "metadata": {...} (optional)}')
"""What `step` returns (skyrl-gym's `BaseTextEnvStepOutput`)."""


class EnvironmentFault(Exception):
    """A text environment raised or broke its contract. Its text starts `environment: `, the
    same whether the step ran during a turn (the rollout fails) or when the rollout was
    rewarded (a turn cut by the budget: `reward_error`), so each fault is counted once, as
    `rollout/env_error_count`."""


def checked_step(out: Any) -> dict[str, Any]:
    """`step`'s return, checked against `STEP_SHAPE`; `EnvironmentFault` saying what is wrong
    (a gym tuple, a bare string, a missing `done`) otherwise."""
    def bad(why: str) -> EnvironmentFault:
        return EnvironmentFault(f"environment: step returned {why}; expected {STEP_SHAPE}")

    if not isinstance(out, dict):
        kind = "a gym-style tuple" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise bad(kind)
    if "done" not in out or not isinstance(out["done"], bool):
        raise bad("no bool 'done'" if "done" not in out else
                  f"'done' = {out['done']!r}, not a bool")
    reward = out.get("reward", 0.0)
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise bad(f"'reward' = {reward!r}, not a number")
    obs = out.get("observations") or []
    if not isinstance(obs, list) or not all(isinstance(m, dict) for m in obs):
        raise bad(f"'observations' = {obs!r:.60}, not a list of messages")
    return {**out, "reward": float(reward or 0.0), "observations": obs}


class TextEnvRunner:
    """One environment per rollout, keyed by rollout id: `turn` is the agent loop's hook
    (`asyncrl.rollout.agent.EnvHook`), `reward` the run's reward."""

    def __init__(self, problems: dict[str, Problem],
                 make_env: Callable[[Problem], Any]) -> None:
        self.problems = problems
        self.make_env = make_env
        self.sessions: dict[str, _Session] = {}
        self.tokenizer: Any = None
        """Set from the run's `TaskContext` when the reward is built."""

    def bind(self, ctx: Any) -> Any:
        """The reward function, with the run's tokenizer (for a turn the loop did not step)."""
        self.tokenizer = ctx.tokenizer
        return self.reward

    async def _session(self, ro: Rollout) -> _Session:
        sess = self.sessions.get(ro.rollout_id)
        if sess is None:
            problem = self.problems[ro.prompt_id]
            env = await call_sync(self.make_env, problem, what="environment make_env")
            init = getattr(env, "init", None)
            if init is not None:
                await call_sync(init, [{"role": "user", "content": problem.question}],
                                what="environment init")
            sess = self.sessions[ro.rollout_id] = _Session(env)
        return sess

    async def _step(self, sess: _Session, turn: int, text: str) -> dict[str, Any]:
        out = checked_step(await call_sync(sess.env.step, text, what="environment step"))
        sess.steps_at.add(turn)
        sess.rewards.append(float(out["reward"]))
        sess.done = out["done"]
        return out

    async def turn(self, ro: Rollout, text: str) -> str | None:
        sess = await self._session(ro)
        turn = sum(t.role == "assistant" for t in ro.turns) - 1
        out = await self._step(sess, turn, text)
        if sess.done:
            return None
        return "\n".join(str(m.get("content", "")) for m in out.get("observations") or [])

    async def reward(self, problem: Problem, ro: Rollout) -> RewardResult:
        sess = self.sessions.pop(ro.rollout_id, None)
        try:
            last = sum(t.role == "assistant" for t in ro.turns) - 1
            spans = [t for t in ro.turns if t.role == "assistant"]
            if ro.status.value != "failed" and spans and (sess is None or (
                    not sess.done and last not in sess.steps_at)):
                # a turn the loop did not step (cut by the budget): SkyRL steps it too
                if sess is None:
                    self.sessions[ro.rollout_id] = sess = await self._session(ro)
                    self.sessions.pop(ro.rollout_id)
                t = spans[-1]
                if self.tokenizer is None:
                    raise ValueError("stepping a cut turn needs the tokenizer (TaskContext)")
                try:
                    await self._step(sess, last, self.tokenizer.decode(
                        ro.response_ids[t.start:t.end], skip_special_tokens=True))
                except (EnvironmentFault, asyncio.CancelledError):
                    raise
                except Exception as e:  # the environment's: said as during a turn
                    raise EnvironmentFault(f"environment: {e!r}"[:500]) from e
            if sess is None or not sess.rewards:  # never stepped (a failed rollout)
                return RewardResult(reward=0.0, status="no_answer")
            detail = {f"step_{i + 1}": r for i, r in enumerate(sess.rewards)}
            return RewardResult(reward=sum(sess.rewards), status="ok", detail=detail)
        finally:
            close = getattr(sess.env, "close", None) if sess is not None else None
            if close is not None:
                await call_sync(close, what="environment close")


def text_env_source(name: str, train: list[Problem], eval_: list[Problem],
                    make_env: Callable[[Problem], Any], **kw: Any) -> TaskSource:
    """A `TaskSource` whose rollouts each run against `make_env(problem)` (see the module
    docstring). What a plugin returns for an environment of its own. A rollout's environment
    is found by its problem's id, so an id names one problem across both splits: the same
    problem in both (one file as train and eval) is fine, two different problems under one id
    would build one's environment with the other's answer (`ConfigError`)."""
    problems: dict[str, Problem] = {}
    for split, p in [*(("train", p) for p in train), *(("eval", p) for p in eval_)]:
        if p.id in problems and problems[p.id] != p:
            raise ConfigError("data.generator_options", f"{name}: two different problems "
                              f"have the id {p.id!r} (the second in the {split} split): each "
                              "needs its own, since its environment is found by it")
        problems[p.id] = p
    runner = TextEnvRunner(problems, make_env)

    def probe() -> None:  # config check's trial: one environment, built and closed
        env = make_env(train[0]) if train else None
        close = getattr(env, "close", None)
        if close is not None:
            close()

    return TaskSource(name=name, train=train, eval=eval_, reward=runner.bind,
                      env=lambda ctx: runner.turn, probe=probe, **kw)


SKYRL_OPTIONS: dict[str, Any] = {"env": "", "env_config": {}, "extras": {}, "train_file": "",
                                 "eval_file": ""}


def _rows(path: str) -> list[dict[str, Any]]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return list(pq.read_table(path).to_pylist())
    with open(path, encoding="utf-8") as fp:
        return [json.loads(line) for line in fp if line.strip()]


def read_skyrl_rows(path: str, key: str, split: str = "train"
                    ) -> tuple[list[Problem], list[dict[str, Any]], dict[str, int]]:
    """Problems from a SkyRL dataset file (`.parquet` or `.jsonl`): SkyRL's layout (`prompt`
    chat messages, `reward_spec.ground_truth`, `extra_info`) or asyncrl's (`id`, `question`,
    `answer`). A row without an `id` (SkyRL's layout has none) is `{split}-row-{i}`, so the
    rows of a train and an eval file never share one. Returns the problems, each one's
    extras, and the rows skipped by reason."""
    try:
        rows = _rows(path)
    except (OSError, ValueError) as e:
        raise ConfigError(key, f"cannot read {path}: {e}") from None
    problems: list[Problem] = []
    extras: list[dict[str, Any]] = []
    skipped: dict[str, int] = {}
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        question = row.get("question")
        if question is None and isinstance(prompt, list):
            users = [m.get("content") for m in prompt if m.get("role") == "user"]
            question = users[-1] if users else None
        spec = row.get("reward_spec") or {}
        answer = row.get("answer", spec.get("ground_truth") if isinstance(spec, dict) else None)
        if not isinstance(question, str) or not question.strip() or answer is None:
            skipped["missing_field"] = skipped.get("missing_field", 0) + 1
            continue
        problems.append(Problem(id=str(row.get("id", f"{split}-row-{i}")), question=question,
                                answer=str(answer)))
        extras.append({k: row[k] for k in ("extra_info",) if isinstance(row.get(k), dict)})
    return problems, extras, skipped


def skyrl_source(options: dict[str, Any], seed: int) -> TaskSource:
    """The built-in `skyrl_gym` source (options in the module docstring)."""
    unknown = sorted(set(options) - set(SKYRL_OPTIONS))
    if unknown:
        raise ConfigError("data.generator_options", f"skyrl_gym: unknown option {unknown[0]!r}; "
                          f"known: {', '.join(SKYRL_OPTIONS)}")
    opts = {**SKYRL_OPTIONS, **options}
    import skyrl_gym
    from skyrl_gym.envs.registration import registry

    env_id = opts["env"]
    if env_id not in registry:
        import difflib

        close = difflib.get_close_matches(str(env_id), list(registry), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError("data.generator_options.env", f"skyrl_gym: unknown environment "
                          f"{env_id!r}{hint} (registered: {', '.join(sorted(registry))})")
    if not opts["train_file"]:
        raise ConfigError("data.generator_options.train_file", "skyrl_gym: name the dataset "
                          "file (SkyRL's parquet/jsonl layout, or rows id, question, answer)")
    train, x_train, d_train = read_skyrl_rows(opts["train_file"],
                                              "data.generator_options.train_file")
    eval_, x_eval, d_eval = (read_skyrl_rows(opts["eval_file"],
                                             "data.generator_options.eval_file", "eval")
                             if opts["eval_file"] else ([], [], {}))
    extras_of = {p.id: x for p, x in zip([*train, *eval_], [*x_train, *x_eval], strict=True)}

    def make_env(problem: Problem) -> Any:
        extras = {"extra_info": {}, **extras_of.get(problem.id, {}), **opts["extras"],
                  "reward_spec": {"ground_truth": problem.answer}}
        return skyrl_gym.make(env_id, env_config=opts["env_config"], extras=extras)

    return text_env_source(f"skyrl_gym/{env_id}", train, eval_, make_env,
                           dropped=d_train, dropped_eval=d_eval)
