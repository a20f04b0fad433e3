"""A micro-batch whose sequences share prefixes, laid out so that each prefix is computed once.

Owns: turning the runs that `batching.pack(share=...)` marks (`Packed.shared_prefix`: a GRPO
group's samples after their one prompt) into the model's input, and mapping every token of the
`[B, T]` per-sequence layout to the position of that input which predicts it. Does not own:
which sequences share (`asyncrl.algo.batching`), the log-probs (`lm_head`) or the model.

Layout: one row per run, right-padded. A run's first sequence is laid out whole (positions
0..n-1); each further sequence adds only its own tokens after the shared prefix of length p,
with position ids p, p+1, ... as if the prefix stood before them. The 4-D additive mask lets a
token attend causally to the shared prefix and to earlier tokens of its own sequence, never to
another sequence's (a padding position attends to itself only, so no row of the softmax is
empty). On a sliding-window layer a token also sees only the keys less than the window behind
it, measured in its own sequence's positions (`pack_pos`), as the model's own forward does
(`windows`): one mask per layer type (`pack_mask:<type>`) where the model mixes full and
sliding layers, one with the window where every layer slides. Attention the layout cannot
express (chunked, bidirectional, linear or recurrent layers) turns sharing off (`windows`
raises). Every token then sees exactly the context it has in its own sequence, at the same
positions, so its hidden state is the per-sequence one up to float summation order (the
attention sums over a longer, masked row), and gradients reach the shared prefix from every
sequence that reads it. A run of 8 samples with a 90-token prompt and 100 response tokens each
is 890 positions instead of 1,520.

`src` gives, for each flat position `b * T + t` of the `[B, T]` layout, the flat position of the
laid-out input whose output predicts token t of sequence b (that of token t - 1): inside the
shared prefix the run's common position, after it the sequence's own. Positions 0 and padding
point at 0 (never read: their mask is 0).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.errors import TrainerError

ATTENTION = ("sdpa", "eager")
"""The attention implementations that take the 4-D additive mask this layout needs."""


def pair_cost(config: Any) -> float:
    """The cost of one attention query-key pair in tokens through the model's other matrix
    products (`batching.prefix_runs`), from an HF text config: per pair, every layer's heads
    multiply `head_dim` twice (scores, values); per token, every weight of the layer twice
    (SmolLM2-135M: 3.3e-4; Qwen3-14B: 3.1e-5). Embeddings and the LM head are left out (the
    head runs only at trained positions either way)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads  # per layer: layers cancel
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    mlp = getattr(cfg, "intermediate_size", None) or 4 * hidden
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * mlp
    return (2 * heads * head_dim) / per_layer


def windows(config: Any) -> dict[str, int | None]:
    """How far back each kind of attention layer of an HF config looks: {layer type: window in
    tokens, or None for full attention}. With `layer_types` (Gemma 2/3, Qwen2, ...) one entry
    per type the model uses (the model then takes a mask per type); without, one entry `""` for
    every layer (Mistral, Phi-3: `sliding_window`, if set, applies to all of them). A key may
    attend to a query when `query_pos - key_pos < window`, transformers' sliding rule.

    Raises `TrainerError` (naming the reason) for attention one additive mask per layer type
    cannot express: chunked or bidirectional attention, linear or recurrent layers."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(cfg, "use_bidirectional_attention", False):
        raise TrainerError("the model's attention is bidirectional")
    if getattr(cfg, "attention_chunk_size", None):
        raise TrainerError("the model has chunked attention (attention_chunk_size)")
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise TrainerError(f"the model's sliding_window {window!r} is not a positive integer")
    types = getattr(cfg, "layer_types", None)
    if not types:
        return {"": window}
    out: dict[str, int | None] = {}
    for kind in sorted(set(types)):
        if kind == "full_attention":
            out[kind] = None
        elif kind == "sliding_attention" and window is not None:
            out[kind] = window
        else:
            raise TrainerError(f"the model has {kind!r} layers")
    return out


def layout(rows: list[list[int]], shared: list[int], pad_token_id: int, width: int,
           device: torch.device, dtype: torch.dtype,
           windows: dict[str, int | None] | None = None) -> dict[str, torch.Tensor]:
    """`rows` (each sequence's tokens, in micro-batch order), `shared` (`Packed.shared_prefix`)
    and the `[B, T]` layout's width -> `pack_ids`, `pack_pos` (`[R, L]` long), the additive
    masks (`[R, 1, L, L]`, `dtype`: 0 or its most negative value) and `pack_src` (`[B * T]`
    long). `windows` (`windows(config)`, default full attention everywhere): with one entry
    the mask is `pack_mask`, with several one `pack_mask:<layer type>` per entry."""
    runs: list[tuple[list[int], list[int], list[int]]] = []  # ids, positions, segment per run
    places: list[tuple[int, list[int]]] = []  # per sequence: its run, where its tokens lie
    for b, ids in enumerate(rows):
        p = shared[b]
        if p == 0:  # a run starts: its first sequence whole; the part its followers share is 0
            nxt = shared[b + 1] if b + 1 < len(rows) else 0
            common = nxt or len(ids)
            runs.append((list(ids), list(range(len(ids))),
                         [0] * common + [1] * (len(ids) - common)))
            places.append((len(runs) - 1, list(range(len(ids)))))
            continue
        run_ids, run_pos, run_seg = runs[-1]
        start, own = len(run_ids), len(ids) - p
        run_seg += [max(run_seg) + 1] * own
        run_ids += ids[p:]
        run_pos += range(p, len(ids))
        places.append((len(runs) - 1, list(range(p)) + list(range(start, start + own))))
    n = max(len(r[0]) for r in runs)
    src = [0] * (len(rows) * width)
    for b, (r, at) in enumerate(places):
        for t in range(1, len(at)):
            src[b * width + t] = r * n + at[t - 1]

    def grid(k: int, pad: int) -> torch.Tensor:
        return torch.tensor([run[k] + [pad] * (n - len(run[k])) for run in runs],
                            dtype=torch.long, device=device)

    seg, pos = grid(2, -1), grid(1, 0)
    q, k = seg.unsqueeze(2), seg.unsqueeze(1)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    allowed = causal & (k >= 0) & ((k == 0) | (q == k))
    behind = pos.unsqueeze(2) - pos.unsqueeze(1)  # query position - key position, per run
    eye = torch.eye(n, dtype=torch.bool, device=device)  # padding sees itself

    def mask(window: int | None) -> torch.Tensor:
        ok = (allowed if window is None else allowed & (behind < window)) | eye
        out = torch.zeros(ok.shape, dtype=dtype, device=device)
        return out.masked_fill_(~ok, torch.finfo(dtype).min).unsqueeze(1)

    kinds = windows or {"": None}
    masks = ({"pack_mask": mask(next(iter(kinds.values())))} if len(kinds) == 1 else
             {f"pack_mask:{kind}": mask(w) for kind, w in kinds.items()})
    return {"pack_ids": grid(0, pad_token_id), "pack_pos": pos, **masks,
            "pack_src": torch.tensor(src, dtype=torch.long, device=device)}
