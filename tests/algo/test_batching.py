"""Batch flattening, mini-batches, rank shards, packing, advantages and the lr schedule."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import batching
from asyncrl.algo.advantages import group_advantages
from asyncrl.algo.schedule import lr_factor
from asyncrl.records import Batch, Group, Problem, Rollout


def _rollout(i: int, prompt: list[int], resp: list[int], mask: list[int]) -> Rollout:
    return Rollout(rollout_id=f"r{i}", prompt_id="p", group_id="g", policy_version=0,
                   prompt_ids=prompt, response_ids=resp, loss_mask=mask,
                   logprobs=[-0.5 if m else 0.0 for m in mask])


def test_sequences_from_batch_masks_prompt_and_tool_tokens():
    rs = [
        _rollout(0, [1, 2], [3, 4, 5, 6], [1, 0, 0, 1]),        # tokens 4, 5 are tool output
        _rollout(1, [1, 2], [7, 8], [0, 0]),                     # no model token: skipped
        _rollout(2, [9], [10], [1]),
    ]
    g = Group(group_id="g", problem=Problem(id="p", question="q", answer="1"), rollouts=rs,
              kept=[0, 1, 2], advantages=[0.5, 0.0, -1.0])
    seqs = batching.sequences_from_batch(Batch(step=1, policy_version=0, groups=[g]))
    assert len(seqs) == 2
    assert seqs[0].input_ids == [1, 2, 3, 4, 5, 6]
    assert seqs[0].loss_mask == [0, 0, 1, 0, 0, 1]
    assert seqs[0].sampling_logprobs == [0.0, 0.0, -0.5, 0.0, 0.0, -0.5]
    assert seqs[0].advantage == 0.5
    assert seqs[1].input_ids == [9, 10] and seqs[1].loss_mask == [0, 1]
    assert seqs[1].advantage == -1.0


def test_sft_sequences_never_train_position_zero():
    (s,) = batching.sequences_from_sft([([5, 6, 7], [1, 1, 1])])
    assert s.loss_mask == [0, 1, 1]
    with pytest.raises(ValueError):
        batching.sequences_from_sft([([5, 6], [1])])


def test_split_minibatches_near_equal_and_skips_empty():
    seqs = [batching.TrainSeq(input_ids=[i], loss_mask=[0]) for i in range(7)]
    assert [len(c) for c in batching.split_minibatches(seqs, 3)] == [3, 2, 2]
    assert [len(c) for c in batching.split_minibatches(seqs[:2], 4)] == [1, 1]
    flat = [s for c in batching.split_minibatches(seqs, 3) for s in c]
    assert flat == seqs


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), max_size=40), budget=st.integers(8, 64))
def test_pack_indices_covers_each_sequence_once_within_budget(lengths, budget):
    bins = batching.pack_indices(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:  # the trainers pad each sequence to the longest: that size is bounded
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
    assert bins == batching.pack_indices(lengths, budget)


def test_prefix_runs_take_each_groups_prompt_not_the_common_system_text():
    system, groups = list(range(50)), []
    for g in range(4):
        prompt = system + [100 + g] * 40
        groups += [prompt + [200 + g, 300 + k] * (k + 1) for k in range(8)]
    runs = batching.prefix_runs(groups[::-1], min_shared=16)
    assert sorted((len(idx), shared) for idx, shared in runs) == [(8, 91)] * 4
    assert sorted(i for idx, _ in runs for i in idx) == list(range(32))
    # below the minimum nothing is shared; one sequence is a run of its own
    assert sorted(s for _, s in batching.prefix_runs(groups, min_shared=100)) == [0] * 32
    assert batching.prefix_runs([[1, 2]], 1) == [([0], 0)] and batching.prefix_runs([], 1) == []


def test_a_short_common_prefix_before_long_sequences_is_not_worth_its_attention():
    """SFT transcripts of 300 tokens sharing a 50-token system text: one laid-out row would
    save 350 tokens and cost 2,050^2 attention pairs instead of 8 x 300^2 / 2; at SmolLM2's
    price of a pair (~3.3e-4 tokens) that loses. A GRPO group (90-token prompt, 100-token
    answers) still shares."""
    system = list(range(50))
    sft = [system + [100 + k] * 250 for k in range(8)]
    group = [system + [7] * 40 + [200 + k] * 100 for k in range(8)]
    assert [s for _, s in batching.prefix_runs(sft, 16)] == [50]
    assert sorted(s for _, s in batching.prefix_runs(sft, 16, pair_cost=3.3e-4)) == [0] * 8
    assert [s for _, s in batching.prefix_runs(group, 16, pair_cost=3.3e-4)] == [90]


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), max_size=24),
       budget=st.integers(4, 40))
def test_shared_packing_covers_each_sequence_once_and_marks_true_prefixes(seqs, budget):
    train = [batching.TrainSeq(input_ids=s, loss_mask=[0] + [1] * (len(s) - 1)) for s in seqs]
    mbs = batching.pack(train, budget, share=2)
    order = [i for mb in mbs for i in dict.fromkeys(mb.seq_index)]
    assert sorted(order) == list(range(len(seqs)))
    for mb in mbs:
        members = list(dict.fromkeys(mb.seq_index))
        shared = mb.shared_prefix or [0] * len(members)
        assert len(shared) == len(members) and shared[:1] in ([], [0])
        runs: list[list[int]] = []
        for i, p in zip(members, shared, strict=True):
            if p == 0:
                runs.append([i])
                continue
            lead = seqs[runs[-1][0]]
            assert p >= 2 and seqs[i][:p] == lead[:p] and len(seqs[i]) >= p
            runs[-1].append(i)
        sizes = []
        for run, p in zip(runs, [shared[members.index(r[0]) + 1] if len(r) > 1 else 0
                                 for r in runs], strict=True):
            size = p + sum(len(seqs[i]) - p for i in run)
            assert len(run) == 1 or size <= budget  # a run is cut to fit
            sizes.append(size)
        assert len(sizes) == 1 or len(sizes) * max(sizes) <= budget


def test_a_long_sequence_does_not_pad_short_ones_past_the_budget():
    lengths = [1000, 3, 3, 3, 3, 3, 3, 3]  # 1,021 tokens: first-fit put all 8 in one bin,
    bins = batching.pack_indices(lengths, 1024)  # 8 padded rows of 1,000
    assert [0] in bins and sum(len(b) for b in bins) == 8
    assert all(len(b) * max(lengths[i] for i in b) <= 1024 for b in bins)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), max_size=40), world=st.integers(1, 4))
def test_shard_partitions_and_balances(lengths, world):
    shards = [batching.shard(lengths, r, world) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    if lengths:
        assert max(loads) - min(loads) <= max(lengths)


def test_pack_restarts_positions_and_carries_per_token_fields():
    a = batching.TrainSeq(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], advantage=2.0,
                          sampling_logprobs=[0.0, -1.0, -2.0])
    b = batching.TrainSeq(input_ids=[4, 5], loss_mask=[0, 1], advantage=-1.0)
    (mb,) = batching.pack([a, b], token_budget=8)
    assert mb.input_ids == [1, 2, 3, 4, 5]
    assert mb.position_ids == [0, 1, 2, 0, 1]
    assert mb.loss_mask == [0, 1, 1, 0, 1]
    assert mb.advantages == [2.0, 2.0, 2.0, -1.0, -1.0]
    assert mb.sampling_logprobs == [0.0, -1.0, -2.0, 0.0, 0.0]
    assert mb.seq_index == [0, 0, 0, 1, 1]
    assert len(batching.pack([a, b], token_budget=4)) == 2
    d = batching.dummy(0)
    assert d.num_loss_tokens == 0 and d.seq_index == [-1]


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6)
    std = math.sqrt(4 * 0.25 / 3)
    assert adv == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]
    assert group_advantages([]) == []


def test_lr_schedule():
    assert [lr_factor(s, 4, "constant", None) for s in range(6)] == [0.25, 0.5, 0.75, 1, 1, 1]
    assert lr_factor(2, 2, "cosine", 12) == pytest.approx(1.0)
    assert lr_factor(7, 2, "cosine", 12) == pytest.approx(0.5)
    assert lr_factor(12, 2, "cosine", 12) == pytest.approx(0.0)
    assert lr_factor(50, 2, "cosine", 12) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        lr_factor(5, 0, "cosine", None)
