"""Expert parallelism of a Qwen3-MoE in the Megatron trainer (`trainer.expert_parallel`).

Refusals (default suite, no process group): a dense model, experts the size does not divide,
a world it does not divide, tensor parallelism beside it. Two processes over gloo (torchrun,
`ep_worker.py`; `slow`): the experts split 4 + 4 over 2 expert-parallel ranks that are data
parallel for the rest; HF -> Megatron(EP=2) -> HF is bit-exact, the logits equal HF's, and one
GRPO step (two mini-batches, each rank its share of the data) equals the 1-rank step: loss,
gradient norm (each expert counted once) and every exported weight, without and with routing
replay; the trainer state saved by both ranks loads back; the rank-0-driven launch path exports
the same whole model; and with megatron's own DDP and distributed (chained) optimizer, the CUDA
path run on the CPU, the step and a resumed second step equal one rank's.
"""

from __future__ import annotations

import copy
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mg_cases import hf_config as dense_config
from mg_cases import rl_batch
from test_moe import checkpoint_tensors, hf_config, hf_model

from asyncrl.config import AlgorithmSection, MegatronTrainerConfig, load
from asyncrl.errors import ConfigError
from asyncrl.records import Batch, RoutedExperts
from asyncrl.trainer.megatron.arch import Arch

WORKER = Path(__file__).with_name("ep_worker.py")


def replay_batch(seed: int = 0) -> Batch:
    """`rl_batch` with a routing record per rollout: 2 of the 8 experts per token and layer,
    drawn at random (far from what the router would choose, so replay moves the update), the
    last token without a record as an engine leaves it."""
    rng = random.Random(seed)
    batch = rl_batch(seed)
    for g in batch.groups:
        for ro in g.rollouts:
            n = len(ro.prompt_ids) + len(ro.response_ids)
            rows = [bytes(rng.sample(range(8), 2)) for _ in range(2 * (n - 1))]
            ro.routed_experts = RoutedExperts(layers=2, top_k=2,
                                              data=b"".join(rows) + b"\xff" * 4)
    return batch


# ------------------------------------------------------------------------------- refusals
def test_expert_parallel_is_refused_where_it_cannot_work():
    from asyncrl.trainer.megatron.model import check_expert_parallel

    moe, dense = Arch.from_hf(hf_config()), Arch.from_hf(dense_config("qwen3"))
    check_expert_parallel(moe, 2, world_size=2)
    check_expert_parallel(moe, 8, world_size=16)
    check_expert_parallel(dense, 1, world_size=1)
    for arch, ep, world, words in [(dense, 2, 2, "dense"), (moe, 3, 3, "does not divide the "
                                   "model's 8 experts"), (moe, 2, 1, "world of 1"),
                                   (moe, 4, 6, "world of 6")]:
        with pytest.raises(ConfigError) as e:
            check_expert_parallel(arch, ep, world_size=world)
        assert e.value.key == "trainer.expert_parallel" and words in str(e.value)


def test_expert_parallel_beside_tensor_parallel_is_a_config_error(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[trainer]\nkind = \"megatron\"\ntensor_parallel = 2\nexpert_parallel = 2\n")
    with pytest.raises(ConfigError) as e:
        load(str(cfg))
    assert e.value.key == "trainer.expert_parallel" and "tensor_parallel = 1" in str(e.value)
    assert MegatronTrainerConfig(expert_parallel=4).expert_parallel == 4


def test_the_trainer_refuses_more_expert_ranks_than_the_world(cpu_megatron):
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    with pytest.raises(ConfigError) as e:
        MegatronTrainer(hf_model(), MegatronTrainerConfig(expert_parallel=2, recompute="none"),
                        AlgorithmSection(), pad_token_id=0)
    assert e.value.key == "trainer.expert_parallel" and "torchrun" in str(e.value)


# --------------------------------------------------------------------- 2 ranks against 1
def run_worker(out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(WORKER), str(out)],
        env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def one_rank_step(hf, batch: Batch, replay: bool) -> tuple[dict[str, float], dict]:
    from ep_worker import TEMPERATURE, algo, config

    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    tr = MegatronTrainer(copy.deepcopy(hf), config(1), algo(replay), pad_token_id=0,
                         temperature=TEMPERATURE)
    return tr.train_step(batch), tr.state_dict_for_sync()


def assert_same_step(got: dict, want_metrics: dict[str, float], want: dict, before: dict) -> None:
    m = got["metrics"]
    for key in ("train/loss", "train/grad_norm", "train/grad_norm_max", "train/entropy"):
        assert m[key] == pytest.approx(want_metrics[key], rel=1e-4, abs=1e-6), key
    assert m["train/sequences"] == want_metrics["train/sequences"]
    assert sorted(got["sync"]) == sorted(want)
    moved = 0
    for k, w in want.items():
        torch.testing.assert_close(got["sync"][k], w, atol=2e-5, rtol=1e-5, msg=k)
        moved += int(not torch.equal(w, before[k]))
    assert moved == len(want)  # weight decay alone moves every weight; the step reached all


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_expert_parallel_ranks_equal_one_rank(tmp_path, cpu_megatron):
    from ep_worker import ids

    from asyncrl.trainer.megatron.hf_files import HFReader

    hf = hf_model(4).eval()
    hf.save_pretrained(tmp_path / "init")
    disk = HFReader(tmp_path / "init")
    before = {n: disk(n) for n in disk.names()}
    assert before.keys() == checkpoint_tensors(hf).keys()  # one matrix per expert on disk
    batch = replay_batch(0)
    (tmp_path / "replay_batch.pkl").write_bytes(pickle.dumps(batch))
    run_worker(tmp_path)

    # 1. HF -> Megatron(EP=2) -> HF bit-exact; the logits are HF's.
    got = torch.load(tmp_path / "model.pt", weights_only=False)
    assert got["local_experts"] == 4 and got["layout"]["ep_size"] == 2
    assert got["layout"]["dp_size"] == 2 and got["layout"]["edp_size"] == 1
    assert sorted(got["weights"]) == sorted(before)
    for k, w in before.items():
        assert torch.equal(got["weights"][k], w), k
    with torch.no_grad():
        want = hf(input_ids=ids(), use_cache=False).logits
    torch.testing.assert_close(got["logits"], want, atol=1e-4, rtol=1e-4)

    # 2. one GRPO step equals the 1-rank step; the saved state loads back on 2 ranks.
    metrics, sync = one_rank_step(hf, rl_batch(0), replay=False)
    step = torch.load(tmp_path / "step.pt", weights_only=False)
    assert_same_step(step, metrics, sync, before)
    assert sorted(p.name for p in (tmp_path / "state").glob("megatron_*.pt")) == [
        "megatron_tp00_ep00.pt", "megatron_tp00_ep01.pt"]
    reloaded = torch.load(tmp_path / "reloaded.pt", weights_only=False)
    assert reloaded["opt_step"] == 2
    assert all(torch.equal(reloaded["sync"][k], t) for k, t in step["sync"].items())

    # 3. routing replay under EP: the same update as one rank's replayed step, which differs
    #    from the step without replay (the records are far from the router's choices).
    metrics_r, sync_r = one_rank_step(hf, batch, replay=True)
    replay = torch.load(tmp_path / "replay.pt", weights_only=False)
    assert_same_step(replay, metrics_r, sync_r, before)
    assert replay["metrics"]["train/routing_replay_tokens"] == metrics_r[
        "train/routing_replay_tokens"] > 0
    assert replay["metrics"]["train/routing_replay_changed"] == pytest.approx(
        metrics_r["train/routing_replay_changed"], abs=1e-9)
    assert metrics_r["train/routing_replay_changed"] > 0.5
    assert metrics_r["train/loss"] != pytest.approx(metrics["train/loss"], rel=1e-3)

    # 4. the launch path (rank 0 drives, rank 1 follows): its sync and export are whole.
    launch = torch.load(tmp_path / "launch.pt", weights_only=False)
    assert_same_step(launch, metrics, sync, before)
    exported = HFReader(tmp_path / "export")
    assert sorted(exported.names()) == sorted(before)
    assert all(torch.equal(exported(k), launch["sync"][k]) for k in before)

    # 5. megatron's DDP + distributed optimizer (an expert optimizer chained to the dense one,
    #    experts reduced over the expert-data-parallel group), saved per EP rank and resumed.
    from ep_worker import megatron_optimizer_steps

    mopt = torch.load(tmp_path / "megatron_opt.pt", weights_only=False)
    assert mopt["optimizer"] == "ChainedOptimizer"
    assert sorted(p.name for p in (tmp_path / "megatron_state").glob("*.pt")) == [
        "megatron_tp00_ep00.pt", "megatron_tp00_ep00_optim_params.pt",
        "megatron_tp00_ep01.pt", "megatron_tp00_ep01_optim_params.pt"]
    ref = megatron_optimizer_steps(tmp_path / "init", tmp_path / "one_rank_state", 1)
    for when in ("first", "second"):
        (m_ep, w_ep), (m_1, w_1) = mopt[when], ref[when]
        assert_same_step({"metrics": m_ep, "sync": w_ep}, m_1, w_1, before)

