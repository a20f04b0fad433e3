"""Which part of a tool answer each token belongs to: the classes the answer-analysis measures
(`sampling_mass`, `copy_leak`, `policy_drift`) split their figures by.

- `choice`: inside `<reason>...</reason>` (answer directly, or call the tool);
- `code digits`: digits inside the program (numbers copied from the question);
- `code other`: the rest of the program (which function, brackets, names);
- `answer`: inside `<answer>...</answer>` (the tool's output copied into the answer);
- `other`: fences, the end token.

Pure text work on decoded tokens; it owns no tokenizer and reads no file.
"""

from __future__ import annotations

import re

CLASSES = ("choice", "code digits", "code other", "answer", "other")
_SPANS = (("<reason>", "</reason>", "choice"), ("```python", "```", "code"),
          ("<answer>", "</answer>", "answer"))


def classify(pieces: list[str]) -> list[str]:
    """The class of each decoded token of one response (a token belongs to the span its first
    character falls in; a span opens after its opening marker and closes at its end marker)."""
    text = "".join(pieces)
    owner = ["other"] * len(text)
    for start, end, name in _SPANS:
        for m in re.finditer(re.escape(start), text):
            stop = text.find(end, m.end())
            stop = len(text) if stop < 0 else stop
            for i in range(m.end(), stop):
                owner[i] = name
    out, at = [], 0
    for piece in pieces:
        cls = owner[at] if at < len(owner) and piece else "other"
        if cls == "code":
            cls = "code digits" if piece.strip().isdigit() else "code other"
        out.append(cls)
        at += len(piece)
    return out
