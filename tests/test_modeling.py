"""Locally built tokenizer and model: markup is whole tokens, digits split, HF round trip."""

from __future__ import annotations

import torch

from asyncrl.modeling import load_model, load_tokenizer


def test_tokenizer_markup_and_digits(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    for mark in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "```python\n"]:
        ids = tok.encode(mark, add_special_tokens=False)
        assert len(ids) == 1, mark
    digits = tok.encode("12345", add_special_tokens=False)
    assert len(digits) == 5
    text = "x = 12 * 34\n<answer>\\boxed{408}</answer>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_saves_and_loads(tiny_model_dir, tiny_model_factory) -> None:
    m0 = tiny_model_factory(0)
    m1 = load_model(tiny_model_dir).eval()
    tok = load_tokenizer(tiny_model_dir)
    ids = torch.tensor([tok.encode("What is 1 + 2?", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.allclose(m0(ids).logits, m1(ids).logits)
    assert m1.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_a_model_directory_without_a_tokenizer_is_refused_by_name(tmp_path, tiny_model_dir,
                                                                    tiny_tokenizer) -> None:
    # a LoRA run's final/merged was written with weights alone: transformers built a tokenizer
    # of one token from config.json, every prompt encoded to [], every rollout failed
    import shutil

    import pytest

    from asyncrl.errors import ModelError
    from asyncrl.modeling import save_tokenizer_everywhere

    final = tmp_path / "final"
    weights = final / "merged"
    weights.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / f, weights / f)
    with pytest.raises(ModelError, match=r"merged holds no tokenizer .*final/"):
        load_tokenizer(weights)
    save_tokenizer_everywhere(tiny_tokenizer, final)
    for d in (final, weights):
        assert load_tokenizer(d)("What is 12+7?")["input_ids"]
