"""The type checker over `asyncrl` and `sandbox` (the `[tool.mypy]` settings in pyproject.toml).

In the default suite so that CI enforces it: mypy is pinned in the dev extras, so only a change
to this code can make this test fail.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_mypy_finds_no_errors(tmp_path) -> None:
    pytest.importorskip("mypy")
    out = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
                         cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
