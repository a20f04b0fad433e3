"""Models and tokenizers made on the spot: no downloads.

Owns: training a small byte-level BPE tokenizer on a text corpus (with the chat and tool-call
markup as added tokens, and one token per digit so arithmetic is learnable), building a
randomly initialised causal LM from a transformers config dict (Qwen3 first), and loading
either from an HF directory. Used by the tiny curriculum and by tests; large runs load `path`.

Does not own: what the model is trained on or how it is served.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from asyncrl.errors import ConfigError, ModelError

# Markup the formats rely on; each becomes one token so small models learn it quickly.
CHAT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = [
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<reason>", "</reason>", "<answer>", "</answer>", "\\boxed{",
    "```python\n", "```output\n", "```\n", "```",
]

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 2048) -> Any:
    """Train a byte-level BPE tokenizer on `corpus`; returns a `PreTrainedTokenizerFast`.

    Digits are split one per token; the ChatML specials and the markup tokens are added whole.
    Deterministic for a given corpus and size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHAT_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens(MARKUP_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(init: dict[str, Any], tokenizer: Any, seed: int = 0, dtype: str = "float32") -> Any:
    """A randomly initialised causal LM from a transformers config dict (needs `model_type`).

    `vocab_size`, `eos_token_id`, `pad_token_id` and `bos_token_id` come from the tokenizer.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    opts = dict(init)
    model_type = opts.pop("model_type")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id
    opts.setdefault("vocab_size", _padded_vocab(len(tokenizer)))
    cfg = AutoConfig.for_model(model_type, eos_token_id=eos, pad_token_id=pad, bos_token_id=pad,
                               **opts)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    quiet_known_warnings()  # after from_config: its catch_warnings() restores the filters
    return model


def moe_shape(config: Any) -> tuple[int, int, int] | None:
    """(sparse layers, experts chosen per token, experts) of an HF mixture-of-experts config
    (Qwen3-MoE's fields: `num_experts`, `num_experts_per_tok`, `decoder_sparse_step`,
    `mlp_only_layers`), or None for a dense model."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or 0
    top_k = getattr(cfg, "num_experts_per_tok", None) or 0
    if not experts or not top_k:
        return None
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    layers = sum(1 for i in range(cfg.num_hidden_layers)
                 if i not in dense and (i + 1) % step == 0)
    return (layers, top_k, experts) if layers else None


def routers(model: Any) -> list[Any]:
    """The router modules of an HF mixture-of-experts model, in layer order: transformers'
    `*TopKRouter`s (Qwen3-MoE's `Qwen3MoeTopKRouter` and the families that share its contract:
    `forward(hidden [N, H]) -> (logits [N, E], weights [N, k], indices [N, k])`, attributes
    `top_k`, `num_experts`, `norm_topk_prob`). Empty for a dense model."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


_EXPERT_NAME = r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$"


def fuse_experts(tensors: dict[str, Any], own: Any) -> dict[str, Any]:
    """`tensors` by HF checkpoint name (one `mlp.experts.E.{gate,up,down}_proj.weight` per
    expert: what `save_pretrained`, SGLang and the Megatron trainer use) in the layout of the
    in-memory state dict `own` (transformers 5 fuses a Qwen3-MoE's experts:
    `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]). Names already
    in `own`, and all of them for a model without fused experts, pass through; a fused tensor
    some of whose experts are missing is left out (the caller's missing-name check says so)."""
    import re

    import torch

    pattern = re.compile(_EXPERT_NAME)
    out: dict[str, Any] = {}
    parts: dict[str, dict[tuple[int, str], Any]] = {}
    for name, t in tensors.items():
        m = pattern.match(name)
        if name in own or m is None or f"{m.group(1)}.down_proj" not in own:
            out[name] = t
            continue
        parts.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = t
    for stem, got in parts.items():
        n = own[f"{stem}.down_proj"].shape[0]
        if len(got) != 3 * n:
            continue
        out[f"{stem}.gate_up_proj"] = torch.stack(
            [torch.cat([got[e, "gate"], got[e, "up"]]) for e in range(n)])
        out[f"{stem}.down_proj"] = torch.stack([got[e, "down"] for e in range(n)])
    return out


def routing_replay(setting: bool | None, config: Any) -> bool:
    """Whether a run replays the rollout's expert choices in the update
    (`algorithm.routing_replay`): left unset, on exactly for an MoE model. Set true on a dense
    model, a `ConfigError`: there is nothing to replay."""
    moe = moe_shape(config) is not None
    if setting and not moe:
        kind = getattr(config, "model_type", "?")
        raise ConfigError("algorithm.routing_replay", f"true, but the model ({kind}) is dense: "
                          "it has no experts to record or replay; leave it unset or false")
    return moe if setting is None else setting


def _padded_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def _not_a_model(path: str | Path, what: str, e: Exception) -> ModelError:
    """transformers' error for a bad path ("Repo id must be in the form...", a missing file)
    says little about the path; this one names it."""
    p = Path(path)
    if not p.exists():
        why = "no such file or directory"
    elif not p.is_dir():
        why = "a file, not a directory"
    elif not (p / "config.json").exists():
        why = "no config.json in it"
    else:  # a model directory that transformers could not load: say what it said
        return ModelError(f"cannot load the {what} in {path}: {type(e).__name__}: {e}")
    return ModelError(f"{path} is not a {what} directory ({why})")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these makes a directory hold a tokenizer (without one, transformers quietly builds
a tokenizer of one token from `config.json`, and every text encodes to nothing)."""


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in an HF directory. Raises `ModelError` naming `path`, also for a
    directory that holds no tokenizer files (a model directory of weights alone) and for a
    tokenizer that encodes text to nothing."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.is_dir() and (p / "config.json").exists() and not has_tokenizer(p):
        raise ModelError(f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                         "point tokenizer.path at the directory the model's tokenizer was "
                         "saved in (for a LoRA run's final/merged or final/base: final/)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:  # HFValidationError is a ValueError
        raise _not_a_model(path, "tokenizer", e) from None
    if not tok("What is 12+7?")["input_ids"]:
        raise ModelError(f"the tokenizer in {path} encodes text to no tokens at all "
                         f"(vocabulary of {len(tok)}): not a usable tokenizer")
    return tok


def save_tokenizer_everywhere(tokenizer: Any, final: str | Path) -> None:
    """Save `tokenizer` into `final` and into each HF model directory just under it (a LoRA
    run's `merged/` and `base/`), so that each one loads alone."""
    root = Path(final)
    tokenizer.save_pretrained(root)
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and (sub / "config.json").exists():
            tokenizer.save_pretrained(sub)


def load_model(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False) -> Any:
    """A causal LM from an HF directory (or hub id). Raises `ModelError` naming `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with _no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
            )
    except (OSError, ValueError) as e:  # HFValidationError is a ValueError
        raise _not_a_model(path, "model", e) from None
    quiet_known_warnings()  # after loading: from_pretrained's catch_warnings() restores filters
    return model


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers draws a progress bar on stderr for every load and save of a few-MB
    model; a library call should not. Restored afterwards if the host had them on."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def quiet_known_warnings() -> None:
    """Silence the one dependency warning every run printed: transformers 5 deprecates the
    `past_key_values=` keyword the local engine passes (it still works; the engine's owner
    moves it to `cache=`). Matched on its message, so any other warning still shows."""
    import warnings

    warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated",
                            category=FutureWarning)


def save(model: Any, tokenizer: Any, path: str | Path) -> Path:
    """Save model and tokenizer in HF format (safetensors) so every other tool loads them."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with _no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
