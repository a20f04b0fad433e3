"""`asyncrl data prepare <chat set>`: each public layout's fixture becomes checked chat JSONL
that a chat SFT stage reads as is; bad rows are skipped with their line in the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl import formats as F
from asyncrl.cli.main import main
from asyncrl.sft.chat import load_chat

FIX = Path(__file__).parents[1] / "data" / "fixtures" / "chat"


@pytest.mark.parametrize("source", ["openai", "sharegpt", "hermes", "glaive", "toolace",
                                    "xlam", "alpaca"])
def test_each_set_converts_to_chat_jsonl(source, tmp_path, tiny_tokenizer, capsys) -> None:
    out = tmp_path / f"{source}.jsonl"
    assert main(["data", "prepare", source, "-i", str(FIX / f"{source}.jsonl"),
                 "-o", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    n_in = len((FIX / f"{source}.jsonl").read_text().splitlines())
    assert len(rows) == n_in and all(set(r) == {"id", "messages", "tools"} for r in rows)
    assert f"written  {n_in:>9}" in capsys.readouterr().out
    summary = json.loads((tmp_path / f"{source}.summary.json").read_text())
    assert summary["rows_in"] == summary["written"] == n_in
    # what it wrote is a chat file the SFT stage reads in the openai layout, nothing skipped
    res = load_chat([str(out)], F.HERMES, tiny_tokenizer, layout="openai")
    assert res.num_bad == 0 and len(res.train) == n_in


def test_bad_rows_are_skipped_with_their_line(tmp_path, capsys) -> None:
    out = tmp_path / "bad.jsonl"
    src = FIX / "bad_rows.jsonl"
    assert main(["data", "prepare", "openai", "-i", str(src), "-o", str(out)]) == 0
    summary = json.loads((tmp_path / "bad.summary.json").read_text())
    # a too-long row is only known once rendered for a model: the stage counts that one
    assert summary["written"] == 3 and summary["skipped"] == {
        "bad_arguments": 1, "bad_json": 1, "missing_role": 1, "tool_without_call": 1}
    assert summary["examples"]["missing_role"].startswith(f"{src}:line 2:")
    assert "first bad_json" in capsys.readouterr().err
    assert main(["data", "prepare", "sharegpt", "-o", str(out)]) == 1  # no default input
