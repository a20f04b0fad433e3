"""Chat files for an SFT stage: read, convert, render, tokenize, count the bad rows.

Owns: `load_chat` (rows of one or more files -> tokenized `ChatExample`s through
`asyncrl.sft.layouts.to_conversation` and `asyncrl.sft.render.render`), the bad-row accounting (every bad row
counted by reason and reported as `path:line: reason: message`, never raised), the refusal to
start when too many rows are bad, and the held-out split. Does not own: the layouts, the
rendering, the batches of a stage (`asyncrl.sft.stage`).

Bad rows: not JSON, not an object, no known layout, a message without a role or with an unknown
one, a tool result without a call, invalid JSON in a call's `arguments`, a call without a name,
bad tool schemas, a row the template cannot render, a row longer than `max_tokens`, a row
without a trained token. A row is wholly kept or wholly skipped.

Examples are kept compact (`array('i')` ids, `bytes` masks): a cold-start set of ~220K chats
(the report's mix) is a few hundred million tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl import formats
from asyncrl.errors import DataError
from asyncrl.log import get_logger
from asyncrl.sft.coldstart import Segment, tokenize_many
from asyncrl.sft.layouts import BadRow, to_conversation
from asyncrl.sft.render import render
from asyncrl.tasks.files import read_rows

log = get_logger(__name__)

MAX_REPORTED = 100
"""Bad rows reported one by one (in `ChatLoad.errors` and the log); the rest are counted."""
_CHUNK = 512
"""Rows rendered and tokenized per batch (bounds the memory of texts in flight)."""


@dataclass(frozen=True)
class ChatExample:
    """One tokenized chat (or one user query of it); `source` is `path:line`."""

    ids: array
    mask: bytes
    source: str

    def pair(self) -> tuple[list[int], list[int]]:
        """(ids, loss mask) as the trainers take them."""
        return self.ids.tolist(), list(self.mask)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class ChatLoad:
    train: list[ChatExample]
    valid: list[ChatExample]
    rows: int = 0
    """Rows read (good and bad)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Bad rows by reason."""
    errors: list[str] = field(default_factory=list)
    """`path:line: reason: message` for the first `MAX_REPORTED` bad rows."""

    @property
    def num_bad(self) -> int:
        return sum(self.skipped.values())

    @property
    def bad_fraction(self) -> float:
        return self.num_bad / self.rows if self.rows else 0.0


class _Counter:
    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()
        self.errors: list[str] = []

    def bad(self, where: str, reason: str, message: str) -> None:
        self.skipped[reason] += 1
        if len(self.errors) < MAX_REPORTED:
            self.errors.append(f"{where}: {reason}: {message}")
            log.warning("bad_chat_row", where=where, reason=reason, message=message)


def _in_valid(where: str, seed: int, fraction: float) -> bool:
    """A stable, seeded split by row: the same row lands on the same side in every run."""
    if fraction <= 0:
        return False
    h = hashlib.sha256(f"{seed}:{where}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def _examples(paths: Sequence[str], fmt: formats.ToolFormat, tokenizer: Any, layout: str,
              max_tokens: int, system_prompt: str, counter: _Counter
              ) -> tuple[list[ChatExample], int]:
    out: list[ChatExample] = []
    rows = 0
    pending: list[tuple[str, list[list[Segment]]]] = []

    def flush() -> None:
        flat = [segs for _, exs in pending for segs in exs]
        encoded = iter(tokenize_many(flat, tokenizer))
        for where, exs in pending:
            pairs = [next(encoded) for _ in exs]
            longest = max(len(ids) for ids, _ in pairs)
            if longest > max_tokens:
                counter.bad(where, "too_long", f"{longest} tokens > max_tokens={max_tokens}")
            elif not all(any(mask) for _, mask in pairs):
                counter.bad(where, "no_trained_tokens", "nothing for the model to learn")
            else:
                out.extend(ChatExample(array("i", ids), bytes(mask), where) for ids, mask in pairs)
        pending.clear()

    for path in paths:
        for n, row in read_rows(path):
            rows += 1
            where = f"{path}:{n}"
            if isinstance(row, ValueError):
                counter.bad(where, "bad_json", str(row))
                continue
            try:
                pending.append((where, render(to_conversation(row, layout), fmt, system_prompt)))
            except BadRow as e:
                counter.bad(where, e.reason, str(e))
            if len(pending) >= _CHUNK:
                flush()
    flush()
    return out, rows


def load_chat(train: Sequence[str], fmt: formats.ToolFormat, tokenizer: Any, *,
              valid: Sequence[str] = (), valid_fraction: float = 0.0, layout: str = "auto",
              max_tokens: int = 4096, system_prompt: str = "", seed: int = 0,
              max_bad_fraction: float = 1.0) -> ChatLoad:
    """Every usable chat of `train` (and `valid`, or a `valid_fraction` split of `train`).

    `fmt` is the run's bound tool format (`templates.bind_format`): with the model's template
    the chats are rendered by it, else by the format's own text. Raises `DataError` when no row
    is usable or more than `max_bad_fraction` of all rows are bad (naming the first reasons).
    """
    counter = _Counter()
    examples, rows = _examples(train, fmt, tokenizer, layout, max_tokens, system_prompt, counter)
    held: list[ChatExample] = []
    if valid:
        held, n_valid = _examples(valid, fmt, tokenizer, layout, max_tokens, system_prompt,
                                  counter)
        rows += n_valid
    elif valid_fraction > 0:
        held = [e for e in examples if _in_valid(e.source, seed, valid_fraction)]
        examples = [e for e in examples if not _in_valid(e.source, seed, valid_fraction)]
    res = ChatLoad(examples, held, rows, dict(sorted(counter.skipped.items())), counter.errors)
    log.info("chat_data_loaded", rows=rows, train=len(examples), valid=len(held),
             bad=res.num_bad, **res.skipped)
    if res.bad_fraction > max_bad_fraction:
        raise DataError(
            f"{res.num_bad} of {rows} chat rows are bad ({res.bad_fraction:.1%} > "
            f"max_bad_fraction={max_bad_fraction:.1%}): {res.skipped}; first: "
            + "; ".join(res.errors[:3]))
    if not examples:
        raise DataError(f"no usable chat rows in {list(train)} (bad: {res.skipped or 'none'})")
    return res
