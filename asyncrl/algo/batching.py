"""From a `records.Batch` to packed micro-batches: the data layout every trainer shares.

Owns: flattening kept rollouts into training sequences (prompt + response, one loss-mask and
one advantage per token), splitting them into the optimizer's mini-batches, sharding a
mini-batch over data-parallel ranks, and packing a rank's share into micro-batches under a
token budget. Pure Python, no torch: trainers turn a `Packed` into tensors.

Alignment: position t of a sequence holds token t, its loss mask (1 = train on predicting
token t from tokens < t) and its sampling logprob. Prompt tokens and tool-output tokens have
mask 0, and so does position 0, which nothing predicts.

Packing: a micro-batch concatenates its sequences, with `position_ids` restarting at 0 for each
and `seq_index` naming each token's sequence. The trainers lay it out as right-padded rows, one
sequence per row (the plain causal attention kernel; a packed row would need a block-diagonal
mask, the slow path), so the token budget bounds rows x longest row, the size of the tensors
they build: sequences of similar length share a micro-batch. Padding has loss mask 0. A rank
with nothing to do runs a one-token dummy micro-batch with mask 0 so that collectives stay
matched (`dummy`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from asyncrl.records import Batch, RoutedExperts


class TrainSeq(msgspec.Struct, frozen=True, kw_only=True):
    """One training sequence; all lists are parallel over `input_ids`."""

    input_ids: list[int]
    loss_mask: list[int]
    advantage: float = 0.0
    sampling_logprobs: list[float] = []
    """The engine's logprobs of the response tokens (0.0 elsewhere); empty for SFT."""
    lags: list[int] = []
    """Per token: the batch's policy version minus the version that sampled it (0 for prompt
    tokens); empty = all 0 (SFT)."""
    routed_experts: RoutedExperts | None = None
    """The engine's expert choices for `input_ids` (routing replay); None: the trainer's
    router decides."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


class Packed(msgspec.Struct, frozen=True, kw_only=True):
    """One micro-batch: sequences concatenated into one row, all lists parallel."""

    input_ids: list[int]
    position_ids: list[int]
    loss_mask: list[int]
    advantages: list[float]
    sampling_logprobs: list[float]
    seq_index: list[int]
    """Which sequence (index into the list given to `pack`) each token belongs to; -1 = dummy."""
    lags: list[int] = []
    """Per token version lag (see `TrainSeq.lags`); parallel to `input_ids`."""
    shared_prefix: list[int] = []
    """Per sequence, in the order they appear: how many leading tokens it shares with the
    sequence that starts its run (0: it starts one). A run's sequences are consecutive and
    share the same count; a trainer may compute those tokens once (`pack(share=...)`).
    Empty: nothing shared."""
    routed_experts: list[RoutedExperts | None] = []
    """Per sequence, in the order they appear: its `TrainSeq.routed_experts`. Empty: none."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def sequences_from_batch(batch: Batch) -> list[TrainSeq]:
    """The kept rollouts of a batch as training sequences, in group order.

    Rollouts without a model token are skipped (they carry no gradient).
    """
    out = []
    for rollout, adv in batch.rollouts():
        rollout.check()
        n_prompt = len(rollout.prompt_ids)
        mask = [0] * n_prompt + [int(m) for m in rollout.loss_mask]
        if mask:
            mask[0] = 0
        if not any(mask):
            continue
        out.append(TrainSeq(
            input_ids=list(rollout.prompt_ids) + list(rollout.response_ids),
            loss_mask=mask,
            advantage=float(adv),
            sampling_logprobs=[0.0] * n_prompt + [float(x) for x in rollout.logprobs],
            lags=[0] * n_prompt + [max(0, batch.policy_version - v) for v in rollout.versions()],
            routed_experts=rollout.routed_experts,
        ))
    return out


def sequences_from_sft(examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TrainSeq]:
    """(token ids, loss mask) pairs as training sequences (position 0 is never trained)."""
    out = []
    for ids, mask in examples:
        if len(ids) != len(mask):
            raise ValueError(f"SFT example: {len(ids)} ids but {len(mask)} mask values")
        m = [int(x) for x in mask]
        if m:
            m[0] = 0
        out.append(TrainSeq(input_ids=list(ids), loss_mask=m, advantage=1.0))
    return out


def split_minibatches(seqs: Sequence[TrainSeq], n: int) -> list[list[TrainSeq]]:
    """`n` contiguous chunks of near-equal count (sizes differ by at most one); empty chunks
    are left out, so fewer than `n` come back when there are fewer than `n` sequences."""
    q, r = divmod(len(seqs), n)
    out, start = [], 0
    for i in range(n):
        size = q + (1 if i < r else 0)
        if size:
            out.append(list(seqs[start:start + size]))
        start += size
    return out


def shard(lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Indices of the sequences rank `rank` trains on: longest first to the least-loaded rank
    (ties to the lower rank). Deterministic, so every rank computes the same assignment."""
    loads = [0] * world_size
    mine = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        loads[r] += lengths[i]
        if r == rank:
            mine.append(i)
    return sorted(mine)


def pack_indices(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Bins whose padded size, rows x longest, is within `token_budget`: longest first, each
    bin takes the longest sequence left and then as many of the next (shorter) ones as the
    padded size allows. A sequence longer than the budget gets a bin of its own. Bins come back
    ordered by their first index, each ascending."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    at = 0
    while at < len(order):
        rows = max(1, token_budget // max(1, lengths[order[at]]))
        bins.append(order[at:at + rows])
        at += rows
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_runs(seqs: Sequence[Sequence[int]], min_shared: int, pair_cost: float = 0.0
                ) -> list[tuple[list[int], int]]:
    """Runs of sequences to lay out with one copy of a common prefix: (indices, shared length),
    every index once; a run of one shares 0.

    A GRPO group's samples share their prompt, and different prompts often share a system
    text: the runs are chosen to save the most, `(len(run) - 1) * shared` tokens summed, less
    what the longer attention costs: a laid-out run of L positions attends over all L x L
    pairs (an arbitrary mask skips no block), its sequences alone over about n^2 / 2 each, and
    `pair_cost` prices one pair in tokens (`shared_prefix.pair_cost`). So a GRPO group with a
    90-token prompt and 100-token answers shares, while SFT transcripts of 300 tokens that
    share only a 50-token system text do not. In lexicographic order any set's common prefix is
    that of its first and last; a span is either one run at the smallest common prefix of its
    neighbours, or split where that smallest occurs, whichever saves more (so 4 groups of 8
    with 90-token prompts that share a 50-token system text give 4 runs of 90, not one of 50).
    A run shares only when at least `min_shared` tokens are common."""
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i]))
    if len(order) < 2:
        return [([i], 0) for i in order]
    adj = [_common(seqs[order[k]], seqs[order[k + 1]]) for k in range(len(order) - 1)]
    best: dict[tuple[int, int], tuple[float, list[tuple[int, int, int]]]] = {}
    stack: list[tuple[int, int, bool]] = [(0, len(order) - 1, False)]
    while stack:  # post-order over spans (no recursion: a chain can be as deep as the batch)
        lo, hi, ready = stack.pop()
        if lo == hi:
            best[lo, hi] = (0.0, [(lo, hi, 0)])
            continue
        low = min(adj[lo:hi])
        parts, start = [], lo
        for k in range(lo, hi):
            if adj[k] == low:
                parts.append((start, k))
                start = k + 1
        parts.append((start, hi))
        if not ready:
            stack.append((lo, hi, True))
            stack.extend((a, b, False) for a, b in parts if (a, b) not in best)
            continue
        saved = sum(best[a, b][0] for a, b in parts)
        whole = 0.0
        if low >= min_shared:
            n = [len(seqs[order[k]]) for k in range(lo, hi + 1)]
            laid = low + sum(x - low for x in n)
            whole = (hi - lo) * low - pair_cost * (laid * laid - sum(x * x for x in n) / 2)
        if whole > saved:
            best[lo, hi] = (whole, [(lo, hi, low)])
        else:
            best[lo, hi] = (saved, [r for a, b in parts for r in best[a, b][1]])
    return [([order[k] for k in range(a, b + 1)], shared)
            for a, b, shared in best[0, len(order) - 1][1]]


def _run_chunks(lengths: Sequence[int], runs: list[tuple[list[int], int]],
                token_budget: int) -> list[tuple[list[int], int, int]]:
    """`runs` cut so that each laid-out run (the shared prefix once, then every sequence's own
    tokens) fits `token_budget` where it can: (indices, shared, laid-out length); a chunk of
    one shares 0 and is as long as its sequence."""
    out: list[tuple[list[int], int, int]] = []

    def close(chunk: list[int], shared: int) -> None:
        if len(chunk) == 1:
            out.append((chunk, 0, lengths[chunk[0]]))
        else:
            out.append((chunk, shared, shared + sum(lengths[i] - shared for i in chunk)))

    for idx, shared in runs:
        chunk: list[int] = []
        size = shared
        for i in idx:
            if chunk and size + lengths[i] - shared > token_budget:
                close(chunk, shared)
                chunk, size = [], shared
            chunk.append(i)
            size += lengths[i] - shared
        close(chunk, shared)
    return out


def _packed(seqs: Sequence[TrainSeq], idx: Sequence[int],
            shared_prefix: list[int] | None = None) -> Packed:
    """The micro-batch of `seqs[i]` for i in `idx`, in that order."""
    ids: list[int] = []
    pos: list[int] = []
    mask: list[int] = []
    adv: list[float] = []
    lps: list[float] = []
    lags: list[int] = []
    owner: list[int] = []
    routed = [seqs[i].routed_experts for i in idx]
    for i in idx:
        s = seqs[i]
        n = s.num_tokens
        ids += s.input_ids
        pos += range(n)
        mask += s.loss_mask
        adv += [s.advantage] * n
        lps += s.sampling_logprobs or [0.0] * n
        lags += s.lags or [0] * n
        owner += [i] * n
    return Packed(input_ids=ids, position_ids=pos, loss_mask=mask, advantages=adv,
                  sampling_logprobs=lps, seq_index=owner, lags=lags,
                  shared_prefix=shared_prefix or [],
                  routed_experts=routed if any(r is not None for r in routed) else [])


def pack(seqs: Sequence[TrainSeq], token_budget: int, share: int = 0,
         pair_cost: float = 0.0) -> list[Packed]:
    """Pack sequences into micro-batches of at most `token_budget` padded tokens each (see
    `pack_indices`); `seq_index` refers to positions in `seqs`.

    `share > 0`: sequences with a common prefix of at least `share` tokens worth sharing
    (`prefix_runs`, with `pair_cost`) are packed together, their run counted at its laid-out
    length (the prefix once) and marked in `Packed.shared_prefix`, for a trainer that computes
    the prefix once."""
    if share > 0:
        return _pack_shared(seqs, token_budget, share, pair_cost)
    return [_packed(seqs, idx)
            for idx in pack_indices([s.num_tokens for s in seqs], token_budget)]


def _pack_shared(seqs: Sequence[TrainSeq], token_budget: int, share: int,
                 pair_cost: float) -> list[Packed]:
    """`pack` over the runs of `prefix_runs`, each bin's padded size counted in laid-out runs
    (rows x longest run), as `pack_indices` counts sequences."""
    lengths = [s.num_tokens for s in seqs]
    runs = prefix_runs([s.input_ids for s in seqs], share, pair_cost)
    chunks = _run_chunks(lengths, runs, token_budget)
    chunks.sort(key=lambda c: min(c[0]))  # the bins come back in the sequences' order
    out = []
    for bin_ in pack_indices([size for _, _, size in chunks], token_budget):
        idx: list[int] = []
        shared: list[int] = []
        for c in bin_:
            members, n, _ = chunks[c]
            idx += members
            shared += [0] + [n] * (len(members) - 1)
        out.append(_packed(seqs, idx, shared if any(shared) else None))
    return out


def dummy(pad_token_id: int) -> Packed:
    """A one-token micro-batch that trains nothing (keeps ranks' collective counts equal)."""
    return Packed(input_ids=[pad_token_id], position_ids=[0], loss_mask=[0], advantages=[0.0],
                  sampling_logprobs=[0.0], seq_index=[-1], lags=[0])
