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
def test_mypy_finds_no_errors() -> None:
    pytest.importorskip("mypy")
    # the project's own cache (.mypy_cache, git-ignored): warm after the first run
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                         text=True, timeout=580)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
