"""A stand-in for a finished `asyncrl train curricula/tiny.toml` run, made in seconds.

`make_run_dir(path)` writes what a run directory holds for `asyncrl.load_policy`: the
curriculum's resolved `config.json` and an HF model under `final/` (here a tiny random
Qwen3 and a tokenizer trained on the spot, so the answers are nonsense; the prompt, format
and budgets are the real curriculum's). The examples use it when no run directory is given.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl import config
from asyncrl.modeling import build_model, save, train_tokenizer

CURRICULUM = Path(__file__).resolve().parents[1] / "curricula" / "tiny.toml"
TINY = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "tie_word_embeddings": True}


def make_run_dir(path: Path) -> Path:
    corpus = [f"What is {a} + {b}? ```python\nprint({a}+{b})\n```\n```output\n{a + b}\n```\n"
              f"<answer>\\boxed{{{a + b}}}</answer>" for a in range(40) for b in range(0, 40, 7)]
    tok = train_tokenizer(corpus, vocab_size=400)
    save(build_model(TINY, tok, seed=0), tok, path / "final")
    config.write_resolved(config.load(CURRICULUM), path)
    return path
