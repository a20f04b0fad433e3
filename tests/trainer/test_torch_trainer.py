"""TorchTrainer on a tiny Qwen3 model on the CPU: it learns, packs correctly, and restores."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from grads import assert_grads_close, record_grads
from trainer_batches import rl_batch, tiny_model

from asyncrl.algo import batching
from asyncrl.algo.loss import grpo_loss, token_logprobs
from asyncrl.config import AlgorithmSection, TorchTrainerConfig
from asyncrl.errors import TrainerError
from asyncrl.trainer import TRAINER_KINDS, Trainer
from asyncrl.trainer.torch_trainer import TorchTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(model=None, budget: int = 4096, **algo) -> TorchTrainer:
    algo = {"lr": 1e-3, **algo}
    return TorchTrainer(model if model is not None else tiny_model(0),
                        TorchTrainerConfig(micro_batch_tokens=budget),
                        AlgorithmSection(**algo), pad_token_id=0)


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_params_close(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=k)


@torch.no_grad()
def batch_logprobs(model, batch):
    """Per-token logprobs, masks and advantages of every kept rollout, one row each."""
    seqs = batching.sequences_from_batch(batch)
    out = []
    for s in seqs:
        ids = torch.tensor([s.input_ids])
        out.append((token_logprobs(model(input_ids=ids, use_cache=False).logits, ids)[0],
                    torch.tensor(s.loss_mask, dtype=torch.float32),
                    torch.full((s.num_tokens,), s.advantage)))
    return [torch.cat(x) for x in zip(*out, strict=True)]


def test_registry_builds_a_protocol_trainer():
    tr = TRAINER_KINDS["torch"](tiny_model(0), TorchTrainerConfig(), AlgorithmSection(),
                                pad_token_id=0)
    assert isinstance(tr, Trainer) and isinstance(tr, TorchTrainer)


def test_packed_forward_equals_separate_forwards(tiny_model_factory):
    model = tiny_model_factory(0)
    seqs = batching.sequences_from_batch(rl_batch(1, vocab=model.config.vocab_size))
    (mb,) = batching.pack(seqs, token_budget=10_000)
    assert len(set(mb.seq_index)) == len(seqs) > 1
    with torch.no_grad():
        ids = torch.tensor([mb.input_ids])
        packed = token_logprobs(model(input_ids=ids, position_ids=torch.tensor([mb.position_ids]),
                                      use_cache=False).logits, ids)[0]
        start = 0
        for s in seqs:
            one = torch.tensor([s.input_ids])
            ref = token_logprobs(model(input_ids=one, use_cache=False).logits, one)[0]
            got = packed[start:start + s.num_tokens]
            m = torch.tensor(s.loss_mask, dtype=torch.bool)
            torch.testing.assert_close(got[m], ref[m], atol=1e-5, rtol=1e-5)
            start += s.num_tokens


def test_rl_steps_change_parameters_and_lower_the_loss_on_a_fixed_batch():
    tr = make()
    batch = rl_batch(0)
    before = params(tr.model)
    lp0, mask, adv = batch_logprobs(tr.model, batch)
    loss0, _ = grpo_loss(lp0, lp0, adv, mask, 0.2, 0.28, 3.0)
    for _ in range(3):
        m = tr.train_step(batch)
    lp1, _, _ = batch_logprobs(tr.model, batch)
    loss1, _ = grpo_loss(lp1, lp0, adv, mask, 0.2, 0.28, 3.0)
    assert any(not torch.equal(before[k], v) for k, v in params(tr.model).items())
    assert loss1.item() < loss0.item() - 0.01
    pos, neg = (adv > 0) & (mask > 0), (adv < 0) & (mask > 0)
    assert (lp1 - lp0)[pos].mean() > 0 > (lp1 - lp0)[neg].mean()
    for key in ("train/loss", "train/clip_frac", "train/dual_clip_frac", "train/ratio",
                "train/ratio_max", "train/ratio_min", "train/entropy", "train/grad_norm",
                "train/mismatch_abs", "train/mismatch_kl", "train/lr", "train/tokens"):
        assert key in m, key
    assert m["train/tokens"] == mask.sum().item()
    assert m["train/entropy"] > 0 and m["train/grad_norm"] > 0
    # one optimizer step per RL step: the recomputed old logprobs are the current ones
    assert m["train/ratio_max"] == pytest.approx(1.0) == m["train/ratio_min"]


def count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("minis", [1, 2])
def test_one_mini_batch_takes_its_old_logprobs_from_the_training_forward(minis):
    """On-policy with one optimizer step, the old log-probs are the training forward's own
    (detached): one forward per micro-batch, not two; with mini-batches, a separate pass."""
    tr = make(budget=24, optimizer_steps_per_rl_step=minis)
    calls = count_forwards(tr.model)
    m = tr.train_step(rl_batch(2))
    assert m["train/micro_batches"] > 3
    assert calls[0] == m["train/micro_batches"] * (1 if minis == 1 else 2)
    assert m["train/mismatch_abs"] > 0 and "train/mismatch_ratio_p50" in m


def test_fused_step_applies_the_gradient_of_the_loss_at_ratio_one():
    """The one-pass step's gradient is that of `grpo_loss(lp, lp.detach())` over the batch."""
    batch = rl_batch(2)
    tr = make(budget=24)
    ref = copy.deepcopy(tr.model)
    got = record_grads(tr)
    tr.train_step(batch)
    seqs = batching.sequences_from_batch(batch)
    n = float(sum(s.num_loss_tokens for s in seqs))
    for s in seqs:
        ids = torch.tensor([s.input_ids])
        lp = token_logprobs(ref(input_ids=ids, use_cache=False).logits, ids)[0]
        loss, _ = grpo_loss(lp, lp.detach(), torch.full((s.num_tokens,), s.advantage),
                            torch.tensor(s.loss_mask, dtype=torch.float32), 0.2, 0.28, 3.0,
                            normalizer=n)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), tr.algo.grad_clip)
    want = {k: p.grad for k, p in ref.named_parameters()}
    assert_grads_close(got, [want])


def test_mini_batches_take_several_optimizer_steps_with_ratio_moving_off_one():
    tr = make(optimizer_steps_per_rl_step=3)
    m = tr.train_step(rl_batch(0))
    assert m["train/mini_batches"] == 3 and m["train/optimizer_step"] == 3
    assert m["train/ratio_max"] > 1.0 or m["train/ratio_min"] < 1.0


def test_micro_batch_budget_does_not_change_the_update():
    batch = rl_batch(2)
    small, large = make(budget=24), make(budget=100_000)
    gs, gl = record_grads(small), record_grads(large)
    ms, ml = small.train_step(batch), large.train_step(batch)
    assert ms["train/micro_batches"] > 3 and ml["train/micro_batches"] == 1
    assert_grads_close(gs, gl)
    assert_params_close(params(small.model), params(large.model))
    assert ms["train/loss"] == pytest.approx(ml["train/loss"], abs=1e-6)


def test_gradient_checkpointing_gives_the_same_update():
    batch = rl_batch(3)
    plain = make()
    ckpt = TorchTrainer(tiny_model(0), TorchTrainerConfig(gradient_checkpointing=True),
                        AlgorithmSection(lr=1e-3), pad_token_id=0)
    gp, gc = record_grads(plain), record_grads(ckpt)
    plain.train_step(batch)
    ckpt.train_step(batch)
    assert getattr(ckpt.model, "is_activation_checkpointing", None) or \
        ckpt.model.is_gradient_checkpointing
    assert_grads_close(gp, gc)
    assert_params_close(params(plain.model), params(ckpt.model))


def test_sft_step_lowers_masked_cross_entropy():
    tr = make(lr=3e-3)
    examples = [([5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 0, 1, 1, 1, 1, 1]),
                ([20, 21, 22, 23, 24], [0, 0, 1, 1, 1])]
    first = tr.sft_step(examples)
    for _ in range(15):
        last = tr.sft_step(examples)
    assert first["sft/tokens"] == 8
    assert last["sft/loss"] < 0.5 * first["sft/loss"]


def test_the_thread_tuner_compares_sft_steps_per_token(monkeypatch):
    """Steps of unequal length are timed per token: a short step is no evidence for a count."""
    from asyncrl.trainer.threads import ThreadTuner

    got: list[tuple[int, float]] = []
    monkeypatch.setattr(ThreadTuner, "record", lambda self, n, cost: got.append((n, cost)))
    tr = make()  # threads = 0 on the CPU: the tuner chooses
    short, long = [([5, 6, 7, 8], [0, 1, 1, 1])], [([5 + i % 20 for i in range(200)], [1] * 200)] * 4
    for batch in (short, long):
        t0 = time.perf_counter()
        tr.sft_step(batch)
        took = time.perf_counter() - t0
        tokens = sum(len(ids) for ids, _ in batch)
        assert got[-1][1] <= took / tokens  # the step's own time, per token


def test_sft_eval_is_the_step_loss_without_an_update():
    tr = make(lr=3e-3)
    examples = [([5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 0, 1, 1, 1, 1, 1]),
                ([20, 21, 22, 23, 24], [0, 0, 1, 1, 1])]
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    held = tr.sft_eval(examples)
    assert all(torch.equal(v, tr.model.state_dict()[k]) for k, v in before.items())
    step = tr.sft_step(examples)  # reports the loss of the weights before its update
    assert held["sft/tokens"] == 8 and held["sft/loss"] == pytest.approx(step["sft/loss"],
                                                                         rel=1e-5)
    assert tr.sft_eval(examples)["sft/loss"] < held["sft/loss"]


def test_lr_warmup_set_lr_and_scale():
    tr = make(lr=1e-3, warmup_steps=4)
    batch = rl_batch(0)
    assert tr.train_step(batch)["train/lr"] == pytest.approx(2.5e-4)
    tr.set_lr(2e-3)
    assert tr.train_step(batch)["train/lr"] == pytest.approx(1e-3)
    assert tr.train_step(batch, lr_scale=0.5)["train/lr"] == pytest.approx(7.5e-4)
    with pytest.raises(TrainerError, match="cosine"):
        make(lr_schedule="cosine")


def test_save_and_load_state_continue_identically(tmp_path):
    batch_a, batch_b = rl_batch(0), rl_batch(1)
    tr = make(warmup_steps=3)
    tr.train_step(batch_a)
    tr.save_state(tmp_path / "state")
    tr.train_step(batch_b)
    tr.train_step(batch_a)
    expected = params(tr.model)

    other = make(model=tiny_model(seed=9), warmup_steps=3)
    other.load_state(tmp_path / "state")
    assert other.optimizer_step == 1
    other.train_step(batch_b)
    other.train_step(batch_a)
    for k, v in params(other.model).items():
        assert torch.equal(v, expected[k]), k


def test_export_hf_and_sync_state(tmp_path):
    from asyncrl.modeling import load_model

    tr = make()
    tr.train_step(rl_batch(0))
    sd = tr.state_dict_for_sync()
    assert set(sd) == set(tr.model.state_dict())
    tr.export_hf(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf").eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits,
                                   copy.deepcopy(tr.model).eval()(input_ids=ids).logits)


def test_parallel_none_is_refused_under_a_process_group(monkeypatch):
    import asyncrl.trainer.torch_trainer as tt

    monkeypatch.setattr(tt, "_init_distributed", lambda cfg: (2, 0))
    with pytest.raises(TrainerError, match="ddp"):
        make()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_step_matches_cpu_step():
    batch = rl_batch(0)
    cpu = make()
    gpu = TorchTrainer(tiny_model(0), TorchTrainerConfig(device="cuda"),
                       AlgorithmSection(lr=1e-3), pad_token_id=0)
    gc, gg = record_grads(cpu), record_grads(gpu)
    mc, mg = cpu.train_step(batch), gpu.train_step(batch)
    assert gpu.device.type == "cuda"
    assert mg["train/loss"] == pytest.approx(mc["train/loss"], abs=1e-4)
    for k, v in gc[0].items():
        torch.testing.assert_close(gg[0][k].cpu(), v, atol=1e-5, rtol=1e-3, msg=k)


def test_steps_hand_the_heap_back_after_they_free_their_activations(monkeypatch):
    """`asyncrl.allocator.release` runs after each SFT and RL step (the process keeps what is
    live, not the step's high-water mark)."""
    from asyncrl import allocator

    calls = []
    monkeypatch.setattr(allocator, "release", lambda: calls.append(1) or True)
    tr = make()
    tr.sft_step([([5, 6, 7, 8, 9], [0, 0, 1, 1, 1])])
    assert len(calls) == 1
    tr.train_step(rl_batch(3))
    assert len(calls) == 2
