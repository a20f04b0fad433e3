"""Megatron trainer update-step throughput and MFU on one GPU, for a config-initialised Qwen3.

One `MegatronTrainer.train_step` is what an RL step costs the trainer: a no-grad forward over
the batch (old logprobs), then forward + backward + AdamW step per mini-batch. The batch is
synthetic (prompt + response tokens, tool-output spans masked), the model a randomly
initialised Qwen3 of the chosen size built straight from its HF config (no download).

Model FLOPs per trained token (dense, causal attention counted once, no recompute):
forward = 2 * P_matmul + 2 * layers * seq * q_dim, where P_matmul counts every matmul weight
including the LM head; an RL step costs 4 forwards per token (1 for the old logprobs, 3 for
forward + backward). MFU = model FLOPs per second / the GPU's dense bf16 peak.

    python bench/megatron_step.py [--size 1.7b] [--seq-len 4096] [--seqs 16] [--steps 5]
    python bench/megatron_step.py --export-sglang      # also: the HF export loads in SGLang
    python bench/megatron_step.py --cpu-smoke          # tiny model on CPU (cpu_compat), no GPU

Prints a table, writes bench/results/megatron_step.json. Single process (TP = DP = 1); run
under torchrun with `--tp N` for tensor parallel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Qwen3 dense shapes (public model configs); all tie embeddings below 8B.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
RESULTS = Path(__file__).parent / "results"
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}


def hf_config(size: str, dtype: str) -> Any:
    from transformers import AutoConfig

    opts = {"vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, **SIZES[size]}
    cfg = AutoConfig.for_model("qwen3", rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1_000_000.0}, **opts)
    cfg.dtype = dtype
    return cfg


def synthetic_batch(seqs: int, seq_len: int, vocab: int, seed: int = 0) -> Any:
    from asyncrl.records import Batch, Group, Problem, Rollout

    rng = random.Random(seed)
    prompt_len = min(256, seq_len // 4)
    groups = []
    per_group = 8 if seqs % 8 == 0 else seqs
    for g in range(seqs // per_group):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        rollouts = []
        for i in range(per_group):
            n = seq_len - prompt_len
            mask = [1] * n
            for start in range(200, n - 64, 1000):  # a 64-token tool output every 1000
                mask[start:start + 64] = [0] * 64
            rollouts.append(Rollout(
                rollout_id=f"{g}-{i}", prompt_id=str(g), group_id=str(g), policy_version=0,
                prompt_ids=prompt, response_ids=[rng.randrange(vocab) for _ in range(n)],
                loss_mask=mask, logprobs=[-1.0 if m else 0.0 for m in mask]))
        groups.append(Group(group_id=str(g), problem=Problem(id=str(g), question="q", answer="1"),
                            rollouts=rollouts, kept=list(range(per_group)),
                            advantages=[(-1.0) ** i for i in range(per_group)]))
    return Batch(step=0, policy_version=0, groups=groups)


def forward_flops_per_token(arch: Any, seq_len: int) -> float:
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    matmul_params = arch.num_layers * per_layer + arch.vocab_size * h
    return 2.0 * matmul_params + 2.0 * arch.num_layers * seq_len * q


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return tflops
    return None


def export_and_load_in_sglang(trainer: Any, out_dir: Path, tokenizer_dir: Path | None) -> dict:
    """Export HF weights and generate a few tokens from them with SGLang's offline engine."""
    trainer.export_hf(out_dir)
    try:
        import sglang
    except ImportError as e:
        return {"sglang": f"not installed ({e})"}
    if tokenizer_dir is None:
        return {"sglang": "skipped: --tokenizer DIR needed (an export holds no tokenizer)"}
    import shutil

    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out_dir / f.name)
    engine = sglang.Engine(model_path=str(out_dir), mem_fraction_static=0.3)
    try:
        out = engine.generate(input_ids=[[1, 2, 3, 4]],
                              sampling_params={"max_new_tokens": 8, "temperature": 0.0})
        return {"sglang": "ok", "generated_ids": out[0].get("output_ids")}
    finally:
        engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="1.7b")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=16, help="sequences per RL step")
    ap.add_argument("--steps", type=int, default=5, help="timed RL steps (after 1 warm-up)")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default="selective")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--export-sglang", action="store_true")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir for --export-sglang")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model, fp32, CPU via cpu_compat: checks the script, not speed")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON results (default bench/results/megatron_step.json; none for "
                         "--cpu-smoke)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", module="megatron")

    import torch

    from asyncrl.config import AlgorithmSection, MegatronTrainerConfig
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    ctx: Any = contextlib.nullcontext()
    if args.cpu_smoke:
        from asyncrl.trainer.megatron.cpu_compat import cpu_megatron

        args.size, args.seq_len, args.seqs, args.steps = "tiny", 128, 8, 2
        args.dtype, args.recompute, args.micro_batch_tokens = "float32", "none", 512
        ctx = cpu_megatron()
    elif not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu-smoke", file=sys.stderr)
        return 2

    with ctx:
        cfg = hf_config(args.size, args.dtype)
        trainer = MegatronTrainer(
            cfg, MegatronTrainerConfig(tensor_parallel=args.tp, recompute=args.recompute,
                                       micro_batch_tokens=args.micro_batch_tokens),
            AlgorithmSection(lr=1e-6), pad_token_id=0, dtype=args.dtype)
        batch = synthetic_batch(args.seqs, args.seq_len, cfg.vocab_size)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        trainer.train_step(batch)  # warm-up: allocator, kernels
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        times, metrics = [], {}
        for _ in range(args.steps):
            t0 = time.perf_counter()
            metrics = trainer.train_step(batch)
            sync()
            times.append(time.perf_counter() - t0)

        arch = trainer.arch
        tokens = args.seqs * args.seq_len
        step_s = sorted(times)[len(times) // 2]
        flops = 4.0 * forward_flops_per_token(arch, args.seq_len) * tokens
        world = trainer.layout.world_size
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        peak = peak_tflops(device)
        tflops = flops / step_s / 1e12 / world
        res: dict[str, Any] = {
            "bench": "megatron_step", "device": device, "gpus": world, "size": args.size,
            "params": arch.num_params(), "dtype": args.dtype, "tp": args.tp,
            "recompute": args.recompute, "seq_len": args.seq_len, "seqs": args.seqs,
            "micro_batch_tokens": args.micro_batch_tokens,
            "optimizer": type(trainer._opt).__name__,
            "step_s_median": step_s, "step_s_all": times,
            "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / world,
            "model_tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
            if torch.cuda.is_available() else None,
            "loss": metrics.get("train/loss"), "grad_norm": metrics.get("train/grad_norm"),
            "torch": torch.__version__, "cmd": " ".join(sys.argv),
        }
        if args.export_sglang:
            res.update(export_and_load_in_sglang(trainer, RESULTS / "megatron_export",
                                                 args.tokenizer))
        if trainer.layout.rank == 0:
            rows = [("model", f"qwen3-{args.size} ({arch.num_params() / 1e9:.2f}B), {args.dtype}"),
                    ("device", f"{device} x{world} (tp={args.tp})"),
                    ("batch", f"{args.seqs} x {args.seq_len} tokens"),
                    ("step (median)", f"{step_s:.3f} s"),
                    ("throughput", f"{res['tokens_per_s_per_gpu']:.0f} tokens/s/GPU"),
                    ("model TFLOP/s/GPU", f"{tflops:.1f}"),
                    ("MFU", f"{res['mfu']:.1%}" if res["mfu"] else "n/a (unknown peak)"),
                    ("peak memory", f"{res['peak_mem_gib']:.1f} GiB"
                     if res["peak_mem_gib"] else "n/a")]
            width = max(len(k) for k, _ in rows)
            for k, v in rows:
                print(f"{k:<{width}}  {v}")
            out = args.out or (None if args.cpu_smoke else RESULTS / "megatron_step.json")
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(res, indent=2) + "\n")
                print(f"wrote {out}")
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
