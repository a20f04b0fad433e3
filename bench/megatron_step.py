"""Megatron trainer update-step throughput and MFU on one GPU, for a config-initialised Qwen3,
optionally beside the torch trainer on the same batch in the same run (`--compare-torch`).

One `train_step` is what an RL step costs the trainer: a no-grad forward over the batch (old
logprobs), then forward + backward + AdamW step per mini-batch. The batch is synthetic (prompt
+ response tokens, tool-output spans masked), the model a randomly initialised Qwen3 of the
chosen size built straight from its HF config (no download). `--compare-torch` then builds the
same config as a HF model (`attn_implementation="sdpa"`) for `TorchTrainer` and times it on the
same batch: Megatron first, released, then torch, each with its own peak-memory reading.

Model FLOPs per trained token (dense, causal attention counted once, no recompute):
forward = 2 * P_matmul + 2 * layers * seq * q_dim, where P_matmul counts every matmul weight
including the LM head; an RL step costs 4 forwards per token (1 for the old logprobs, 3 for
forward + backward). MFU = model FLOPs per second / the GPU's dense bf16 peak. Recomputation
is work the MFU does not count.

Recompute: `--recompute auto` (the trainer's default) takes the cheapest of none / selective
(the MLP) / full whose estimate fits the GPU (`asyncrl/trainer/megatron/memory.py`); name one to
force it. The CUDA allocator runs with `expandable_segments:True` unless
PYTORCH_CUDA_ALLOC_CONF is set; `num_alloc_retries` (each a synchronising free-and-retry) is
reported.

    python bench/megatron_step.py [--size 1.7b] [--seq-len 4096] [--seqs 16] [--steps 5]
    python bench/megatron_step.py --size 1.7b --compare-torch     # both trainers, one table
    python bench/megatron_step.py --attention local               # megatron's unfused core
    python bench/megatron_step.py --profile bench/results/trace   # + one profiled step
    python bench/megatron_step.py --export-sglang                 # also: the export loads
    python bench/megatron_step.py --size tiny --compare-torch     # CPU: a smoke check only

Without CUDA it runs on the CPU through `cpu_compat` (fp32; figures check the script, not
speed). Prints a table, writes bench/results/megatron_step.json (`--out` elsewhere). Single
process (TP = DP = 1); run under torchrun with `--tp N` for tensor parallel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
    # Qwen3-MoE: the tiny one for the CPU, and Qwen3-30B-A3B's layer (128 experts of 768,
    # top-8, 32 heads, 4 KV heads) in a stack of 2 layers: the MoE step's MFU on one GPU
    "moe-tiny": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128,
                     moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=512),
    "30b-a3b-2l": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                       moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                       num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
                       head_dim=128),
}
RESULTS = Path(__file__).parent / "results"
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}


def hf_config(size: str, dtype: str) -> Any:
    from transformers import AutoConfig

    opts = {"vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, **SIZES[size]}
    kind = opts.pop("model_type", "qwen3")
    cfg = AutoConfig.for_model(kind, rope_parameters={"rope_type": "default",
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
    if arch.num_experts:  # the active experts' width, and the router
        f = arch.moe_top_k * arch.moe_ffn_hidden_size + arch.num_experts / 3
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


def measure(step: Any, batch: Any, steps: int) -> dict[str, Any]:
    """Warm up once, then time `steps` calls of `step(batch)`; peak memory over the timed steps."""
    import torch

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step(batch)  # warm-up: allocator, kernels, torch.compile
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    times, metrics = [], {}
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics = step(batch)
        sync()
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"step_s_median": sorted(times)[len(times) // 2], "step_s_all": times,
                           "loss": metrics.get("train/loss"),
                           "grad_norm": metrics.get("train/grad_norm"),
                           "entropy": metrics.get("train/entropy")}
    if cuda:
        stats = torch.cuda.memory_stats()
        out.update(peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
                   peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                   alloc_retries=stats.get("num_alloc_retries", 0) - retries0)
    return out


def throughput(run: dict[str, Any], flops: float, tokens: int, world: int,
               peak: float | None) -> dict[str, Any]:
    step_s = run["step_s_median"]
    tflops = flops / step_s / 1e12 / world
    return {"tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / world,
            "model_tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None}


def profile_step(step: Any, batch: Any, out_dir: Path) -> list[str]:
    """One step under torch.profiler: a Chrome trace in `out_dir`, the top ops as text."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    with profile(activities=acts) as prof:
        step(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    out_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out_dir / "megatron_step_trace.json"))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=20)
    (out_dir / "megatron_step_top_ops.txt").write_text(table)
    return table.splitlines()


def torch_trainer(cfg: Any, args: argparse.Namespace) -> Any:
    """`TorchTrainer` on the same config as a HF model with SDPA attention."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.config import AlgorithmSection, TorchTrainerConfig
    from asyncrl.trainer.torch_trainer import TorchTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype),
                                             attn_implementation="sdpa")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return TorchTrainer(model, TorchTrainerConfig(
        device=device, micro_batch_tokens=args.micro_batch_tokens,
        gradient_checkpointing=args.torch_checkpointing), AlgorithmSection(lr=1e-6),
        pad_token_id=0)


def print_table(res: dict[str, Any]) -> None:
    runs = [("megatron", res["megatron"])] + ([("torch", res["torch"])] if "torch" in res else [])

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        v = r.get(key)
        return "n/a" if v is None else format(v, fmt)

    rows = [("step (median) s", "step_s_median", ".3f"),
            ("tokens/s/GPU", "tokens_per_s_per_gpu", ",.0f"),
            ("model TFLOP/s/GPU", "model_tflops_per_gpu", ".1f"),
            ("MFU", "mfu", ".1%"),
            ("peak memory GiB", "peak_mem_gib", ".1f"),
            ("peak reserved GiB", "peak_reserved_gib", ".1f"),
            ("alloc retries", "alloc_retries", "d"),
            ("loss", "loss", ".4f"),
            ("entropy", "entropy", ".3f")]
    print(f"model   qwen3-{res['size']} ({res['params'] / 1e9:.2f}B), {res['dtype']}, "
          f"{res['seqs']} x {res['seq_len']} tokens, micro-batch {res['micro_batch_tokens']}")
    print(f"device  {res['device']} x{res['gpus']} (tp={res['tp']}); megatron: attention "
          f"{res['megatron']['attention']}, recompute {res['megatron']['recompute']}, "
          f"{res['megatron']['optimizer']}"
          + (f"; torch: gradient checkpointing {res['torch']['gradient_checkpointing']}"
             if "torch" in res else ""))
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  " + "".join(f"{name:>14}" for name, _ in runs))
    for label, key, fmt in rows:
        print(f"{label:<{width}}  " + "".join(f"{cell(r, key, fmt):>14}" for _, r in runs))
    if "torch_speedup" in res:
        print(f"{'megatron / torch':<{width}}  {res['torch_speedup']:>13.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="1.7b")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=16, help="sequences per RL step")
    ap.add_argument("--steps", type=int, default=5, help="timed RL steps (after 1 warm-up)")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--recompute", choices=["auto", "none", "selective", "full"], default="auto")
    ap.add_argument("--attention", choices=["auto", "sdpa", "local", "te"], default="auto",
                    help="megatron core attention (auto: TE if installed, else torch SDPA)")
    ap.add_argument("--sdpa-backends", default=None,
                    help="comma-separated SDPA kernels in priority order, e.g. cudnn,flash "
                         "(torch.nn.attention.SDPBackend names); default: torch's choice")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--compare-torch", action="store_true",
                    help="also time TorchTrainer on the same batch, in this run")
    ap.add_argument("--no-torch-checkpointing", dest="torch_checkpointing",
                    action="store_false",
                    help="TorchTrainer without gradient checkpointing (default: with)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="profile one extra Megatron step: trace and top ops into this dir")
    ap.add_argument("--export-sglang", action="store_true")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir for --export-sglang")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="shorthand: --size tiny --seq-len 128 --seqs 8 --steps 2 "
                         "--micro-batch-tokens 512 (on CPU)")
    ap.add_argument("--out", type=Path, default=RESULTS / "megatron_step.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", module="megatron")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    import torch

    from asyncrl.config import AlgorithmSection, MegatronTrainerConfig
    from asyncrl.trainer.megatron.model import core_attention
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    if args.cpu_smoke:
        args.size, args.seq_len, args.seqs, args.steps = "tiny", 128, 8, 2
        args.micro_batch_tokens = 512
    cuda = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    ctx: Any = contextlib.nullcontext()
    if not cuda:
        from asyncrl.trainer.megatron.cpu_compat import cpu_megatron

        print("no CUDA: running on the CPU (cpu_compat); the figures check the script, "
              "not speed", file=sys.stderr)
        ctx = cpu_megatron()
    kernels: Any = contextlib.nullcontext()
    if args.sdpa_backends:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [getattr(SDPBackend, n.strip().upper() if n.strip() != "cudnn"
                         else "CUDNN_ATTENTION") for n in args.sdpa_backends.split(",")]
        kernels = sdpa_kernel(order, set_priority=True)

    with ctx, kernels:
        cfg = hf_config(args.size, args.dtype)
        trainer = MegatronTrainer(
            cfg, MegatronTrainerConfig(tensor_parallel=args.tp, recompute=args.recompute,
                                       micro_batch_tokens=args.micro_batch_tokens),
            AlgorithmSection(lr=1e-6), pad_token_id=0, dtype=args.dtype,
            attention=args.attention)
        batch = synthetic_batch(args.seqs, args.seq_len, cfg.vocab_size)
        arch, world = trainer.arch, trainer.layout.world_size
        tokens = args.seqs * args.seq_len
        flops = 4.0 * forward_flops_per_token(arch, args.seq_len) * tokens
        device = torch.cuda.get_device_name() if cuda else "cpu"
        peak = peak_tflops(device)
        mg = measure(trainer.train_step, batch, args.steps)
        mg.update(throughput(mg, flops, tokens, world, peak),
                  attention=core_attention(trainer.model), recompute=trainer.recompute,
                  optimizer=type(trainer._opt).__name__)
        res: dict[str, Any] = {
            "bench": "megatron_step", "device": device, "gpus": world, "size": args.size,
            "params": arch.num_params(), "dtype": args.dtype, "tp": args.tp,
            "seq_len": args.seq_len, "seqs": args.seqs,
            "micro_batch_tokens": args.micro_batch_tokens, "sdpa_backends": args.sdpa_backends,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "model_flops_per_step": flops, "megatron": mg,
            "torch_version": torch.__version__, "cmd": " ".join(sys.argv),
        }
        if args.profile is not None and trainer.layout.rank == 0:
            res["profile_top_ops"] = profile_step(trainer.train_step, batch, args.profile)
        if args.export_sglang:
            res.update(export_and_load_in_sglang(trainer, RESULTS / "megatron_export",
                                                 args.tokenizer))
        rank = trainer.layout.rank
        trainer.close()
        del trainer
        if args.compare_torch and world == 1:
            if cuda:
                torch.cuda.empty_cache()
            tt = torch_trainer(cfg, args)
            tr = measure(tt.train_step, batch, args.steps)
            tr.update(throughput(tr, flops, tokens, world, peak),
                      gradient_checkpointing=args.torch_checkpointing)
            res["torch"] = tr
            res["torch_speedup"] = tr["step_s_median"] / mg["step_s_median"]
        if rank == 0:
            print_table(res)
            if "profile_top_ops" in res:
                print("\n".join(res["profile_top_ops"]))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=2) + "\n")
            print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
