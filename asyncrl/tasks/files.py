"""Problem files: the project's `.jsonl`, `.json` and `.parquet` problem files read into
`Problem` records (rows `id`, `question`, `answer`, optional `source` and `difficulty`),
counting bad rows instead of crashing on them. `read_rows` gives the raw rows of a file to the
chat loader (`asyncrl.sft.chat`). The files are made by `asyncrl data prepare`
(`asyncrl.prepare`).

Does not own: task sources (`asyncrl.tasks.source`), prompt-length filtering and the data
cursor (`asyncrl.tasks.stream`).

A file that cannot be read at all raises `DataError`; a bad row inside it (bad JSON, missing
field, wrong type, empty text, duplicate id) is skipped, counted by reason in
`LoadResult.skipped`, and reported with its line or row number in `LoadResult.errors` and the log.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncrl.errors import DataError
from asyncrl.log import get_logger
from asyncrl.records import Problem
from asyncrl.tasks.source import GENERATOR_PREFIX

log = get_logger(__name__)

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
