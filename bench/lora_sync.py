"""What one weight sync costs with LoRA against full weights, on the tiny curriculum's model.

Builds `curricula/tiny.toml`'s model (0.9M parameters, Qwen3 architecture) twice: one
full-parameter torch trainer, one with `[trainer.lora]` adapters (rank 16, every linear layer,
as `curricula/tiny-lora.toml`), each next to a `LocalEngine` holding a copy. After one training
step each, it times the train loop's push (`asyncrl.weightsync.push.push_weights`) in both
modes: "tensor" (the payload in memory, applied by the in-process engine) and "disk" (the
export written, then loaded by the engine), and counts the payload's bytes. The LoRA arm's
first push carries the base as well; the rows are the steady state (adapter only), the median
of `--repeats` pushes. Also prints, for shape, the adapter's share and bytes of a Qwen3-14B
(the rStar2 recipe's model) at the same rank, computed from its config (nothing is built).

    python bench/lora_sync.py [--rank 16] [--repeats 20] [--threads 1]

Prints a table and writes `bench/results/lora_sync.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

TINY = dict(model_type="qwen3", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True,
            vocab_size=1024)
QWEN3_14B = dict(hidden=5120, intermediate=17408, layers=40, heads=40, kv_heads=8, head_dim=128,
                 vocab=151936, params=14.77e9)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Tok:
    eos_token_id, pad_token_id = 1, 0

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def _model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def _arm(lora: bool, rank: int, repeats: int) -> list[dict]:
    from asyncrl.config import AlgorithmSection, LoraSection, TorchTrainerConfig
    from asyncrl.engine.local.engine import LocalEngine
    from asyncrl.trainer.torch_trainer import TorchTrainer
    from asyncrl.weightsync.push import push_weights

    model = _model()
    engine_model = copy.deepcopy(model)
    cfg = TorchTrainerConfig(lora=LoraSection(rank=rank, alpha=2 * rank) if lora else None)
    tr = TorchTrainer(model, cfg, AlgorithmSection(lr=1e-3), pad_token_id=0)
    tr.sft_step([(list(range(2, 40)), [0] * 8 + [1] * 30)])
    trainable = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in tr.model.named_parameters() if ".lora_" not in n)
    rows = []
    async with LocalEngine(engine_model, _Tok(), kv_token_budget=256, max_running=2) as eng:
        version = 0
        for mode in ("tensor", "disk"):
            with tempfile.TemporaryDirectory() as tmp:
                version += 1
                await push_weights([eng], tr, version, mode, Path(tmp))  # LoRA: with the base
                times, size = [], 0
                for _ in range(repeats):
                    version += 1
                    t0 = time.perf_counter()
                    up = await push_weights([eng], tr, version, mode, Path(tmp))
                    times.append((time.perf_counter() - t0) * 1e3)
                    if mode == "tensor":
                        payload = up.adapter if lora else up.state_dict
                        size = sum(t.numel() * t.element_size()
                                   for t in dict(payload).values())  # type: ignore[call-overload]
                    else:
                        size = _dir_bytes(Path(up.adapter_path or up.path))
            rows.append(dict(arm="lora" if lora else "full", mode=mode, bytes=size,
                             ms_median=statistics.median(times), ms_min=min(times),
                             trainable=trainable, total=total))
    return rows


def qwen3_14b_adapter(rank: int) -> dict:
    q = QWEN3_14B
    h, i, kv = q["hidden"], q["intermediate"], q["kv_heads"] * q["head_dim"]
    attn_out = q["heads"] * q["head_dim"]
    shapes = [(h, attn_out), (h, kv), (h, kv), (attn_out, h), (h, i), (h, i), (i, h)]
    per_layer = sum(rank * (a + b) for a, b in shapes)
    params = per_layer * q["layers"]
    return dict(rank=rank, adapter_params=params, share=params / q["params"],
                adapter_bytes_bf16=2 * params, full_bytes_bf16=2 * q["params"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "lora_sync.json"))
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    rows = [*asyncio.run(_arm(False, a.rank, a.repeats)),
            *asyncio.run(_arm(True, a.rank, a.repeats))]
    print(f"{'arm':<5} {'mode':<7} {'trainable':>10} {'share':>7} {'sync bytes':>11} "
          f"{'ms median':>10} {'ms min':>8}")
    for r in rows:
        print(f"{r['arm']:<5} {r['mode']:<7} {r['trainable']:>10,} "
              f"{r['trainable'] / r['total']:>7.1%} {r['bytes']:>11,} {r['ms_median']:>10.2f} "
              f"{r['ms_min']:>8.2f}")
    big = qwen3_14b_adapter(a.rank)
    print(f"Qwen3-14B at rank {a.rank}: {big['adapter_params']:,} adapter parameters "
          f"({big['share']:.2%}), {big['adapter_bytes_bf16'] / 2**20:.0f} MiB per sync in bf16 "
          f"against {big['full_bytes_bf16'] / 2**30:.1f} GiB of full weights")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(rank=a.rank, repeats=a.repeats, threads=a.threads,
                                   time=time.strftime("%Y-%m-%dT%H:%M:%S"), rows=rows,
                                   qwen3_14b=big), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
