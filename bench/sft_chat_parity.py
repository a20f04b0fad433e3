"""The tiny curriculum's SFT stage two ways: generated transcripts vs the same transcripts
exported as chat JSONL and trained through the chat-file path (`[stages.chat]`).

Arm `generator`: `curricula/tiny.toml` with its SFT stage alone (seed `--seed`). Arm `chat`:
the transcripts that stage would generate (`asyncrl.sft.coldstart.export_chat`: same problems, same
draws, in order) written to a JSONL file of OpenAI-style messages, then the same stage with
`[stages.chat] train = [that file]` (shuffled each epoch, batched by the chat path). Both runs
evaluate held-out accuracy after SFT (greedy rollouts on the tiny eval set, `eval/accuracy` of
the `after_sft` evaluation). Reported per arm: the mean SFT loss over the last 50 steps (the
loop logs it every 10), the held-out loss of the final weights on 256 transcripts of the eval
problems (`trainer.sft_eval`, the same set for both), the held-out accuracy and the wall time.
Prints a table, writes `bench/results/sft_chat_parity.json`.

    nice -n 10 python bench/sft_chat_parity.py [--seed 0] [--steps 600] [--bucket]
                                               [--no-shuffle] [--set KEY=VALUE ...]

Tens of minutes on 2 shared CPU cores; not part of the tests.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
import tomllib
from pathlib import Path
from statistics import fmean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
RUNS = ROOT / "runs" / "sft_parity"


def _config(base: dict[str, Any], name: str, steps: int, chat: str | None,
            overrides: list[str], bucket: bool = False, shuffle: bool = True) -> Any:
    from asyncrl import config

    d = copy.deepcopy(base)
    d["run"] = {**d["run"], "name": name, "output_dir": str(RUNS)}
    sft = {**d["stages"][0], "steps": steps}
    if chat is not None:
        sft["chat"] = {"train": [chat], "max_tokens": 1024, "bucket_by_length": bucket,
                       "shuffle": shuffle}
    d["stages"] = [sft]
    d["logging"] = {**d.get("logging", {}), "console": "none"}
    return config.from_dict(config.apply_overrides(d, overrides))


def _rows(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in rows if r["kind"] == kind]


def _split(cfg: Any, tok: Any, fmt: Any, tools: Any, split: str) -> tuple[list[Any], Any]:
    """The problems of `split` as the train loop filters them, and the task's solution
    programs."""
    from asyncrl.tasks.open import TaskSpec, load_task
    from asyncrl.tasks.stream import filter_split

    d = cfg.data
    loaded = load_task(TaskSpec.of(cfg, splits=(split,)))
    res = loaded.train if split == "train" else loaded.eval
    kept = filter_split(res, getattr(d, split), split, tok, fmt, tools, d.max_prompt_tokens,
                        d.system_prompt)
    return kept.problems, loaded.solution_code


def _export(cfg: Any, tok: Any, path: Path) -> int:
    """The transcripts the generator path trains on, as chat rows (see asyncrl.sft.stage.generator_pairs)."""
    from asyncrl import formats
    from asyncrl.sft import coldstart as sft
    from asyncrl.sft.stage import draw_problems

    fmt = formats.get_format(cfg.rollout.tool_format)
    d, st = cfg.data, cfg.stages[0]
    tools = [formats.PYTHON_TOOL_SCHEMA] if cfg.rollout.tools else None
    train, code_for = _split(cfg, tok, fmt, tools, "train")
    n = st.examples or st.steps * (st.batch_size or 16)
    probs = draw_problems(train, n, cfg.run.seed, cfg.data.shuffle)
    return sft.export_chat(probs, fmt, random.Random(cfg.run.seed), path,
                           tool_fraction=st.tool_fraction, fail_fix_fraction=st.fail_fix_fraction,
                           fail_fix_by_level={int(k): v for k, v in st.fail_fix_by_level.items()},
                           tool_fraction_by_level={
                               int(k): v for k, v in st.tool_fraction_by_level.items()},
                           tools=tools, system_prompt=d.system_prompt,
                           max_chars=cfg.rollout.tool_output_max_chars, code_for=code_for)


def _held_out_loss(cfg: Any, run_dir: Path) -> float:
    """Token-mean NLL of the final weights on transcripts of the eval problems."""
    from asyncrl import formats, modeling
    from asyncrl.sft import coldstart as sft
    from asyncrl.trainer import TRAINER_KINDS

    tok = modeling.load_tokenizer(run_dir / "final")
    model = modeling.load_model(run_dir / "final")
    fmt = formats.get_format(cfg.rollout.tool_format)
    d = cfg.data
    tools = [formats.PYTHON_TOOL_SCHEMA]
    evals, solution_code = _split(cfg, tok, fmt, tools, "eval")
    probs = [evals[i % len(evals)] for i in range(256)]
    st = cfg.stages[0]
    ex = sft.build_sft_examples(probs, fmt, tok, random.Random(12345), code_for=solution_code,
                                tool_fraction=st.tool_fraction,
                                fail_fix_fraction=st.fail_fix_fraction, tools=tools,
                                system_prompt=d.system_prompt)
    trainer = TRAINER_KINDS["torch"](model, cfg.trainer, cfg.algorithm,
                                     pad_token_id=tok.pad_token_id)
    m = trainer.sft_eval([(e.input_ids, e.loss_mask) for e in ex])
    return float(m["sft/loss"])


def _arm(cfg: Any) -> dict[str, Any]:
    from asyncrl.rollout.eventloop import run as run_loop
    from asyncrl.train import train_async

    t0 = time.monotonic()
    rd = run_loop(train_async(cfg, run_dir=str(RUNS / cfg.run.name)))
    wall = time.monotonic() - t0
    steps = _rows(rd, "sft_step")
    tail = [r["sft/loss"] for r in steps if r["sft_step"] > cfg.stages[0].steps - 50]
    acc = [r["eval/accuracy"] for r in _rows(rd, "eval") if r["label"] == "after_sft"]
    return {"run_dir": str(rd), "final_loss_last50": fmean(tail),
            "held_out_loss": _held_out_loss(cfg, rd), "held_out_accuracy": acc[0],
            "wall_s": round(wall, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="SFT steps (default: the curriculum's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--bucket", action="store_true",
                    help="chat arm: [stages.chat] bucket_by_length = true")
    ap.add_argument("--no-shuffle", action="store_true",
                    help="chat arm: [stages.chat] shuffle = false (the generator's order)")
    args = ap.parse_args()
    base = tomllib.loads((ROOT / "curricula" / "tiny.toml").read_text())
    base["run"]["seed"] = args.seed
    steps = args.steps or base["stages"][0]["steps"]
    tag = f"s{args.seed}-{steps}"
    gen_cfg = _config(base, f"generator-{tag}", steps, None, args.set)
    out: dict[str, Any] = {"seed": args.seed, "steps": steps, "overrides": args.set,
                           "bucket_by_length": args.bucket, "shuffle": not args.no_shuffle}
    RESULTS.mkdir(parents=True, exist_ok=True)
    partial = RESULTS / "sft_chat_parity.json"
    out["generator"] = _arm(gen_cfg)
    partial.write_text(json.dumps(out, indent=2) + "\n")  # kept if the second arm is stopped
    from asyncrl import modeling

    tok = modeling.load_tokenizer(Path(out["generator"]["run_dir"]) / "model-init")
    chat_file = RUNS / f"tiny-sft-{tag}.jsonl"
    out["chat_rows"] = _export(gen_cfg, tok, chat_file)
    name = f"chat-{tag}{'-bucket' if args.bucket else ''}{'-ordered' if args.no_shuffle else ''}"
    out["chat"] = _arm(_config(base, name, steps, str(chat_file), args.set, args.bucket,
                               not args.no_shuffle))
    print(f"{'arm':<10} {'loss (last 50)':>15} {'held-out loss':>14} {'held-out acc':>13} "
          f"{'wall s':>8}")
    for arm in ("generator", "chat"):
        r = out[arm]
        print(f"{arm:<10} {r['final_loss_last50']:>15.4f} {r['held_out_loss']:>14.4f} "
              f"{r['held_out_accuracy']:>13.3f} {r['wall_s']:>8.1f}")
    partial.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
