"""Convert public math datasets into the project's problem JSONL.

    asyncrl data prepare dapo    -i dapo.parquet  -o data/dapo_math_17k.jsonl
    asyncrl data prepare aime24  -o data/aime24.jsonl          # hub name (needs network)
    asyncrl data prepare math500 -i math500.jsonl -o data/math500.jsonl

Owns: the column layouts of the supported sources, stripping DAPO's instruction wrapper,
the English-subset filter, answer clean-up, de-duplication, stable ids, and the summary written
beside the output. Does not own: reading the project's own files at train time (`asyncrl.tasks.files`).

Sources and their layouts (one row each):
- `dapo`   BytedTsinghua-SIA/DAPO-Math-17k: `prompt` (list of chat messages; the user message
           wraps the problem in "Solve the following math problem step by step. The last line
           ..." / "Remember to put your answer on its own line after "Answer:"."),
           `reward_model.ground_truth`, `data_source`, `extra_info.index`. The hub copy repeats
           each of its ~17.9K problems about 100 times (1.79M rows), and some problems are
           Chinese: the report trains on the English subset, kept by default.
- `aime24` HuggingFaceH4/aime_2024: `id`, `problem`, `solution`, `answer`, `url`, `year`.
- `aime25` opencompass/AIME2025 (configs AIME2025-I, AIME2025-II): `question`, `answer`;
           yentinglin/aime_2025 and similar copies: `id`, `problem`, `answer`.
- `math500` HuggingFaceH4/MATH-500: `problem`, `solution`, `answer`, `subject`, `level`,
           `unique_id`; `level` (1-5) becomes `difficulty`.

Inputs are local `.parquet`, `.json` (a list, or JSON lines) and `.jsonl` files in those layouts,
or hub names `owner/name[:config][@split]` loaded with the optional `datasets` package.
Every input row is accounted for: written, skipped with a reason, or a duplicate. The output is
a pure function of the input rows (same input, byte-identical output and summary).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.errors import DataError

SUMMARY_SUFFIX = ".summary.json"


class Skip(Exception):
    """A source row that cannot become a problem; `reason` is the summary's counter key."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason


@dataclass(frozen=True)
class Row:
    """A converted row before de-duplication; `raw_id` is None when the source has no id."""

    raw_id: str | None
    question: str
    answer: str
    difficulty: float | None = None


# ------------------------------------------------------------------------------- cleaning
_DAPO_PREFIX = re.compile(
    r"^\s*Solve the following math problem step by step\.\s*The last line of your response "
    r"should be of the form Answer: \$Answer \(without quotes\) where \$Answer is the answer "
    r"to the problem\.\s*")
_DAPO_SUFFIX = re.compile(
    r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3000-\u303f\uff00-\uffef]")
_BOXED = "\\boxed{"


def _closing_brace(text: str, start: int) -> int:
    """Index of the brace closing the one opened just before `start`, or -1."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return -1


def strip_dapo_wrapper(text: str) -> str:
    """The bare problem inside DAPO's instruction wrapper (text without it is returned as is)."""
    return _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text)).strip()


def clean_question(value: Any) -> str:
    if value is None:
        raise Skip("missing_question", "no question")
    if not isinstance(value, str):
        raise Skip("bad_question", f"question is a {type(value).__name__}, not text")
    text = value.strip()
    if not text:
        raise Skip("missing_question", "the question is empty")
    return text


def clean_answer(value: Any) -> str:
    """The ground truth as text: integers become digits, a whole-answer `$...$` or `\\boxed{}`
    wrapper is removed; empty, non-finite and non-scalar answers are unusable."""
    if value is None:
        raise Skip("missing_answer", "no answer")
    if isinstance(value, bool):
        raise Skip("bad_answer", "answer is a boolean")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Skip("bad_answer", f"answer is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    if not isinstance(value, str):
        raise Skip("bad_answer", f"answer is a {type(value).__name__}")
    text = value.strip()
    while len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text[1:-1].strip()
    if text.startswith(_BOXED) and _closing_brace(text, len(_BOXED)) == len(text) - 1:
        text = text[len(_BOXED):-1].strip()
    if not text:
        raise Skip("missing_answer", "the answer is empty")
    return text


def _first(row: dict[str, Any], *names: str) -> Any:
    for name in names:
        if row.get(name) is not None:
            return row[name]
    return None


def _id(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    return text or None


# ----------------------------------------------------------------------------- converters
def convert_dapo(row: dict[str, Any], keep_non_english: bool = False) -> Row:
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt
                 if isinstance(m, dict) and m.get("role", "user") == "user"]
        if not users:
            raise Skip("bad_prompt", "prompt has no user message")
        prompt = users[0]
    if prompt is not None and not isinstance(prompt, str):
        raise Skip("bad_prompt", f"prompt is a {type(prompt).__name__}")
    question = clean_question(strip_dapo_wrapper(prompt) if prompt is not None else None)
    if not keep_non_english and _CJK.search(question):
        raise Skip("non_english", "the question contains Chinese text")
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None:
        truth = _first(row, "answer", "solution")  # processed copies flatten the ground truth
    extra = row.get("extra_info")
    raw_id = _id(extra.get("index")) if isinstance(extra, dict) else None
    return Row(raw_id, question, clean_answer(truth))


def convert_aime(row: dict[str, Any]) -> Row:
    question = clean_question(_first(row, "problem", "question", "Problem", "Question"))
    answer = clean_answer(_first(row, "answer", "Answer"))
    return Row(_id(_first(row, "id", "ID", "problem_idx")), question, answer)


def convert_math500(row: dict[str, Any]) -> Row:
    question = clean_question(row.get("problem"))
    answer = clean_answer(row.get("answer"))
    level = row.get("level")
    difficulty: float | None = None
    if isinstance(level, int | float) and not isinstance(level, bool):
        difficulty = float(level)
    elif isinstance(level, str) and level.strip().removeprefix("Level ").isdigit():
        difficulty = float(level.strip().removeprefix("Level "))
    return Row(_id(row.get("unique_id")), question, answer, difficulty)


@dataclass(frozen=True)
class Source:
    tag: str
    """Written as each problem's `source` and used as its id prefix."""
    hub: tuple[str, ...]
    """Default inputs: hub names `owner/name[:config][@split]`."""
    convert: Callable[[dict[str, Any], bool], Row]


SOURCES: dict[str, Source] = {
    "dapo": Source("dapo_math_17k", ("BytedTsinghua-SIA/DAPO-Math-17k@train",), convert_dapo),
    "aime24": Source("aime24", ("HuggingFaceH4/aime_2024@train",),
                     lambda row, _: convert_aime(row)),
    "aime25": Source("aime25", ("opencompass/AIME2025:AIME2025-I@test",
                                "opencompass/AIME2025:AIME2025-II@test"),
                     lambda row, _: convert_aime(row)),
    "math500": Source("math500", ("HuggingFaceH4/MATH-500@test",),
                      lambda row, _: convert_math500(row)),
}


# ---------------------------------------------------------------------------------- inputs
def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as fp:
        for lineno, line in enumerate(fp, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {lineno}", json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield f"line {lineno}", Skip("bad_json", f"not valid JSON: {e}")


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError:
        yield from _read_jsonl(path)  # hub files named .json are often JSON lines
        return
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e
    if isinstance(data, dict):  # column-oriented {"col": [...]} or {"data"/"rows": [...]}
        for key in ("data", "rows", "train", "test"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            cols = {k: v for k, v in data.items() if isinstance(v, list)}
            lengths = {len(v) for v in cols.values()}
            if not cols or len(lengths) != 1:
                raise DataError(f"{path}: expected a list of rows or equal-length columns")
            data = [dict(zip(cols, vals, strict=True)) for vals in zip(*cols.values(),
                                                                       strict=True)]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
    for i, row in enumerate(data, start=1):
        yield f"row {i}", row


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(f"{path}: cannot read parquet file: {e}") from e
    i = 0
    for batch in pf.iter_batches(batch_size=4096):  # the DAPO hub file has 1.79M rows
        for row in batch.to_pylist():
            i += 1
            yield f"row {i}", row


def _read_hub(spec: str, default_split: str) -> Iterator[tuple[str, Any]]:
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"{spec}: loading from the hub needs the `datasets` package "
                        "(pip install datasets) and network access; or pass a local file") from e
    try:
        ds = datasets.load_dataset(name, config or None, split=split or default_split)
    except Exception as e:  # hub/network/format errors come in many types; translate them all
        raise DataError(f"{spec}: cannot load from the hub: {e}") from e
    for i, row in enumerate(ds, start=1):
        yield f"row {i}", row


_FILE_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def read_input(spec: str, default_split: str = "train") -> Iterator[tuple[str, Any]]:
    """(`line N`/`row N`, row or Skip) for each row of a local file or hub dataset."""
    path = Path(spec)
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix not in _FILE_READERS:
            raise DataError(f"{spec}: unknown file type {suffix!r}; expected .parquet, .json "
                            "or .jsonl")
        return _FILE_READERS[suffix](path)
    if suffix in _FILE_READERS or path.exists():
        raise DataError(f"{spec}: input file not found")
    return _read_hub(spec, default_split)


# --------------------------------------------------------------------------------- convert
@dataclass
class Summary:
    source: str
    inputs: list[str]
    output: str
    rows_in: int = 0
    written: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    """Rows whose question (whitespace-normalised) was already written; the first is kept."""
    duplicate_conflicts: int = 0
    """Duplicates whose answer differed from the kept row's (kept: the first; check these)."""
    renamed_ids: int = 0
    """Rows whose source id was missing or already taken; given a question-hash id instead."""
    examples: dict[str, str] = field(default_factory=dict)
    """First occurrence of each skip reason: `input:line N: message`."""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _qhash(question: str) -> str:
    return hashlib.sha256(question.encode()).hexdigest()[:12]


def convert_rows(source: str, rows: Iterator[tuple[str, str, Any]], summary: Summary,
                 keep_non_english: bool = False) -> Iterator[dict[str, Any]]:
    """Output records for (input, where, raw row) triples, updating `summary` as it goes."""
    spec = SOURCES[source]
    skipped: Counter[str] = Counter(summary.skipped)
    by_key: dict[str, str] = {}  # normalised question -> answer written
    ids: set[str] = set()
    for inp, where, raw in rows:
        summary.rows_in += 1
        try:
            if isinstance(raw, Skip):
                raise raw
            if not isinstance(raw, dict):
                raise Skip("not_an_object", f"row is a {type(raw).__name__}")
            row = spec.convert(raw, keep_non_english)
        except Skip as s:
            skipped[s.reason] += 1
            summary.examples.setdefault(s.reason, f"{inp}:{where}: {s}")
            continue
        key = " ".join(row.question.split())
        if key in by_key:
            summary.duplicates += 1
            if by_key[key] != row.answer:
                summary.duplicate_conflicts += 1
            continue
        by_key[key] = row.answer
        pid = f"{spec.tag}-{row.raw_id}" if row.raw_id is not None else None
        if pid is None or pid in ids:
            pid = f"{spec.tag}-q{_qhash(key)}"
            summary.renamed_ids += 1
        ids.add(pid)
        rec: dict[str, Any] = {"id": pid, "question": row.question, "answer": row.answer,
                               "source": spec.tag}
        if row.difficulty is not None:
            rec["difficulty"] = row.difficulty
        summary.written += 1
        yield rec
    summary.skipped = dict(sorted(skipped.items()))
    summary.examples = dict(sorted(summary.examples.items()))


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fp:
            fp.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def summary_path(output: Path) -> Path:
    return output.with_name(output.stem + SUMMARY_SUFFIX)


def prepare(source: str, inputs: list[str], output: str | Path,
            keep_non_english: bool = False) -> Summary:
    """Convert `inputs` (default: the source's hub names) into `output` JSONL and write the
    summary beside it; returns the summary. Raises `DataError` if nothing usable was found."""
    if source not in SOURCES:
        raise DataError(f"unknown source {source!r}; expected one of {sorted(SOURCES)}")
    spec = SOURCES[source]
    inputs = list(inputs) or list(spec.hub)
    out = Path(output)
    summary = Summary(source=spec.tag, inputs=inputs, output=str(out))
    default_split = spec.hub[0].partition("@")[2] or "train"

    def rows() -> Iterator[tuple[str, str, Any]]:
        for inp in inputs:
            for where, raw in read_input(inp, default_split):
                yield inp, where, raw

    lines = [json.dumps(rec, ensure_ascii=False) + "\n"
             for rec in convert_rows(source, rows(), summary, keep_non_english)]
    if not lines:
        raise DataError(f"{source}: no usable rows in {', '.join(inputs)} "
                        f"(read {summary.rows_in}, skipped {summary.skipped or 'none'})")
    atomic_write(out, "".join(lines).encode())
    atomic_write(summary_path(out),
                  (json.dumps(summary.as_dict(), indent=2, ensure_ascii=False) + "\n").encode())
    return summary


def format_summary(summary: Summary) -> str:
    rows = [("rows in", summary.rows_in), ("written", summary.written)]
    rows += [(f"skipped: {k}", v) for k, v in summary.skipped.items()]
    rows += [("duplicates", summary.duplicates),
             ("duplicates with another answer", summary.duplicate_conflicts),
             ("ids derived from the question", summary.renamed_ids)]
    width = max(len(k) for k, _ in rows)
    body = "\n".join(f"  {k:<{width}}  {v:>9}" for k, v in rows)
    return f"{summary.source} -> {summary.output}\n{body}"


def run(args: Any) -> int:
    """`asyncrl data prepare` on parsed arguments (`asyncrl.cli.data`)."""
    summary = prepare(args.source, args.input, args.output, args.keep_non_english)
    print(format_summary(summary))
    print(f"summary: {summary_path(Path(summary.output))}")
    for reason, example in summary.examples.items():
        print(f"  first {reason}: {example}", file=sys.stderr)
    return 0

