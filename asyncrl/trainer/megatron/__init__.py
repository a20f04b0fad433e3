"""`trainer.kind = "megatron"`: a megatron-core GPT model trained behind the `Trainer` protocol.

Modules (nothing here imports megatron-core at import time; `model.py` does on first use, and
imports `sdpa_attention`, which needs it, only then):
- `arch`: a HF config (Qwen3, Qwen2, Llama) read into the facts the model needs.
- `convert`: HF <-> Megatron weight names and tensor layouts, per parameter and TP rank.
- `hf_files`: lazy reads and sharded writes of HF safetensors directories.
- `model`: megatron parallel state, building the `GPTModel`, weights in/out, logits.
- `sdpa_attention`: the core attention on torch's fused SDPA used when TE is absent.
- `memory`: memory estimates per rank and the `recompute = "auto"` choice.
- `vocab_parallel`: token logprobs and entropy over the TP-split vocabulary.
- `trainer`: `MegatronTrainer` (RL and SFT steps, export, state).
- `optimizer`: megatron's DDP + optimizer on CUDA, torch AdamW with collectives otherwise.
- `launch`: torchrun runs with the event loop on rank 0 and the other ranks following.
- `cpu_compat`: the patches that let megatron-core run on a CPU-only torch over gloo: the RNG
  and device ones for any CPU run (installed by `model.init_parallel`), its DDP and optimizers
  too for the tests.
"""
