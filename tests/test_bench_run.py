"""`just bench`'s runner finds each bench's table: its header regex against the header it prints."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("arms", [["eager", "static"], ["eager"], ["static"]])
def test_local_engine_header_is_found_for_any_arms(arms):
    run = _load("run")
    bench = next(b for b in run.BENCHES if b.name == "local_engine")
    line = _load("local_engine").header(arms)
    assert re.search(bench.table, line), (bench.table, line)


def test_every_bench_names_a_script_and_json():
    run = _load("run")
    for b in run.BENCHES:
        assert (ROOT / "bench" / f"{b.name}.py").exists(), b.name
        assert b.json.endswith(".json")
        re.compile(b.table)
