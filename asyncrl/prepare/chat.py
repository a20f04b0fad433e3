"""Convert public function-calling / instruction / chat sets into OpenAI-messages JSONL.

    asyncrl data prepare glaive  -i glaive-function-calling-v2.json -o data/sft/glaive.jsonl
    asyncrl data prepare xlam    -o data/sft/xlam.jsonl        # hub name (needs network)

Owns: the default hub names of the supported sets, converting every row with
`asyncrl.sft.layouts` (the layouts themselves live there, as the SFT stage reads them too),
and the summary written beside the output. Every input row is accounted for: written, or
skipped with a reason (the first of each reason shown as `input:line N: message`). The output
rows are `{"id", "messages", "tools"}` in the checked layout: a `[stages.chat]` file the SFT
stage reads without converting again (`layout = "openai"`).

Sets (source name: layout, default input):
- `glaive`: glaiveai/glaive-function-calling-v2;
- `hermes`: NousResearch/hermes-function-calling-v1 (config `func_calling`);
- `toolace`: Team-ACE/ToolACE;
- `xlam`: Salesforce/xlam-function-calling-60k (APIGen; gated on the hub: log in first);
- `alpaca`: tatsu-lab/alpaca (instruction following);
- `sharegpt`, `openai`: any local file in those layouts (no default; `-i` required).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.errors import DataError
from asyncrl.prepare import problems as prep
from asyncrl.sft.layouts import BadRow, to_conversation

HUB: dict[str, tuple[str, ...]] = {
    "glaive": ("glaiveai/glaive-function-calling-v2@train",),
    "hermes": ("NousResearch/hermes-function-calling-v1:func_calling@train",),
    "toolace": ("Team-ACE/ToolACE@train",),
    "xlam": ("Salesforce/xlam-function-calling-60k@train",),
    "alpaca": ("tatsu-lab/alpaca@train",),
    "sharegpt": (),
    "openai": (),
}
LAYOUTS = tuple(HUB)


@dataclass
class ChatSummary:
    layout: str
    inputs: list[str]
    output: str
    rows_in: int = 0
    written: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    """First occurrence of each skip reason: `input:line N: message`."""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def prepare_chat(layout: str, inputs: list[str], output: str | Path) -> ChatSummary:
    """Convert `inputs` (default: the set's hub names) into `output`; summary beside it."""
    if layout not in HUB:
        raise DataError(f"unknown chat set {layout!r}; expected one of {sorted(HUB)}")
    inputs = list(inputs) or list(HUB[layout])
    if not inputs:
        raise DataError(f"{layout}: no default input; give files with -i")
    out = Path(output)
    summary = ChatSummary(layout=layout, inputs=inputs, output=str(out))
    skipped: Counter[str] = Counter()
    lines = []
    for inp in inputs:
        default_split = "train"
        for where, raw in prep.read_input(inp, default_split):
            summary.rows_in += 1
            try:
                if isinstance(raw, Exception):
                    raise BadRow(getattr(raw, "reason", "bad_json"), str(raw))
                conv = to_conversation(raw, layout)
            except BadRow as e:
                skipped[e.reason] += 1
                summary.examples.setdefault(e.reason, f"{inp}:{where}: {e}")
                continue
            rid = raw.get("id") if isinstance(raw.get("id"), (str, int)) else None
            lines.append(json.dumps({"id": f"{layout}-{rid if rid is not None else summary.written}",
                                     "messages": conv.messages, "tools": conv.tools},
                                    ensure_ascii=False) + "\n")
            summary.written += 1
    summary.skipped = dict(sorted(skipped.items()))
    if not lines:
        raise DataError(f"{layout}: no usable rows in {', '.join(inputs)} "
                        f"(read {summary.rows_in}, skipped {summary.skipped or 'none'})")
    prep.atomic_write(out, "".join(lines).encode())
    prep.atomic_write(prep.summary_path(out), (json.dumps(summary.as_dict(), indent=2,
                                                           ensure_ascii=False) + "\n").encode())
    return summary


def run(args: Any) -> int:
    s = prepare_chat(args.source, args.input, args.output)
    print(f"{s.layout} -> {s.output}\n  rows in  {s.rows_in:>9}\n  written  {s.written:>9}")
    for reason, n in s.skipped.items():
        print(f"  skipped: {reason}  {n}")
    for reason, example in s.examples.items():
        print(f"  first {reason}: {example}", file=sys.stderr)
    return 0

