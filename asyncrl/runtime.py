"""Builds a run's components from its config and owns their lifetimes.

Owns: turning config sections into live objects — the task (its problems loaded once, then
bound: `asyncrl.tasks.open`), tokenizer and model (loaded, or built on the spot for tiny runs),
trainer, engines, sandbox pool/client — and closing them in reverse order, also on error or
cancellation. Each component receives its own section only.
Does not own: what is done with them (`train.py`, `eval` command).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from asyncrl import formats, modeling, templates
from asyncrl.config import LocalSandboxConfig, RunConfig
from asyncrl.errors import AsyncRLError, ConfigError
from asyncrl.log import get_logger
from asyncrl.rollout.eventloop import freeze_gc

if TYPE_CHECKING:
    from asyncrl.engine.base import Engine
    from asyncrl.rollout import RewardFn, RolloutRunner, Tool
    from asyncrl.tasks.open import LoadedTask
    from asyncrl.tasks.task import Task, TaskSource
    from asyncrl.trainer.base import Trainer
    from asyncrl.weightsync.group import WeightGroup

log = get_logger(__name__)


@dataclass
class Runtime:
    """The live components of a run, each behind its protocol: the loop sees no concrete kind."""

    cfg: RunConfig
    run_dir: Path
    tokenizer: Any
    """A Hugging Face tokenizer (`PreTrainedTokenizerBase`; typed loosely to keep this module
    free of transformers)."""
    trainer: Trainer | None
    """None when opened `with_trainer=False` (evaluation)."""
    engines: list[Engine]
    runner: RolloutRunner
    task: Task
    """What the run trains on, opened once: both splits' problems (before the prompt-length
    filter), tools, reward, environment, solution programs; closed with the runtime."""
    fmt: formats.ToolFormat
    sandbox_isolation: str
    weight_group: WeightGroup | None = None
    """`weight_sync = "distributed"`: the trainer's process group with the SGLang servers
    (`asyncrl.weightsync.group.WeightGroup`, formed at the first push, ended with the
    runtime); None otherwise."""

    @property
    def tools(self) -> list[Tool]:
        return self.task.tools

    @property
    def reward(self) -> RewardFn:
        """`[task] reward` built (`asyncrl.tasks.wiring.build_reward`)."""
        return self.task.reward_fn

    def need_trainer(self) -> Trainer:
        """The trainer; a runtime opened for evaluation has none."""
        if self.trainer is None:
            raise AsyncRLError("this runtime was opened without a trainer (with_trainer=False)")
        return self.trainer

    async def release_engine_caches(self) -> None:
        """Engines that hold a cache between requests in this process (the local engine's
        batch) give it back now (`LocalEngine.release`); others have nothing here to give."""
        from asyncrl.engine.local.engine import LocalEngine

        for e in self.engines:
            if isinstance(e, LocalEngine):
                await e.release()


def build_tokenizer_and_model(cfg: RunConfig, run_dir: Path,
                              loaded: LoadedTask | None = None) -> tuple[Any, Any]:
    """Load the model and tokenizer, or (tiny runs) make them and save them under `run_dir`
    (a tokenizer trained on the task's text: `loaded`, else the task is loaded for it)."""
    if cfg.model.path:
        tok = modeling.load_tokenizer(cfg.tokenizer.path or cfg.model.path)
        model = modeling.load_model(cfg.model.path, cfg.model.dtype, cfg.model.trust_remote_code)
        return tok, model
    init_dir = run_dir / "model-init"
    if (init_dir / "config.json").exists():  # resumed or re-run: same tokenizer and init
        return modeling.load_tokenizer(init_dir), modeling.load_model(init_dir, cfg.model.dtype)
    if cfg.tokenizer.path:
        tok = modeling.load_tokenizer(cfg.tokenizer.path)
    elif cfg.tokenizer.train_on == "task_corpus":
        tok = modeling.train_tokenizer(_tokenizer_corpus(cfg, loaded), cfg.tokenizer.vocab_size)
    else:
        raise ConfigError("tokenizer.train_on", "a model built from model.init needs a tokenizer: "
                          "set tokenizer.path, or tokenizer.train_on = \"task_corpus\" to train "
                          "one on the task's text")
    model = modeling.build_model(cfg.model.init, tok, seed=cfg.run.seed, dtype=cfg.model.dtype)
    modeling.save(model, tok, init_dir)
    log.info("model_built", path=str(init_dir), params=sum(p.numel() for p in model.parameters()),
             vocab=len(tok))
    return tok, model


def _tokenizer_corpus(cfg: RunConfig, loaded: LoadedTask | None) -> list[str]:
    """Every text the model will read or write: a built-in family's SFT transcripts, else the
    training problems' questions and answers and a plugin source's whole prompts."""
    import dataclasses

    from asyncrl.tasks.families import TASK_FAMILIES
    from asyncrl.tasks.open import TaskSpec, load_task

    spec = TaskSpec.of(cfg, splits=("train",))
    if loaded is None or loaded.train is None:
        loaded = load_task(spec if loaded is None else dataclasses.replace(loaded.spec,
                                                                           splits=("train",)))
    src = loaded.source
    if src is not None and src.name in TASK_FAMILIES and src.solution_code is not None:
        from asyncrl.sft.coldstart import corpus

        return list(corpus(src.name, src.train, src.solution_code, cfg.run.seed))
    assert loaded.train is not None
    probs = loaded.train.problems
    return [p.question for p in probs] + [p.answer for p in probs] + _source_texts(cfg, src)


def _source_texts(cfg: RunConfig, source: TaskSource | None) -> list[str]:
    """Whole prompts of a plugin task source (its system text and tool schemas included):
    text the model reads on every problem, so the tokenizer should have words for it."""
    from asyncrl.tasks.task import TaskContext
    from asyncrl.tasks.wiring import system_text

    if source is None or source.tools is None or not cfg.rollout.tools:
        return []
    schemas = [t.schema for t in source.tools(TaskContext())] or None
    fmt = formats.get_format(cfg.rollout.tool_format)
    system = system_text(cfg.data.system_prompt, source.system_prompt, fmt, schemas)
    return [formats.render_prompt(p.question, fmt, schemas, system) for p in source.train[:64]]


@contextlib.asynccontextmanager
async def open_sandbox(cfg: RunConfig) -> AsyncIterator[tuple[Any, Any]]:
    """(client for the model's tool calls, pool hosting the reward's checker).

    The reward checker gets its own small pool: it needs `asyncrl` importable (the project
    directory on its path) and math-verify preloaded, which the pool running model-written code
    must not have.
    """
    from asyncrl.tasks.open import reward_host_config
    from sandbox import HttpSandboxClient, LocalSandboxClient, PoolConfig, SandboxPool
    from sandbox.config import IsolationLevel

    reward_cfg = reward_host_config()
    sb = cfg.sandbox
    token = None
    if not isinstance(sb, LocalSandboxConfig):  # read before anything starts: fail fast
        from asyncrl.errors import ConfigError
        from sandbox.auth import load_token
        from sandbox.errors import SandboxConfigError

        try:
            token = load_token(sb.token_file or None, sb.token_env or None)
        except SandboxConfigError as exc:
            raise ConfigError("sandbox.token_file" if sb.token_file else "sandbox.token_env",
                              str(exc)) from None
    async with contextlib.AsyncExitStack() as stack:
        # Both pools start at once (each start waits on its workers' imports: 2.2 s and 1.7 s
        # one after the other on a tiny run); a pool not started, or half started when the
        # other failed, closes like one that ran.
        pools = [SandboxPool(reward_cfg)]
        if isinstance(sb, LocalSandboxConfig):
            pools.append(SandboxPool(PoolConfig(
                workers=sb.workers, isolation=IsolationLevel(sb.isolation),
                time_limit_s=sb.time_limit_s, memory_mb=sb.memory_mb,
                max_output_bytes=sb.max_output_bytes)))
        for p in pools:
            stack.push_async_callback(p.aclose)
        try:
            async with asyncio.TaskGroup() as starting:
                for p in pools:
                    starting.create_task(p.start())
        except BaseExceptionGroup as group:  # the first failure, as a lone start raises it
            raise group.exceptions[0] from None
        reward_pool = pools[0]
        client: LocalSandboxClient | HttpSandboxClient
        if isinstance(sb, LocalSandboxConfig):
            client = await stack.enter_async_context(LocalSandboxClient(pools[1]))
        else:
            client = await stack.enter_async_context(HttpSandboxClient(
                sb.urls, batch_size=sb.batch_size, batch_window_ms=sb.batch_window_ms,
                call_timeout_s=sb.call_timeout_s, stall_timeout_s=sb.stall_timeout_s,
                token=token))
        yield client, reward_pool


def _copy_serially(model: Any, share_parameters: bool = False) -> Any:
    """A deep copy of `model`, made with one torch thread. `share_parameters`: the copy's
    parameters hold the original's tensors (frozen views of the same storage, ties kept), so
    only its modules and buffers are new: the engine's model under `weight_sync = "shared"`.

    A tensor copy above torch's grain size runs as an OpenMP parallel region, and the first one
    a thread runs leaves that thread a pool of OpenMP workers for the rest of the process. Made
    here, on the event loop's thread, that pool would sit beside the trainer's and the engine's:
    with more OpenMP threads than cores, libgomp stops spinning between regions, and every SFT
    step on a 2-core machine took 1.5x as long (bench/sft_step.py --main-pool shows it)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        memo: dict[int, Any] = {}
        if share_parameters:
            memo = {id(p): torch.nn.Parameter(p.detach(), requires_grad=False)
                    for p in model.parameters()}
        return copy.deepcopy(model, memo)
    finally:
        torch.set_num_threads(n)


@contextlib.asynccontextmanager
async def open_runtime(cfg: RunConfig, run_dir: Path, *, with_trainer: bool = True
                       ) -> AsyncIterator[Runtime]:
    """Build every component; close them all on exit (also on error or cancellation).
    `with_trainer=False` (evaluation) builds no trainer and no optimizer state."""
    from asyncrl.stages import check_source_weights
    from asyncrl.tasks.open import TaskSpec, load_task

    # The task's problems are read once, first: a tiny run's tokenizer is trained on them.
    # An evaluation reads only the held-out split (its training file may not be here).
    loaded = load_task(TaskSpec.of(cfg, splits=("train", "eval") if with_trainer
                                   else ("eval",)))
    if with_trainer and loaded.train is not None:  # a mix naming no source: fail before a model
        check_source_weights(cfg.stages, loaded.train.problems, cfg.run.seed)
    async with contextlib.AsyncExitStack() as stack:
        # The sandbox's workers start (other processes) while the model is built or loaded
        # in a worker thread: a tiny run spent 8.5 s on the model (mostly importing
        # transformers) and then 4.5 s on the two pools, one after the other.
        build = asyncio.ensure_future(asyncio.to_thread(_build_serially, cfg, run_dir, loaded))
        try:
            client, reward_host = await stack.enter_async_context(open_sandbox(cfg))
        except BaseException:
            await asyncio.wait([build])  # a thread cannot be cancelled: let it finish first
            if not build.cancelled() and isinstance(build.exception(), ConfigError):
                raise cast(ConfigError, build.exception()) from None  # the config comes first
            raise
        tok, model = await build
        runtime = await _assemble(stack, cfg, run_dir, loaded, tok, model, client, reward_host,
                                  with_trainer)
        # What was just built lives as long as the runtime: frozen, it is not scanned by each
        # full collection (`quiet_gc` runs one after every batch of rollouts; a tiny run's 14
        # took 4.5 s with transformers' modules unfrozen). Thawed on the way out, so that a
        # process opening runtimes one after another frees the cycles of the ones it closed.
        freeze_gc()
        try:
            yield runtime
        finally:
            gc.unfreeze()


def _build_serially(cfg: RunConfig, run_dir: Path, loaded: LoadedTask) -> tuple[Any, Any]:
    """`build_tokenizer_and_model` with torch held to one thread in the calling (worker)
    thread: a parallel region run there would leave it a pool of OpenMP workers beside the
    trainer's and the engine's for the rest of the process (see `_copy_serially`)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build_tokenizer_and_model(cfg, run_dir, loaded)
    finally:
        torch.set_num_threads(n)


async def _assemble(stack: contextlib.AsyncExitStack, cfg: RunConfig, run_dir: Path,
                    loaded: LoadedTask, tok: Any, model: Any, client: Any, reward_host: Any,
                    with_trainer: bool) -> Runtime:
    """The rest of `open_runtime`, once the model and the sandbox are up: trainer, engines,
    the bound task and the rollout runner, each closed by `stack`."""
    from asyncrl.engine.registry import build_engines
    from asyncrl.rollout import RolloutRunner
    from asyncrl.rundir import write_prompt
    from asyncrl.tasks.open import bind
    from asyncrl.tasks.task import TaskContext
    from asyncrl.tasks.wiring import system_text
    from asyncrl.trainer import TRAINER_KINDS

    # Prompts and tool responses in the model's own chat template when it has a usable one:
    # the ids of a rollout are then the ids the template renders (asyncrl.templates).
    fmt = templates.bind_format(formats.get_format(cfg.rollout.tool_format), tok,
                                cfg.data.chat_template)
    # The local engine generates with its own copy: the trainer owns the training module. The
    # copy is taken first, since a LoRA trainer changes the model's layers in place.
    # With `weight_sync = "shared"` (a synchronous run) the copy's parameters are the trainer's
    # own tensors, taken once the trainer has placed them.
    shared = with_trainer and getattr(cfg.engine, "weight_sync", "") == "shared"
    engine_model = None
    if cfg.engine.kind == "local" and not shared:
        engine_model = _copy_serially(model).eval() if with_trainer else model.eval()
    trainer = None if not with_trainer else TRAINER_KINDS[cfg.trainer.kind](
        model, cfg.trainer, cfg.algorithm, pad_token_id=tok.pad_token_id,
        temperature=cfg.rollout.temperature or 1.0, seed=cfg.run.seed)
    if shared:
        engine_model = _copy_serially(model, share_parameters=True).eval()
    # Routing replay (MoE): the engines record each token's experts for the trainer.
    replay = with_trainer and modeling.routing_replay(cfg.algorithm.routing_replay,
                                                      model.config)
    engines = build_engines(cfg.engine, model=engine_model, tokenizer=tok, run_dir=run_dir,
                            model_path=cfg.model.path or str(run_dir / "model-init"),
                            record_routing=replay,
                            routing_shape=(modeling.moe_shape(model.config) or ())[:2])
    for e in engines:
        if hasattr(e, "__aenter__"):
            await stack.enter_async_context(cast(contextlib.AbstractAsyncContextManager[Any],
                                             e))
        else:
            stack.push_async_callback(e.close)
    weight_group = None
    if with_trainer and getattr(cfg.engine, "weight_sync", "") == "distributed":
        weight_group = await stack.enter_async_context(
            _weight_group(cfg.engine, getattr(trainer, "device", None)))
    # The task's reward and tools come from `[task]` (built-in or plugins) and the task
    # source `data.train` names (a verifiers taskset brings its own: asyncrl.tasks).
    ctx = TaskContext(tokenizer=tok, sandbox=client, reward_host=reward_host,
                      time_limit_s=getattr(cfg.sandbox, "time_limit_s", 4.0),
                      max_output_chars=cfg.rollout.tool_output_max_chars,
                      tool_timeout_s=cfg.rollout.tool_timeout_s,
                      show_time=formats.shows_tool_time(cfg.rollout.tool_time,
                                                        cfg.rollout.seed_requests))
    task = bind(loaded, ctx)
    if task.close is not None:
        stack.callback(task.close)
    why = fmt.uncallable([t.name for t in task.tools])
    if why:  # config check says so first; an embedding program gets the same rule
        from asyncrl.tasks.check import FORMAT_FIX

        raise ConfigError("rollout.tool_format", f"{why}: {FORMAT_FIX}")
    system = system_text(cfg.data.system_prompt, task.system_prompt, fmt,
                         [t.schema for t in task.tools] or None)
    if with_trainer:  # what an embedding program needs to render the trained prompt
        write_prompt(run_dir, system, [t.schema for t in task.tools])
    runner = RolloutRunner(engines, tok, task.tools, task.reward_fn, system_prompt=system,
                           env=task.env, reward_timeout_s=cfg.rollout.reward_timeout_s)
    isolation = getattr(client, "isolation", "unknown")
    log.info("runtime_ready", engines=[e.name for e in engines], sandbox=cfg.sandbox.kind,
             isolation=isolation, trainer=cfg.trainer.kind)
    return Runtime(cfg=cfg, run_dir=run_dir, tokenizer=tok, trainer=trainer, engines=engines,
                   runner=runner, task=task, fmt=fmt,
                   sandbox_isolation=str(isolation), weight_group=weight_group)


def _weight_group(eng: Any, trainer_device: Any) -> WeightGroup:
    """The distributed weight sync's group (closed before the engines: it is entered after
    them). Rank 0 broadcasts from the trainer's CUDA device, else over gloo from the CPU."""
    from asyncrl.weightsync.group import WeightGroup

    device = trainer_device if getattr(trainer_device, "type", "") == "cuda" else "cpu"
    return WeightGroup(address=eng.weight_group_address, port=eng.weight_group_port,
                       bucket_bytes=eng.weight_bucket_mb << 20, device=device)
