"""Two processes over gloo (torchrun): tensor parallel 2 (default suite, ~25 s) and data
parallel 2 (`slow`). The model's log-probs and weights, the trainer's gradients and update,
and the rank-0-driven launch path all equal the single-process HF / TorchTrainer references."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grads import record_grads
from mg_cases import hf_model, rl_batch

from asyncrl.algo.loss import token_entropy, token_logprobs
from asyncrl.config import AlgorithmSection, TorchTrainerConfig
from asyncrl.trainer.megatron import convert
from asyncrl.trainer.megatron.arch import Arch

pytestmark = pytest.mark.timeout(600)

WORKER = Path(__file__).with_name("tp_worker.py")


def run_worker(out: Path, tp: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(WORKER), str(out), str(tp)],
        env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def torch_reference(hf):
    from asyncrl.trainer.torch_trainer import TorchTrainer

    tr = TorchTrainer(copy.deepcopy(hf), TorchTrainerConfig(micro_batch_tokens=64),
                      AlgorithmSection(lr=1e-3, optimizer_steps_per_rl_step=2),
                      pad_token_id=0, temperature=0.8)
    grads = record_grads(tr)
    metrics = tr.train_step(rl_batch(0))
    return grads, metrics, tr.model.state_dict()


@pytest.mark.parametrize("tp", [2, pytest.param(1, marks=pytest.mark.slow)], ids=["tp2", "dp2"])
def test_two_ranks_match_one_process(tmp_path, tp):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    hf = hf_model("qwen3").eval()
    hf.save_pretrained(tmp_path / "init")
    arch = Arch.from_hf(hf.config)
    run_worker(tmp_path, tp)

    # 1. model: exact weight round trip through TP shards; log-probs and entropy equal HF's.
    got = torch.load(tmp_path / "model.pt", weights_only=False)
    assert got["layout"]["tp_size"] == tp and got["layout"]["dp_size"] == 2 // tp
    assert got["vocab_shard"] == hf.config.vocab_size // tp  # the vocabulary stayed split
    ref_sd = hf.state_dict()
    assert set(got["weights"]) == set(convert.expected_hf_names(arch))
    for k, w in got["weights"].items():
        assert torch.equal(w, ref_sd[k]), k
    with torch.no_grad():
        logits = hf(input_ids=got["ids"]).logits
    torch.testing.assert_close(got["logprobs"], token_logprobs(logits, got["ids"], 0.8),
                               atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got["entropy"], token_entropy(logits / 0.8), atol=2e-5, rtol=1e-5)

    # 2. trainer: per optimizer step, the clipped gradients (TP shards merged) equal TorchTrainer's.
    ref_grads, ref_metrics, ref_after = torch_reference(hf)
    ranks = [torch.load(tmp_path / f"grads_rank{r}.pt", weights_only=False) for r in range(2)]
    replica0 = sorted((r for r in ranks if r["dp_rank"] == 0), key=lambda r: r["tp_rank"])
    assert len(replica0) == tp
    for i, ref in enumerate(ref_grads):
        merged = convert.megatron_to_hf([r["steps"][i] for r in replica0], arch)
        assert merged.keys() == ref.keys() - ({"lm_head.weight"} if arch.tied_embeddings else set())
        for k, g in merged.items():
            torch.testing.assert_close(g, ref[k], atol=1e-7, rtol=1e-4, msg=k)
    if tp == 1:  # both DP replicas applied the same averaged gradients
        for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for k, v in ref_metrics.items():
        if tp == 1 and k == "train/micro_batches":  # per rank: each DP replica packs its share
            continue
        assert metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k

    # 3. launch: rank 0 drove the step through the proxy; the export is the updated model.
    launch_metrics = json.loads((tmp_path / "launch_metrics.json").read_text())
    assert launch_metrics["train/loss"] == pytest.approx(metrics["train/loss"], rel=1e-6)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    sync = torch.load(tmp_path / "launch_sync.pt", weights_only=True)
    for k, w in ref_after.items():
        torch.testing.assert_close(exported[k], w, atol=2e-5, rtol=1e-5, msg=k)
        if k in sync:
            assert torch.equal(sync[k], exported[k]), k
