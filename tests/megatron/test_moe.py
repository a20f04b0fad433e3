"""Qwen3-MoE in the Megatron path: the architecture read from the HF config, the HF <-> Megatron
weight conversion (bit-exact both ways, whole and split over 2 expert-parallel ranks), and a
megatron-core MoE model (local spec, SequentialMLP, all-gather dispatcher) on the CPU whose
logits equal the HF model's after the conversion."""

from __future__ import annotations

import pytest
import torch

from asyncrl.trainer.megatron import convert
from asyncrl.trainer.megatron.arch import Arch
from asyncrl.trainer.megatron.errors import UnsupportedModelError

VOCAB = 256
MOE = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128,
           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-6,
           initializer_range=0.1)


def hf_config(**change):
    from transformers import AutoConfig

    opts = dict(MOE, **change)
    return AutoConfig.for_model(opts.pop("model_type"), vocab_size=VOCAB, **opts)


def hf_model(seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The HF state dict in its checkpoint layout (what `save_pretrained` writes and Megatron
    conversion reads): one gate/up/down matrix per expert, not transformers' fused 3-D ones."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            for e, m in enumerate(t):
                out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = m.chunk(2)
        elif name.endswith("mlp.experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e, m in enumerate(t):
                out[f"{stem}{e}.down_proj.weight"] = m
        elif name != "lm_head.weight":  # tied
            out[name] = t
    return out


def test_arch_reads_the_experts():
    arch = Arch.from_hf(hf_config())
    assert (arch.num_experts, arch.moe_top_k, arch.moe_ffn_hidden_size) == (8, 2, 32)
    kw = arch.transformer_config_kwargs()
    assert kw["num_moe_experts"] == 8 and kw["moe_router_topk"] == 2
    assert kw["moe_ffn_hidden_size"] == 32 and kw["moe_router_pre_softmax"] is False
    assert Arch.from_hf(hf_config(norm_topk_prob=False)).transformer_config_kwargs()[
        "moe_router_pre_softmax"] is True
    model = hf_model()
    assert arch.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("change", "field"), [({"decoder_sparse_step": 2}, "decoder_sparse_step"),
                                               ({"mlp_only_layers": [0]}, "mlp_only_layers")])
def test_dense_layers_among_sparse_are_refused(change, field):
    with pytest.raises(UnsupportedModelError) as e:
        Arch.from_hf(hf_config(**change))
    assert e.value.field == field


def test_hf_megatron_hf_is_bit_exact():
    arch = Arch.from_hf(hf_config())
    hf = checkpoint_tensors(hf_model())
    assert sorted(hf) == sorted(convert.expected_hf_names(arch))
    mg = convert.hf_to_megatron(hf, convert.megatron_names(arch), arch)
    assert mg["decoder.layers.1.mlp.router.weight"] is hf["model.layers.1.mlp.gate.weight"]
    fc1 = mg["decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.0.mlp.experts.5.gate_proj.weight"],
                                       hf["model.layers.0.mlp.experts.5.up_proj.weight"]]))
    back = convert.megatron_to_hf([mg], arch)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_two_expert_parallel_ranks_split_the_experts_and_join_back_bit_exact():
    arch = Arch.from_hf(hf_config())
    hf = checkpoint_tensors(hf_model(1))
    local = 4  # 8 experts over 2 ranks: each builds local_experts.0-3
    names = [n for n in convert.megatron_names(arch) if (_expert(n) or 0) < local]
    ranks = [convert.hf_to_megatron(hf, names, arch, expert_offset=r * local) for r in (0, 1)]
    a = ranks[1]["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"]
    assert torch.equal(a, hf["model.layers.0.mlp.experts.6.down_proj.weight"])
    back: dict[str, torch.Tensor] = {}
    for r, shard in enumerate(ranks):
        back.update(convert.megatron_to_hf([shard], arch, expert_offset=r * local))
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def _expert(name: str) -> int | None:
    parts = name.split("local_experts.")
    return int(parts[1].split(".")[0]) if len(parts) > 1 else None


@pytest.mark.parametrize("attention", ["local", "sdpa"])
def test_megatron_moe_logits_equal_hf(cpu_megatron, attention):
    from asyncrl.trainer.megatron import model as mm

    hf = hf_model(2)
    arch = Arch.from_hf(hf.config)
    mm.init_parallel(1, 1, seed=0)
    mg = mm.build_gpt(arch, attention=attention)
    tensors = checkpoint_tensors(hf)
    mm.load_hf_weights(mg, arch, tensors.__getitem__)
    mg.eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=ids, use_cache=False).logits
        got = mm.forward_logits(mg, ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    back = dict(mm.iter_hf_weights(mg, arch))
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k])
                                                   for k in tensors)


def test_megatron_moe_grpo_step_equals_the_torch_trainer(cpu_megatron):
    """Without replay: one GRPO step of two mini-batches moves every weight as the torch
    trainer's does."""
    import copy

    from mg_cases import rl_batch

    from asyncrl.config import AlgorithmSection, MegatronTrainerConfig, TorchTrainerConfig
    from asyncrl.trainer.megatron.trainer import MegatronTrainer
    from asyncrl.trainer.torch_trainer import TorchTrainer

    hf = hf_model(3)
    algo = AlgorithmSection(lr=1e-3, optimizer_steps_per_rl_step=2, routing_replay=False)
    tt = TorchTrainer(copy.deepcopy(hf), TorchTrainerConfig(micro_batch_tokens=64), algo,
                      pad_token_id=0, temperature=0.8)
    mt = MegatronTrainer(copy.deepcopy(hf), MegatronTrainerConfig(micro_batch_tokens=64,
                                                                  recompute="none"),
                         algo, pad_token_id=0, temperature=0.8)
    ref, mine = tt.train_step(rl_batch(0)), mt.train_step(rl_batch(0))
    assert mine["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-4, abs=1e-6)
    want, got = checkpoint_tensors(tt.model), dict(mt.state_dict_for_sync())
    before = checkpoint_tensors(hf)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, atol=2e-5, rtol=1e-5, msg=k)
    assert (want["model.layers.0.mlp.gate.weight"] - before["model.layers.0.mlp.gate.weight"]
            ).abs().max() > 1e-4


def test_megatron_replays_the_engines_routing_through_router_replay(cpu_megatron,
                                                                    tiny_moe_factory,
                                                                    tiny_tokenizer):
    """megatron-core's router replay with the engine's records: the trainer's log-probs of the
    sampled tokens move to the engine's as the torch trainer's do (engine routers in bf16, see
    tests/trainer/test_moe_replay.py), and shuffled records break the match."""
    import copy

    from moe_cases import one_batch, sample_rollouts, shuffled

    from asyncrl.algo import batching
    from asyncrl.config import AlgorithmSection, MegatronTrainerConfig
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    model = tiny_moe_factory(0)
    rollouts = sample_rollouts(model, tiny_tokenizer, bf16_router=True)

    def mismatch(replay, ros):
        mt = MegatronTrainer(copy.deepcopy(model), MegatronTrainerConfig(recompute="none"),
                             AlgorithmSection(routing_replay=replay),
                             pad_token_id=tiny_tokenizer.pad_token_id)
        diffs = []
        with torch.no_grad():
            for mb in mt.plan(batching.sequences_from_batch(one_batch(ros))):
                t = mt.tensors(mb)
                on = t["mask"] > 0
                diffs.append((mt.logprobs(t, 1.0)[on] - t["sampling_logprobs"][on]).abs())
        counts = mt.replay.take_counts() if mt.replay is not None else None
        return torch.cat(diffs), counts

    free, none = mismatch(False, rollouts)
    replayed, counts = mismatch(True, rollouts)
    assert none is None and 0 < counts[0] < 0.05 * counts[1]
    assert free.mean() > 3 * replayed.mean(), (free.mean(), replayed.mean())
    assert free.max() > 10 * replayed.max(), (free.max(), replayed.max())
    wrong, counts = mismatch(True, shuffled(rollouts))
    assert counts[0] > 0.5 * counts[1] and wrong.mean() > 20 * free.mean()
