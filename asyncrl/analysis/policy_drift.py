"""How far RL moved the policy from its cold start, and where: KL to the cold-start policy by
part of the answer, and the relative weight change by parameter group.

The cold start's sampled evaluation answers (`COLD/eval/*.jsonl`, drawn from the SFT policy at
the training temperature) are a fixed sample of what that policy writes. For each RL checkpoint
(`RUN/checkpoints/step_*/trainer/trainer.pt`), both models run over those answers and, at every
model-written position, the exact KL(pi_cold || pi_step) over the whole vocabulary at
temperature 1 is taken. Averaged per answer and split by part (`answer_parts.CLASSES`), it says
which behaviour an update moved: the choice RL is meant to move, or the copies of numbers it
should leave alone. Beside it, ||w - w_cold|| / ||w_cold|| for the embedding, the attention, the
MLPs and the norms. `bench/policy_drift.py` prints it.

Reads full-weight checkpoints of the torch trainer (a LoRA checkpoint is refused); torch and
transformers are imported when something is measured, not with the module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from asyncrl.analysis.answer_parts import CLASSES, classify
from asyncrl.errors import DataError, ModelError

GROUPS = ("embedding", "attention", "mlp", "norms")


def param_group(name: str) -> str:
    """The group (`GROUPS`) a parameter of a Llama-style model belongs to."""
    if "embed_tokens" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norms"
    if "self_attn" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    raise ValueError(f"unplaced parameter {name}")


def cold_answers(cold: Path, tokenizer: Any, limit: int) -> list[dict[str, Any]]:
    """The cold start's sampled eval answers: ids, the positions the model wrote, their parts."""
    files = [f for f in sorted(cold.glob("eval/*.jsonl")) if not f.stem.endswith("-greedy")]
    if not files:
        raise DataError(f"{cold}: no sampled evaluation (eval/*.jsonl) to measure on")
    out = []
    for line in files[0].read_text().splitlines():
        for r in json.loads(line)["rollouts"] if line else []:
            pieces = [tokenizer.decode([t]) for t in r["response_ids"]]
            out.append({"ids": r["prompt_ids"] + r["response_ids"], "start": len(r["prompt_ids"]),
                        "mask": r["loss_mask"], "parts": classify(pieces)})
            if len(out) >= limit:
                return out
    return out


def response_logprobs(model: Any, answers: list[dict[str, Any]], batch: int = 32) -> list[Any]:
    """Per answer, log-softmax over the vocabulary at each response position (float64)."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(answers), batch):
            chunk = answers[i:i + batch]
            width = max(len(a["ids"]) for a in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            att = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, a in enumerate(chunk):
                ids[j, :len(a["ids"])] = torch.tensor(a["ids"])
                att[j, :len(a["ids"])] = 1
            logits = model(input_ids=ids, attention_mask=att).logits.double()
            for j, a in enumerate(chunk):
                # position t predicts token t+1: the response tokens are predicted from start-1 on
                span = logits[j, a["start"] - 1:len(a["ids"]) - 1]
                out.append(torch.log_softmax(span, dim=-1))
    return out


def drift(cold_lp: list[Any], lp: list[Any], answers: list[dict[str, Any]]) -> dict[str, float]:
    """Mean summed KL(cold || this) per answer, by part, over the model-written positions."""
    import torch

    totals = dict.fromkeys(CLASSES, 0.0)
    for a, p, q in zip(answers, cold_lp, lp, strict=True):
        kl = (p.exp() * (p - q)).sum(-1)
        for k, part, mine in zip(kl.tolist(), a["parts"], a["mask"], strict=True):
            if mine:
                totals[part] += k
    n = max(len(answers), 1)
    per = {k: v / n for k, v in totals.items()}
    return {**per, "total": sum(per.values()), "per_token": float(torch.tensor(
        sum(totals.values())) / max(1, sum(sum(a["mask"]) for a in answers)))}


def weight_change(cold: dict[str, Any], state: dict[str, Any]) -> dict[str, float]:
    """||w - w_cold|| / ||w_cold|| per parameter group, over the names both states hold."""
    num = dict.fromkeys(GROUPS, 0.0)
    den = dict.fromkeys(GROUPS, 0.0)
    for name, w0 in cold.items():
        if name not in state:
            continue
        g = param_group(name)
        num[g] += float((state[name].double() - w0.double()).pow(2).sum())
        den[g] += float(w0.double().pow(2).sum())
    return {g: (num[g] / den[g]) ** 0.5 if den[g] else 0.0 for g in GROUPS}


def label(run: Path) -> str:
    """The run's folder and its parent's: ablation arms share names across output folders."""
    return f"{run.parent.name}/{run.name}" if run.parent.name else run.name


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, trainer.pt) of each full checkpoint of a run, by step."""
    found = []
    for d in run.glob("checkpoints/step_*"):
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and (d / "trainer" / "trainer.pt").is_file():
            found.append((int(m.group(1)), d / "trainer" / "trainer.pt"))
    return sorted(found)


def measure(cold: Path, runs: list[Path], max_answers: int) -> tuple[int, list[dict[str, Any]]]:
    """(number of cold-start answers measured on, one row per checkpoint of each run: run, step,
    `kl` (`drift`) and `weights` (`weight_change`)). Raises `DataError` for a run without
    checkpoints or a cold start without a sampled evaluation, `ModelError` for weights that are
    LoRA or do not fit the cold start's model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = cold / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    answers = cold_answers(cold, tokenizer, max_answers)
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    cold_state = {k: v.clone() for k, v in model.state_dict().items()}
    cold_lp = response_logprobs(model, answers)
    rows = []
    for run in runs:
        found = checkpoints(run)
        if not found:
            raise DataError(f"{run}: no checkpoints/step_*/trainer/trainer.pt")
        for step, path in found:
            saved = torch.load(path, map_location="cpu", weights_only=False)
            if saved.get("lora", {}).get("attached"):
                raise ModelError(f"{path}: a LoRA checkpoint; this measure reads full weights")
            model.load_state_dict(cold_state)
            missing, unexpected = model.load_state_dict(saved["model"], strict=False)
            if unexpected or any("lm_head" not in k for k in missing):
                raise ModelError(f"{path}: weights do not fit the cold start's model "
                                 f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
            rows.append({"run": str(run), "step": step,
                         "kl": drift(cold_lp, response_logprobs(model, answers), answers),
                         "weights": weight_change(cold_state, model.state_dict())})
    return len(answers), rows


def markdown(rows: list[dict[str, Any]], n_answers: int) -> str:
    """`measure`'s rows as a titled markdown table, one row per checkpoint."""
    head = ["run", "step", *(f"KL {c}" for c in CLASSES), "KL total", "KL/token",
            *(f"dw {g}" for g in GROUPS)]
    lines = [f"KL(cold start || step) summed per answer over {n_answers} cold-start samples; "
             "dw = ||w - w_cold|| / ||w_cold||",
             "| " + " | ".join(head) + " |\n|" + "---|" * len(head)]
    for r in rows:
        cells = [label(Path(r["run"])), str(r["step"]), *(f"{r['kl'][c]:.4f}" for c in CLASSES),
                 f"{r['kl']['total']:.4f}", f"{r['kl']['per_token']:.5f}",
                 *(f"{r['weights'][g]:.4f}" for g in GROUPS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
