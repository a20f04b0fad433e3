"""Prompts the local-engine tests share: short and long, chat markup, a code fence, a repeated
letter, a half-written reason: contexts whose continuations differ."""

PROMPTS = ["What is 12 + 7?", "<|im_start|>user\nhello there, compute 3*4<|im_end|>\n",
           "```python\nprint(1)", "aaa", "What is 1234 + 9876? <reason>Let me"]


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `ids` from `model.generate` (no EOS stop): what an engine's
    greedy output must equal."""
    import torch

    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()
