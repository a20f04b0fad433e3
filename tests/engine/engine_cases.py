"""Prompts the local-engine tests share: short and long, chat markup, a code fence, a repeated
letter, a half-written reason: contexts whose continuations differ."""

PROMPTS = ["What is 12 + 7?", "<|im_start|>user\nhello there, compute 3*4<|im_end|>\n",
           "```python\nprint(1)", "aaa", "What is 1234 + 9876? <reason>Let me"]
