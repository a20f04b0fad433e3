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

from asyncrl.records import Batch


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


def pack(seqs: Sequence[TrainSeq], token_budget: int) -> list[Packed]:
    """Pack sequences into micro-batches of at most `token_budget` padded tokens each (see
    `pack_indices`); `seq_index` refers to positions in `seqs`."""
    out = []
    for idx in pack_indices([s.num_tokens for s in seqs], token_budget):
        ids: list[int] = []
        pos: list[int] = []
        mask: list[int] = []
        adv: list[float] = []
        lps: list[float] = []
        lags: list[int] = []
        owner: list[int] = []
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
        out.append(Packed(input_ids=ids, position_ids=pos, loss_mask=mask, advantages=adv,
                          sampling_logprobs=lps, seq_index=owner, lags=lags))
    return out


def dummy(pad_token_id: int) -> Packed:
    """A one-token micro-batch that trains nothing (keeps ranks' collective counts equal)."""
    return Packed(input_ids=[pad_token_id], position_ids=[0], loss_mask=[0], advantages=[0.0],
                  sampling_logprobs=[0.0], seq_index=[-1], lags=[0])
