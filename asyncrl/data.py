"""Training and eval problems: loading, prompt-length filtering, and the seeded data cursor.

Owns: reading the project's problem files (`.jsonl`, `.json`, `.parquet`; rows `id`, `question`,
`answer`, optional `source` and `difficulty`) or a built-in task family (`generator:NAME`) into
`Problem` records; counting bad rows instead of crashing on them; dropping problems whose prompt
(system text and tool schema included) is longer than `data.max_prompt_tokens`; and
`ProblemStream`, the seeded epoch iterator whose `state()` goes into checkpoints so a resumed
run sees the same order. `read_rows` gives the raw rows of a file to the chat loader
(`asyncrl.sft.chat`). The files are made by `asyncrl data prepare` (`asyncrl.prepare`).

Does not own: what a problem family generates (`asyncrl.tasks`), the prompt layout
(`asyncrl.formats`), or which problems are hard for the current policy (the curriculum).

A file that cannot be read at all raises `DataError`; a bad row inside it (bad JSON, missing
field, wrong type, empty text, duplicate id) is skipped, counted by reason in
`LoadResult.skipped`, and reported with its line or row number in `LoadResult.errors` and the log.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncrl.errors import DataError
from asyncrl.formats import ToolFormat, render_prompt
from asyncrl.log import get_logger
from asyncrl.records import Problem

log = get_logger(__name__)

GENERATOR_PREFIX = "generator:"
SUFFIXES = (".jsonl", ".json", ".parquet")
MAX_REPORTED_ERRORS = 100
"""Bad rows reported one by one (in `LoadResult.errors` and the log); the rest are only counted."""

Split = Literal["train", "eval"]


@dataclass
class LoadResult:
    problems: list[Problem]
    skipped: dict[str, int] = field(default_factory=dict)
    """Rows not loaded, by reason (`bad_json`, `missing_field`, `bad_type`, `empty_field`,
    `duplicate_id`, `not_an_object`, and `overlong_prompt` after `filter_overlong`)."""
    errors: list[str] = field(default_factory=list)
    """`path:line: message` for the first `MAX_REPORTED_ERRORS` bad rows."""

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


# ------------------------------------------------------------------------------- rows
class _BadRow(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _text_field(row: dict[str, Any], name: str, allow_int: bool = False) -> str:
    if name not in row or row[name] is None:
        raise _BadRow("missing_field", f"missing field {name!r}")
    value = row[name]
    if allow_int and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise _BadRow("bad_type", f"field {name!r} must be a string, got {type(value).__name__}")
    value = value.strip()
    if not value:
        raise _BadRow("empty_field", f"field {name!r} is empty")
    return value


def problem_from_row(row: Any) -> Problem:
    """One row of the project's format as a `Problem`; raises `_BadRow` naming the problem.

    `id` may be a string or an integer (it is a label); `question` and `answer` must be
    non-empty strings (a numeric answer would lose its written form, e.g. `0.50`).
    """
    if not isinstance(row, dict):
        raise _BadRow("not_an_object", f"row must be a JSON object, got {type(row).__name__}")
    pid = _text_field(row, "id", allow_int=True)
    question = _text_field(row, "question")
    answer = _text_field(row, "answer")
    source = row.get("source") or ""
    if not isinstance(source, str):
        raise _BadRow("bad_type", f"field 'source' must be a string, got {type(source).__name__}")
    difficulty = row.get("difficulty")
    if difficulty is not None and (isinstance(difficulty, bool)
                                   or not isinstance(difficulty, int | float)):
        raise _BadRow("bad_type",
                      f"field 'difficulty' must be a number, got {type(difficulty).__name__}")
    return Problem(id=pid, question=question, answer=answer, source=source,
                   difficulty=None if difficulty is None else float(difficulty))


def _rows_jsonl(path: Path) -> Iterable[tuple[str, Any]]:
    """(`line N`, decoded row or a `_BadRow`) for each non-blank line."""
    with path.open("rb") as fp:
        for lineno, line in enumerate(fp, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {lineno}", json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield f"line {lineno}", _BadRow("bad_json", f"not valid JSON: {e}")


def _rows_json(path: Path) -> Iterable[tuple[str, Any]]:
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); expected a list of problem objects") from e
    if isinstance(data, dict) and isinstance(data.get("problems"), list):
        data = data["problems"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of problem objects, "
                        f"got {type(data).__name__}")
    for i, row in enumerate(data, start=1):
        yield f"row {i}", row


def _rows_parquet(path: Path) -> Iterable[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(f"{path}: cannot read parquet file: {e}") from e
    for i, row in enumerate(table.to_pylist(), start=1):
        yield f"row {i}", row


_READERS = {".jsonl": _rows_jsonl, ".json": _rows_json, ".parquet": _rows_parquet}


def _reader(p: Path, also: str) -> Any:
    """The row reader for `p`'s file type; `DataError` for an unknown type or a missing file
    (`also` names what else the caller would have accepted)."""
    reader = _READERS.get(p.suffix.lower())
    if reader is None:
        raise DataError(f"{p}: unknown data file type {p.suffix!r}; expected one of "
                        f"{', '.join(SUFFIXES)}{also}")
    if not p.is_file():
        raise DataError(f"{p}: data file not found")
    return reader


def read_rows(path: str | Path) -> Iterable[tuple[int, Any]]:
    """(line or row number, decoded row) for each row of a `.jsonl`/`.json`/`.parquet` file; a
    line that is not JSON is yielded as a `ValueError` in place of the row. Raises `DataError`
    for a file that cannot be read at all."""
    p = Path(path)
    for where, row in _reader(p, "")(p):
        n = int(where.split()[-1])
        yield n, (ValueError(str(row)) if isinstance(row, _BadRow) else row)


def read_problem_file(path: str | Path) -> LoadResult:
    """All good rows of a problem file, with bad rows counted and reported (never raised)."""
    p = Path(path)
    reader = _reader(p, f" or {GENERATOR_PREFIX}NAME")
    problems: list[Problem] = []
    skipped: Counter[str] = Counter()
    errors: list[str] = []
    seen: set[str] = set()
    for where, row in reader(p):
        try:
            if isinstance(row, _BadRow):
                raise row
            prob = problem_from_row(row)
            if prob.id in seen:
                raise _BadRow("duplicate_id", f"duplicate id {prob.id!r}")
        except _BadRow as bad:
            skipped[bad.reason] += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(f"{p}:{where}: {bad}")
                log.warning("bad_data_row", path=str(p), where=where, reason=bad.reason,
                            message=str(bad))
            continue
        seen.add(prob.id)
        problems.append(prob)
    if skipped:
        log.warning("data_rows_skipped", path=str(p), kept=len(problems), **dict(skipped))
    return LoadResult(problems, dict(sorted(skipped.items())), errors)


def load_problems(source: str, options: dict[str, Any], seed: int, split: Split) -> LoadResult:
    """Problems of one split from a file path or `generator:NAME` (a task source: a built-in
    family or a plugin, `asyncrl.envs.source`; the items it dropped are counted as skipped).

    A path is the split itself (`data.train` / `data.eval` name different files); `options` and
    `seed` only matter to generators, which return (train, eval) and are asked for `split`.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if source.startswith(GENERATOR_PREFIX):
        name = source[len(GENERATOR_PREFIX):]
        if not name:
            raise DataError(f"{source!r}: name a task family after {GENERATOR_PREFIX!r}")
        # lazy: task sources pull in their own dependencies (asyncrl.envs.source)
        from asyncrl.envs.source import load_source

        src = load_source(name, options, seed, key=f"data.{split}")
        dropped = src.dropped if split == "train" else src.dropped_eval
        return LoadResult(list(src.train if split == "train" else src.eval),
                          dict(sorted(dropped.items())))
    return read_problem_file(source)


# ---------------------------------------------------------------------------- prompts
def prompt_text(problem: Problem, fmt: ToolFormat, tools: list[dict[str, Any]] | None,
                system_prompt: str = "") -> str:
    """The prompt the engine sees for `problem`: the curriculum's template (DESIGN "Formats")."""
    return render_prompt(problem.question, fmt, tools, system_prompt)


def _token_counts(texts: Sequence[str], tokenizer: Any, chunk: int = 512) -> list[int]:
    counts: list[int] = []
    for i in range(0, len(texts), chunk):
        part = list(texts[i:i + chunk])
        if callable(tokenizer):  # HF tokenizers batch-encode in Rust
            ids = tokenizer(part, add_special_tokens=False)["input_ids"]
        else:
            ids = [tokenizer.encode(t, add_special_tokens=False) for t in part]
        counts.extend(len(x) for x in ids)
    return counts


def filter_overlong(problems: Sequence[Problem], tokenizer: Any, fmt: ToolFormat,
                    tools: list[dict[str, Any]] | None, max_prompt_tokens: int,
                    system_prompt: str = "") -> tuple[list[Problem], int]:
    """Problems whose whole prompt (system text and tool schemas included) fits in
    `max_prompt_tokens`, and how many did not."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    texts = [prompt_text(p, fmt, tools, system_prompt) for p in problems]
    kept: list[Problem] = []
    over: list[str] = []
    for prob, n in zip(problems, _token_counts(texts, tokenizer), strict=True):
        if n <= max_prompt_tokens:
            kept.append(prob)
        else:
            over.append(prob.id)
    if over:
        log.warning("overlong_prompts_skipped", count=len(over), limit=max_prompt_tokens,
                    first_ids=over[:5])
    return kept, len(over)


def load_split(source: str, options: dict[str, Any], seed: int, split: Split, tokenizer: Any,
               fmt: ToolFormat, tools: list[dict[str, Any]] | None, max_prompt_tokens: int,
               system_prompt: str = "") -> LoadResult:
    """`load_problems` then `filter_overlong`; overlong prompts are counted as `overlong_prompt`.

    What the train loop calls with `data.train`/`data.eval`, `data.generator_options`,
    `run.seed`, the model's tokenizer, `rollout.tool_format` (and `rollout.tools`),
    `data.max_prompt_tokens` and `data.system_prompt`.
    """
    res = load_problems(source, options, seed, split)
    kept, n_over = filter_overlong(res.problems, tokenizer, fmt, tools, max_prompt_tokens,
                                   system_prompt)
    skipped = dict(res.skipped)
    if n_over:
        skipped["overlong_prompt"] = n_over
    if not kept:
        raise DataError(f"{source}: no usable {split} problems (skipped: {skipped or 'none'})")
    log.info("data_loaded", source=source, split=split, problems=len(kept), **skipped)
    return LoadResult(kept, dict(sorted(skipped.items())), res.errors)


# ----------------------------------------------------------------------------- stream
def fingerprint(problems: Sequence[Problem]) -> str:
    """A short digest of the problem ids in order: detects a changed dataset on resume."""
    h = hashlib.sha256()
    for p in problems:
        h.update(p.id.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


class ProblemStream:
    """Endless, seeded epochs over a fixed list of problems; resumable from `state()`.

    Epoch `e` visits every problem once, in an order that depends only on (`seed`, `e`) (or in
    file order when `shuffle` is off). A batch that crosses an epoch end continues into the next
    epoch, so a batch larger than the dataset may hold a problem twice. The cursor is
    (`epoch`, `position`): the same state gives the same batches after a restart.
    """

    def __init__(self, problems: Sequence[Problem], seed: int, shuffle: bool = True,
                 epoch: int = 0, position: int = 0) -> None:
        if not problems:
            raise DataError("cannot stream an empty problem list")
        if epoch < 0 or not 0 <= position <= len(problems):
            raise ValueError(f"bad cursor epoch={epoch} position={position} "
                             f"for {len(problems)} problems")
        self._problems = list(problems)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = epoch
        self.position = position
        self._order = self._epoch_order(epoch)

    def __len__(self) -> int:
        return len(self._problems)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._problems)))
        if self.shuffle:
            # A str seed is hashed with SHA-512 by `random`: stable across processes and versions.
            random.Random(f"asyncrl.data:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Problem]:
        """The next `n` problems, moving the cursor (and the epoch at its end)."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        out: list[Problem] = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self._order) - self.position)
            out.extend(self._problems[i]
                       for i in self._order[self.position:self.position + take])
            self.position += take
        return out

    def state(self) -> dict[str, Any]:
        """The cursor, for checkpoints (JSON-serialisable)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "num_problems": len(self._problems),
                "fingerprint": fingerprint(self._problems)}

    @classmethod
    def from_state(cls, problems: Sequence[Problem], state: dict[str, Any]) -> ProblemStream:
        """Resume over the same problems; raises `DataError` if they changed since the state."""
        try:
            epoch, position, seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"bad data cursor in checkpoint: {state!r} ({e})") from e
        expected = state.get("fingerprint")
        if expected is not None and expected != fingerprint(problems):
            raise DataError(
                f"the problems differ from the checkpoint's ({len(problems)} now, "
                f"{state.get('num_problems')} then): resume with the same data files, or start "
                "a new data cursor")
        return cls(problems, seed, bool(state.get("shuffle", True)), epoch, position)
