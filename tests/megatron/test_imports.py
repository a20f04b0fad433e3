"""megatron-core stays optional: nothing imports it until a Megatron trainer is built, and a
missing install is a clear `TrainerError`, not an ImportError deep in a run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.config import AlgorithmSection, MegatronTrainerConfig
from asyncrl.errors import TrainerError
from asyncrl.trainer.megatron.errors import MegatronUnavailableError


def test_importing_asyncrl_and_this_package_does_not_import_megatron():
    code = (
        "import sys, asyncrl, asyncrl.trainer, asyncrl.train, asyncrl.runtime\n"
        "from asyncrl.trainer.megatron import arch, convert, hf_files, model, launch, trainer\n"
        "from asyncrl.trainer.megatron import vocab_parallel, cpu_compat\n"
        "assert 'megatron' not in sys.modules, sorted(m for m in sys.modules if 'megatron' in m)\n"
        "from asyncrl.trainer import TRAINER_KINDS\n"
        "assert 'megatron' in TRAINER_KINDS\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_missing_megatron_core_is_a_trainer_error_saying_how_to_install(monkeypatch):
    from asyncrl.trainer import TRAINER_KINDS

    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron.* now fails
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(MegatronUnavailableError, match="pip install") as e:
        TRAINER_KINDS["megatron"]("unused", MegatronTrainerConfig(), AlgorithmSection(),
                                  pad_token_id=0)
    assert isinstance(e.value, TrainerError)


def test_pipeline_parallel_is_refused_up_front():
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    with pytest.raises(TrainerError, match="pipeline_parallel"):
        MegatronTrainer("unused", MegatronTrainerConfig(pipeline_parallel=2), AlgorithmSection(),
                        pad_token_id=0)


def test_launch_helper_prints_a_two_node_torchrun_command():
    from pathlib import Path

    script = Path(__file__).parents[2] / "tools" / "launch_multinode.sh"
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "NNODES": "2", "NODE_RANK": "1",
           "HEAD_NODE": "10.0.0.1", "GPUS_PER_NODE": "8"}
    out = subprocess.run(["bash", str(script), "run.toml", "--resume"], env=env,
                         capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert out[:3] == ["torchrun", "--nnodes", "2"]
    assert "--node-rank" in out and out[out.index("--node-rank") + 1] == "1"
    assert out[out.index("--rdzv-endpoint") + 1] == "10.0.0.1:29500"
    assert out[-5:] == ["-m", "asyncrl.cli.launch", "train", "run.toml", "--resume"]
    # a follower never hosts the rendezvous store; no address given: torchrun's own choice
    assert out[out.index("--rdzv-conf") + 1] == "is_host=0" and "--local-addr" not in out


def test_launch_helper_hosts_the_store_on_the_head_and_advertises_node_addr():
    from pathlib import Path

    script = Path(__file__).parents[2] / "tools" / "launch_multinode.sh"
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "NNODES": "2", "NODE_RANK": "0",
           "HEAD_NODE": "10.0.0.1", "NODE_ADDR": "10.0.0.1", "GPUS_PER_NODE": "8",
           "GLOO_SOCKET_IFNAME": "ib0"}
    out = subprocess.run(["bash", str(script), "run.toml"], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout.split()
    assert out[0] == "GLOO_SOCKET_IFNAME=ib0"  # an operator's choice is kept
    assert out[out.index("--rdzv-conf") + 1] == "is_host=1"
    assert out[out.index("--local-addr") + 1] == "10.0.0.1"


def test_followers_get_a_path_for_a_model_loaded_from_disk(tmp_path):
    from mg_cases import hf_model
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.megatron.launch import _portable_model

    model = hf_model("llama")
    assert _portable_model(model) is model  # built in memory: sent whole
    model.save_pretrained(tmp_path)
    assert _portable_model(AutoModelForCausalLM.from_pretrained(tmp_path)) == str(tmp_path)


def test_rank_zero_proxy_never_exposes_the_collective_step_hooks():
    # Called on rank 0 alone, a collective hook would wait forever for the followers.
    from types import SimpleNamespace

    from asyncrl.algo.step import StepBackend
    from asyncrl.trainer.megatron.launch import _COLLECTIVE_HOOKS, RankZeroTrainer

    inner = SimpleNamespace(model="m", apply_gradients=lambda s: (0.0, 0.0), reduce_metrics=dict)
    proxy = RankZeroTrainer(inner)
    assert proxy.model == "m"
    for name in ("apply_gradients", "reduce_metrics"):
        with pytest.raises(AttributeError):
            getattr(proxy, name)
    hooks = {n for n in vars(StepBackend) if not n.startswith("_")}
    assert hooks - {"dp_size", "optimizer_step"} <= _COLLECTIVE_HOOKS


def test_a_broken_group_names_the_ranks_at_the_peer_address_it_lost():
    from asyncrl.trainer.megatron.launch import lost_ranks

    places = [("a", "10.0.0.1"), ("b", "10.0.0.2"), ("b", "10.0.0.2"), ("c", "10.0.0.3")]
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:50318: "
                        "Connection reset by peer")
    assert lost_ranks(gloo, places) == "rank 1 on 10.0.0.2 (b), rank 2 on 10.0.0.2 (b)"
    assert lost_ranks(RuntimeError("watchdog: rank 3 timed out"), places) == "rank 3 on 10.0.0.3 (c)"
    # nothing to go by: every other rank is named
    assert lost_ranks(RuntimeError("Connection closed"), places).count("rank") == 3
