"""LoRA on the torch trainer: only the adapter trains, syncs carry only the adapter (the local
engine serves exactly what the trainer computes), and adapter checkpoints resume exactly."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from trainer_batches import rl_batch, tiny_model

from asyncrl.config import AlgorithmSection, LoraSection, TorchTrainerConfig
from asyncrl.errors import TrainerError
from asyncrl.trainer.base import AdapterTrainer
from asyncrl.trainer.torch_trainer import TorchTrainer

pytest.importorskip("peft")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(model=None, *, seed: int | None = None, **lora) -> TorchTrainer:
    cfg = LoraSection(**{"rank": 4, "alpha": 8, **lora})
    kw = {} if seed is None else {"seed": seed}
    return TorchTrainer(model if model is not None else tiny_model(0),
                        TorchTrainerConfig(micro_batch_tokens=4096, lora=cfg),
                        AlgorithmSection(lr=1e-2), pad_token_id=0, **kw)


def logits(model, ids=(5, 9, 17, 33, 2, 8)) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits


def test_only_the_adapter_trains_and_the_base_stays_frozen() -> None:
    tr = make()
    assert isinstance(tr, AdapterTrainer) and tr.lora_active
    base = {k: v.clone() for k, v in tr.base_state_for_sync().items()}
    opt_params = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    adapter = {id(p) for n, p in tr.model.named_parameters() if "lora_" in n}
    assert opt_params == adapter and adapter
    before = tr.adapter_for_sync()
    m = tr.train_step(rl_batch(0))
    assert m["train/grad_norm"] > 0
    after = tr.base_state_for_sync()
    assert base.keys() == after.keys()
    for k in base:
        torch.testing.assert_close(base[k], after[k], rtol=0, atol=0, msg=k)
    moved = [k for k in before if not torch.equal(before[k], tr.adapter_for_sync()[k])]
    assert any(k.endswith("lora_B") for k in moved)  # B leaves zero: the policy changed


def test_merged_weights_compute_what_the_trained_model_computes() -> None:
    tr = make()
    tr.train_step(rl_batch(0))
    plain = tiny_model(1)  # other weights: the merged state must overwrite every one
    plain.load_state_dict(tr.state_dict_for_sync())
    tr.model.eval()
    torch.testing.assert_close(logits(plain), logits(tr.model), atol=1e-5, rtol=1e-5)


def test_the_adapter_starts_from_the_run_seed_whatever_the_global_rng() -> None:
    # A run from a pretrained base (model.path) seeds nothing before the adapter is made: its
    # A factors, hence every RL step after, must not depend on the process's torch RNG, or two
    # runs of one curriculum (a stopped one and an unstopped one) diverge at the first step.
    def factors(global_seed: int, **kw) -> dict[str, torch.Tensor]:
        model = tiny_model(0)  # (seeds torch itself)
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        tr = make(model, **kw)
        assert torch.equal(torch.get_rng_state(), before)  # the global stream is left alone
        return tr.adapter_for_sync()

    a, b, c = factors(1), factors(2), factors(1, seed=7)
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert all(torch.equal(a[k], factors(2, seed=0)[k]) for k in a)  # 0 is the default
    assert not all(torch.equal(a[k], c[k]) for k in a if k.endswith("lora_A"))


def test_unknown_target_modules_are_a_trainer_error() -> None:
    with pytest.raises(TrainerError, match="target_modules"):
        make(target_modules=["no_such_proj"])


def test_apply_to_rl_trains_everything_until_the_first_rl_step() -> None:
    tr = make(apply_to="rl")
    assert not tr.lora_active
    tr.sft_step([([3, 4, 5, 6, 7], [0, 0, 1, 1, 1])])
    assert not tr.lora_active and tr.base_changed
    tr.train_step(rl_batch(0))
    assert tr.lora_active
    assert all(not p.requires_grad for n, p in tr.model.named_parameters() if "lora_" not in n)


def test_an_adapter_checkpoint_resumes_exactly(tmp_path) -> None:
    a = make()
    a.train_step(rl_batch(0))
    a.save_state(tmp_path / "ckpt")
    state = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=True)
    assert "base" not in state and "model" not in state  # the base is what the run starts from
    a.train_step(rl_batch(1))

    b = make()
    b.load_state(tmp_path / "ckpt")
    assert b.optimizer_step == 1
    b.train_step(rl_batch(1))
    pa, pb = a.adapter_for_sync(), b.adapter_for_sync()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-7, rtol=1e-6, msg=k)


def test_a_checkpoint_after_a_full_sft_start_carries_the_base(tmp_path) -> None:
    a = make(apply_to="rl")
    a.sft_step([([3, 4, 5, 6, 7], [0, 0, 1, 1, 1])])
    a.train_step(rl_batch(0))
    a.save_state(tmp_path / "ckpt")
    a.train_step(rl_batch(1))

    b = make(apply_to="rl")  # built from the untrained model, as a resumed run is
    b.load_state(tmp_path / "ckpt")
    assert b.lora_active and b.base_changed
    b.train_step(rl_batch(1))
    a.model.eval(), b.model.eval()
    torch.testing.assert_close(logits(a.model), logits(b.model), atol=1e-6, rtol=1e-5)


def test_a_checkpoint_of_another_rank_is_refused(tmp_path) -> None:
    a = make()
    a.save_state(tmp_path / "ckpt")
    with pytest.raises(TrainerError, match="rank"):
        make(rank=8).load_state(tmp_path / "ckpt")


def test_export_writes_the_adapter_the_base_and_the_merged_model(tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tr = make(apply_to="rl", merge_on_export=True)
    tr.sft_step([([3, 4, 5, 6, 7], [0, 0, 1, 1, 1])])
    tr.train_step(rl_batch(0))
    tr.export_hf(tmp_path / "final")
    conf = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "base")
    served = PeftModel.from_pretrained(base, tmp_path / "final").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "merged").eval()
    tr.model.eval()
    torch.testing.assert_close(logits(served), logits(tr.model), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits(merged), logits(tr.model), atol=1e-5, rtol=1e-5)


async def test_the_local_engine_serves_the_adapter_it_is_sent(tmp_path) -> None:
    from asyncrl.engine.local.engine import LocalEngine
    from asyncrl.errors import WeightSyncError
    from asyncrl.weightsync.push import push_weights

    class Tok:
        eos_token_id = 1
        pad_token_id = 0

        def decode(self, ids):
            return " ".join(map(str, ids))

    model = tiny_model(0)
    engine_model = copy.deepcopy(model)
    tr = make(model, apply_to="rl")
    tr.sft_step([([3, 4, 5, 6, 7], [0, 0, 1, 1, 1])])
    async with LocalEngine(engine_model, Tok(), kv_token_budget=512, max_running=4) as eng:
        for version, mode in ((1, "disk"), (2, "disk"), (3, "disk"), (4, "tensor")):
            tr.train_step(rl_batch(version))
            had_base = tr.base_changed
            up = await push_weights([eng], tr, version, mode, tmp_path)
            assert up.has_adapter and up.has_base == had_base
            assert not tr.base_changed and eng.policy_version == version
            tr.model.eval()
            torch.testing.assert_close(logits(eng._model), logits(tr.model), atol=1e-5,
                                       rtol=1e-5)
            tr.model.train()
        assert not (tmp_path / "weights" / "v2").exists()
        assert (tmp_path / "weights" / "v1").exists()  # the base the adapters ride on
        # an engine that holds another base refuses an adapter alone
        stale = copy.deepcopy(up)
        stale.base_version = 3
        with pytest.raises(WeightSyncError, match="base"):
            await eng.update_weights(stale)


def test_an_sft_step_with_lora_for_all_stages_trains_only_the_adapter() -> None:
    tr = make()  # apply_to = "all": SFT stages train the adapter too
    base = {k: v.clone() for k, v in tr.base_state_for_sync().items()}
    before = tr.adapter_for_sync()
    losses = [tr.sft_step([([3, 4, 5, 6, 7, 8], [0, 0, 1, 1, 1, 1])])["sft/loss"]
              for _ in range(5)]
    assert losses[-1] < losses[0]
    assert not tr._base_trained  # no full-parameter step: checkpoints leave the base out
    for k, v in tr.base_state_for_sync().items():
        assert torch.equal(v, base[k]), k
    assert any(not torch.equal(before[k], v) for k, v in tr.adapter_for_sync().items())
