"""`engine.weight_sync = "shared"`: the local engine's model holds the trainer's own parameter
tensors (one copy of the weights, not two); a push re-packs the engine's linear layers and
copies nothing; the engine then serves exactly the trainer's weights. Refused by config check
wherever the engine could read weights mid-update or not the served ones."""

from __future__ import annotations

import asyncio
import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from micro_config import MICRO_DATA, MICRO_ENGINE, MICRO_MODEL, micro_rollout, run_ok

from asyncrl import config
from asyncrl.config import AlgorithmSection, TorchTrainerConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.errors import ConfigError
from asyncrl.runtime import _copy_serially
from asyncrl.trainer.torch_trainer import TorchTrainer

PROMPTS = ["What is 12 + 7?", "```python\nprint(1)", "aaa"]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def test_the_shared_copy_holds_the_trainers_tensors_ties_included(tiny_model_factory):
    model = tiny_model_factory(0)
    copy_ = _copy_serially(model, share_parameters=True)
    own = dict(model.named_parameters(remove_duplicate=False))
    for name, p in copy_.named_parameters(remove_duplicate=False):
        assert p.data_ptr() == own[name].data_ptr() and not p.requires_grad, name
    assert copy_.lm_head.weight is copy_.model.embed_tokens.weight  # the tie survives
    assert all(b.data_ptr() != dict(model.named_buffers())[n].data_ptr()
               for n, b in copy_.named_buffers())  # buffers are the copy's own
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # the trainer's in-place update is the copy's
    assert torch.equal(copy_.model.norm.weight, model.model.norm.weight)


async def _answers(engine: LocalEngine, tok) -> list[tuple[list[int], list[float]]]:
    sp = SamplingParams(max_new_tokens=12, temperature=0.0)
    out = []
    for i, text in enumerate(PROMPTS):
        ids = tok(text)["input_ids"]
        d = await collect(engine, GenerateRequest(request_id=f"{engine.name}-{i}-"
                                                  f"{engine.policy_version}", input_ids=ids,
                                                  sampling=sp))
        out.append((d.token_ids, d.logprobs))
    return out


def test_a_push_repacks_and_the_engine_serves_the_trainers_new_weights(
        tiny_model_factory, tiny_tokenizer):
    tok = tiny_tokenizer
    model = tiny_model_factory(0)
    trainer = TorchTrainer(model, TorchTrainerConfig(), AlgorithmSection(lr=1e-3),
                           pad_token_id=tok.pad_token_id)
    shared = LocalEngine(_copy_serially(model, share_parameters=True), tok,
                         kv_token_budget=2048, max_running=4)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # an update, in place, as the optimizer makes it
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    state = trainer.state_dict_for_sync()
    fresh = LocalEngine(copy.deepcopy(model).eval(), tok, kv_token_budget=2048, max_running=4)

    async def run() -> tuple[list, list, list]:
        async with shared, fresh:
            before = await _answers(shared, tok)  # packed linears still the old weights
            await shared.update_weights(WeightUpdate(version=1, state_dict=state))
            return before, await _answers(shared, tok), await _answers(fresh, tok)

    before, after, want = asyncio.run(run())
    assert after == want  # token for token, log-prob for log-prob
    if shared._packed is not None:  # oneDNN: the push's re-pack is what made them equal
        assert before != want
    for name, p in shared._model.named_parameters():  # nothing was copied in
        assert p.data_ptr() == dict(model.named_parameters())[name].data_ptr(), name


BASE = {"model": {"init": {"model_type": "qwen3"}}, "data": {"train": "generator:tiny_math"},
        "stages": [{"name": "s1", "steps": 1}]}


@pytest.mark.parametrize(("extra", "words"), [
    ({"rollout": {"max_staleness": 1}}, "rollout.max_staleness = 1"),
    ({"trainer": {"kind": "megatron"}}, "Megatron"),
    ({"trainer": {"lora": {"rank": 4}}}, "LoRA"),
    ({"trainer": {"parallel": "fsdp2"}}, "fsdp2"),
    ({"trainer": {"device": "cuda"}}, "'cuda'"),
])
def test_shared_is_refused_where_the_engine_could_read_the_wrong_weights(extra, words):
    with pytest.raises(ConfigError, match=r"engine\.weight_sync") as e:
        config.from_dict({**BASE, "engine": {"kind": "local", "weight_sync": "shared"},
                          **extra})
    assert words in str(e.value) and 'weight_sync = "tensor"' in str(e.value)


def test_shared_is_taken_by_a_synchronous_torch_run():
    cfg = config.from_dict({**BASE, "engine": {"kind": "local", "weight_sync": "shared"}})
    assert cfg.engine.weight_sync == "shared"


MICRO = """
[run]
name = "shared"
seed = 3
""" + MICRO_MODEL + MICRO_DATA + micro_rollout() + """[algorithm]
lr = 3e-3
""" + MICRO_ENGINE.replace("[engine]\n", '[engine]\nweight_sync = "shared"\n') + """[[stages]]
name = "sft"
kind = "sft"
steps = 4
batch_size = 8
[eval]
max_problems = 4
k = 2
[logging]
console = "json"
"""


def _trainer_logprobs(model_dir: Path, rollouts: list[dict]) -> list[float]:
    """The log-probs `model_dir`'s model gives each model-written token of `rollouts`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            n = len(r["prompt_ids"])
            for i, (tok, m) in enumerate(zip(r["response_ids"], r["loss_mask"], strict=True)):
                if m:
                    out.append(float(logp[n + i - 1, tok]))
    return out


@pytest.mark.timeout(600)
def test_a_shared_run_samples_the_weights_it_trained(tmp_path: Path) -> None:
    """Through `asyncrl train`: after the SFT stage moved the weights, the engine's log-probs of
    the tokens it sampled are the trained model's (an engine serving its stale packed copies
    would give the initial model's, which differ by about the update's size)."""
    cfg = tmp_path / "shared.toml"
    cfg.write_text(MICRO)
    run = tmp_path / "run"
    run_ok([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir", str(run)])
    rollouts = [r for line in (run / "eval").glob("*-after_sft.jsonl")
                for g in line.read_text().splitlines() for r in json.loads(g)["rollouts"]]
    engine = [lp for r in rollouts for lp, m in zip(r["logprobs"], r["loss_mask"], strict=True)
              if m]
    assert engine
    trained = _trainer_logprobs(run / "final", rollouts)
    initial = _trainer_logprobs(run / "model-init", rollouts)
    gap = max(abs(a - b) for a, b in zip(engine, trained, strict=True))
    moved = max(abs(a - b) for a, b in zip(engine, initial, strict=True))
    assert gap < 1e-4 < 1e-2 < moved, (gap, moved)
