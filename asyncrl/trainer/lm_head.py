"""The torch trainer's log-probs with the LM head applied only at the positions that are read.

Owns: which final hidden states reach the model's output embedding (those that predict a
trained token: position t - 1 for every t >= 1 whose loss mask is 1), how they are chosen
inside the model's own forward, and how the per-token results return to the `[B, T]` layout of
`asyncrl.algo.step.StepBackend`. Does not own: the log-prob math (`asyncrl.algo.loss`), the
model, its wrappers or the choice of path (`torch_trainer`).

Why: every reader of a step's log-probs (the GRPO and KL losses, the old log-probs, the
off-policy correction, the mismatch metrics and ratio quantiles, the entropy metric, the SFT
loss) reads them where the mask is 1 only: the model's own response tokens. The prompt,
tool-output and padding positions need no logits, yet the full path computes the `[H, V]`
product and the log-softmax over V there too, forward and backward (SmolLM2-135M: V = 49,152,
H = 576; most positions of an RL micro-batch are prompt).

How: a forward pre-hook on the output embedding (`get_output_embeddings()`, looked up at each
call: LoRA may have replaced it) swaps its input, the final hidden states `[B, T, H]`, for the
chosen rows `[N, H]`, during one call of the model's forward; the logits come back `[N, V]`.
Everything else runs as in the full forward, through whatever wraps the model: DDP's forward
(its gradient bookkeeping), FSDP2's root hooks (which gather the root's parameters: the
embedding, the final norm, a tied head), PEFT's LoRA layers (a LoRA'd head too), and what the
model applies after its head position by position (Gemma 2's `final_logit_softcapping`, a
logit scale). Calling the decoder (`model.model`) and the head by hand instead would skip the
root module's forward, hence those wrappers, and every post-head op.

Exactness: at every chosen position the logits are the full forward's up to float summation
order (a product over N rows instead of B * T may block differently), for any model that calls
its output embedding once on `[B, T, H]` and treats its output per position, as HF's causal
LMs do. A model that never calls its output embedding as a module (logits from a weight
directly) returns the full logits, which are used as before (`split` is False). One that calls
it on another shape or more than once is refused (`TrainerError`): `trainer.full_logits = true`
takes the full path.

Positions not chosen hold 0 (log-prob and entropy): callers read only where the mask is 1.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.algo.loss import row_logprobs, token_logprobs, token_logprobs_and_entropy
from asyncrl.errors import TrainerError


def predicting_positions(mask: torch.Tensor) -> torch.Tensor:
    """Flat indices (into `B * T`) of the positions t >= 1 whose `mask` `[B, T]` is nonzero:
    the targets. Their predictors are the same indices minus 1 (same row, position t - 1)."""
    t = mask.shape[1]
    rows, cols = (mask[:, 1:] != 0).nonzero(as_tuple=True)
    return rows * t + cols + 1


def logprobs(module: Any, model: Any, t: dict[str, torch.Tensor], temperature: float, *,
             entropy: bool, split: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(log-probs, entropy, whether the head ran on the chosen rows only) of the tokens of `t`
    (`input_ids`, `position_ids`, `mask`) under `logits / temperature`, both `[B, T]` float32,
    0 at position 0 and wherever the mask is 0 on the split path or a laid-out one; the
    entropy (no gradient) only when `entropy`, else an empty tensor.

    `module` is what is called (the model, or DDP around it), `model` the HF model whose output
    embedding is hooked. `split = False` takes the full path: logits at every position. With
    `pack_ids`, `pack_pos`, `pack_mask` (or one `pack_mask:<layer type>` per type) and
    `pack_src` in `t` (`shared_prefix.layout`) the model runs on that layout and each token's
    predictor is read where `pack_src` points.
    """
    ids = t["input_ids"]
    pack = "pack_ids" in t  # shared prefixes laid out once (`shared_prefix.layout`)
    if not (split or pack):
        return (*_full(_forward(module, t).logits, ids, temperature, entropy), False)
    b, n_pos = ids.shape
    shape = tuple(t["pack_ids"].shape) if pack else (b, n_pos)  # what the model runs on
    dst = predicting_positions(t["mask"])
    src = t["pack_src"].index_select(0, dst) if pack else dst - 1
    if split:
        logits, split = _split_forward(module, model, t, shape, src, dst.numel())
    else:
        logits = _forward(module, t).logits
    if not split:  # logits at every position of what the model ran on
        if not pack:
            return (*_full(logits, ids, temperature, entropy), False)
        logits = logits.reshape(-1, logits.shape[2]).index_select(0, src)  # the rows read
    lp, ent = row_logprobs(logits, ids.flatten().index_select(0, dst), temperature,
                           entropy=entropy)
    zeros = lp.new_zeros(b * n_pos)
    full_lp = zeros.index_copy(0, dst, lp).view(b, n_pos)
    full_ent = zeros.index_copy(0, dst, ent).view(b, n_pos) if entropy else ent
    return full_lp, full_ent, split


def _split_forward(module: Any, model: Any, t: dict[str, torch.Tensor], shape: tuple[int, ...],
                   src: torch.Tensor, rows: int) -> tuple[torch.Tensor, bool]:
    """The forward with the output embedding's input cut to the rows `src` of the final hidden
    states (`shape` is what the model runs on): (logits `[rows, V]`, True), or (the full
    logits, False) when the forward never called its output embedding as a module."""
    calls: list[tuple[int, ...] | None] = []

    def keep(_mod: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        h = args[0] if args and isinstance(args[0], torch.Tensor) else None
        calls.append(None if h is None else tuple(h.shape))
        if len(calls) == 1 and h is not None and h.dim() == 3 and tuple(h.shape[:2]) == shape:
            return (h.reshape(-1, h.shape[2]).index_select(0, src), *args[1:])
        return None

    handle = model.get_output_embeddings().register_forward_pre_hook(keep)
    try:
        logits = _forward(module, t).logits
    finally:
        handle.remove()
    if not calls and logits.dim() == 3 and tuple(logits.shape[:2]) == shape:
        return logits, False
    if len(calls) != 1 or calls[0] is None or len(calls[0]) != 3 or \
            calls[0][:2] != shape or tuple(logits.shape[:-1]) != (rows,):
        raise TrainerError(
            f"{type(model).__name__}'s forward called its output embedding {len(calls)} "
            f"time(s) on {calls} for input {shape} and returned logits "
            f"{tuple(logits.shape)}: the LM head cannot be limited to the trained positions; "
            f"set trainer.full_logits = true")
    return logits, True


def _forward(module: Any, t: dict[str, torch.Tensor]) -> Any:
    if "pack_ids" in t:  # one mask, or one per layer type (`shared_prefix.layout`)
        per_type = {k.split(":", 1)[1]: v for k, v in t.items() if k.startswith("pack_mask:")}
        return module(input_ids=t["pack_ids"], position_ids=t["pack_pos"],
                      attention_mask=per_type or t["pack_mask"], use_cache=False)
    return module(input_ids=t["input_ids"], position_ids=t["position_ids"], use_cache=False)


def _full(logits: torch.Tensor, ids: torch.Tensor, temperature: float, entropy: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    if entropy:
        return token_logprobs_and_entropy(logits, ids, temperature)
    return token_logprobs(logits, ids, temperature), logits.new_empty(0, dtype=torch.float32)
