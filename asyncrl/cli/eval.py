"""`asyncrl eval CONFIG --checkpoint PATH --data FILE [--k 16]`: score a policy on a data set.

Owns: the command. Runs the same rollout engine as training (same format, tools, sandbox and
reward, any engine kind), k samples per problem at the eval temperature plus one greedy answer
each (as training's evaluations do), and reports greedy accuracy, avg@k, pass@k, maj@k (per
level too), response length, tool calls and tool-error ratios as a table and JSON
(`asyncrl.observe.evaluation`). Each pass's groups are journaled as they finish
(`asyncrl.observe.journal`): the same command run again after a stop or a kill goes on from
them (`resumed_groups` in the results says how many it found).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec

from asyncrl import config as config_mod
from asyncrl import log as logmod
from asyncrl import modeling
from asyncrl.errors import ConfigError

log = logmod.get_logger(__name__)


async def evaluate(cfg: config_mod.RunConfig, data: str, k: int, out_dir: Path,
                   temperature: float | None = None, max_problems: int = 0,
                   greedy: bool | None = None) -> dict[str, Any]:
    """k samples per problem at `temperature` (default: `eval.temperature`, else the training
    temperature) and, with `greedy` (default: `eval.greedy`), one greedy answer each: the
    figures of `asyncrl.observe.evaluation.with_greedy`, as in training."""
    from asyncrl.observe import metrics as metrics_mod
    from asyncrl.observe.evaluation import format_table, summarize, with_greedy, write_summary
    from asyncrl.observe.journal import GroupJournal, weights_digest
    from asyncrl.records import save_jsonl
    from asyncrl.rollout import RolloutSettings
    from asyncrl.runtime import open_runtime
    from asyncrl.stages import eval_temperature
    from asyncrl.tasks.files import LoadResult
    from asyncrl.tasks.stream import filter_split, held_out_cut
    from asyncrl.templates import end_of_sequence_ids

    temp = eval_temperature(cfg) if temperature is None else temperature
    greedy = cfg.eval.greedy if greedy is None else greedy
    if not data:
        raise ConfigError("data.eval", "no problems to evaluate: set data.eval or pass --data")
    # The runtime opens the task once, its held-out split read from `data`.
    cfg = msgspec.structs.replace(cfg, data=msgspec.structs.replace(cfg.data, eval=data))
    async with open_runtime(cfg, out_dir, with_trainer=False) as rt:
        tools = [t.schema for t in rt.tools] or None
        held = LoadResult(rt.task.held_out, dict(rt.task.skipped.get("eval", {})))
        loaded = filter_split(held, data, "eval", rt.tokenizer, rt.fmt, tools,
                              cfg.data.max_prompt_tokens, rt.runner.system_prompt)
        problems = held_out_cut(loaded.problems, max_problems)
        r = cfg.rollout
        settings = RolloutSettings(
            max_response_tokens=cfg.eval.max_response_tokens or r.max_response_tokens,
            max_turns=r.max_turns, temperature=temp,
            top_p=1.0, tool_format=rt.fmt, tool_output_max_chars=r.tool_output_max_chars,
            stop_token_ids=end_of_sequence_ids(rt.tokenizer),
        )
        t0 = time.monotonic()
        # each pass's groups go to a journal as they finish: the same command run again after
        # a stop or a kill goes on from them (`asyncrl.observe.journal`)
        model = (weights_digest(cfg.model.path) if cfg.model.path
                 else {"init": cfg.model.init, "seed": cfg.run.seed})  # built from its config
        who = {"model": model, "dtype": cfg.model.dtype, "data": data,
               "task": msgspec.to_builtins(cfg.task), "system": rt.runner.system_prompt}
        passes = [GroupJournal.for_pass(out_dir / "eval_groups.jsonl", k, settings, problems,
                                        **who)]
        groups = await passes[0].collect(
            problems, lambda rest: rt.runner.run(rest, k, settings, 0))
        summary = summarize(groups, k)
        stats = metrics_mod.rollout_stats(metrics_mod.group_rollouts(groups), "rollout")
        if greedy and temp > 0:
            plain = msgspec.structs.replace(settings, temperature=0.0)
            passes.append(GroupJournal.for_pass(out_dir / "eval_groups_greedy.jsonl", 1, plain,
                                                problems, **who))
            greedy_groups = await passes[-1].collect(
                problems, lambda rest: rt.runner.run(rest, 1, plain, 0))
            summary = with_greedy(summary, summarize(greedy_groups, 1))
            await asyncio.to_thread(save_jsonl, out_dir / "eval_groups_greedy.jsonl",
                                    greedy_groups)
        summary["temperature"] = temp
        summary["seconds"] = round(time.monotonic() - t0, 2)
        summary["resumed_groups"] = float(sum(j.resumed for j in passes))
        summary["skipped_rows"] = float(loaded.num_skipped)
        summary.update(stats)
    await asyncio.to_thread(save_jsonl, out_dir / "eval_groups.jsonl", groups)
    write_summary(summary, out_dir / "eval.json")
    for j in passes:
        j.remove()
    print(format_table(summary, title=f"eval {data} (k={k}, temperature {temp:g})"))
    return summary


def cmd_eval(args: argparse.Namespace) -> int:
    from asyncrl.rollout.eventloop import run as run_loop

    overrides = list(args.set)
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
        if not (ckpt / "config.json").exists():
            raise ConfigError("--checkpoint", f"{ckpt} is not an HF model directory")
        overrides += [f'model.path="{ckpt}"']
        # the checkpoint's own tokenizer; a LoRA run's final/merged (or final/base) written
        # before the tokenizer went there too has it one level up, in final/
        lora_final = ckpt.name in ("merged", "base") and (
            ckpt.parent / "adapter_config.json").exists()
        tok = next((d for d in (ckpt, *([ckpt.parent] if lora_final else []))
                    if modeling.has_tokenizer(d)), None)
        if tok is not None and not any(o.startswith("tokenizer.path") for o in overrides):
            overrides += [f'tokenizer.path="{tok}"']
    cfg = config_mod.load(args.config, overrides)
    out = Path(args.out) if args.out else Path(cfg.run.output_dir) / f"{cfg.run.name}-eval"
    logmod.configure(cfg.logging.level, cfg.logging.console, run_dir=out)
    summary = run_loop(evaluate(cfg, args.data or cfg.data.eval, args.k or cfg.eval.k, out,
                               args.temperature, args.max_problems, args.greedy))
    print(json.dumps({k: summary[k] for k in sorted(summary)
                      if "@" in k or k == "accuracy" or k.startswith("accuracy/")}))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint: avg@k, pass@k, maj@k, tool use")
    p.add_argument("config", help="the curriculum the model was trained with")
    p.add_argument("--checkpoint", default="", help="HF model directory (default: model.path)")
    p.add_argument("--data", default="", help="problems (JSONL/parquet or generator:NAME); "
                   "default: data.eval")
    p.add_argument("--k", type=int, default=0, help="samples per problem (default: eval.k)")
    p.add_argument("--temperature", type=float, default=None,
                   help="of the k samples (default: eval.temperature, else rollout.temperature)")
    p.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=None,
                   help="also one greedy answer per problem, as `accuracy` (default: eval.greedy)")
    p.add_argument("--max-problems", type=int, default=0,
                   help="evaluate this many of the held-out problems, the same ones every time, "
                        "spread over the set (0: all)")
    p.add_argument("--out", default="", help="output directory (default: runs/NAME-eval)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_eval)
