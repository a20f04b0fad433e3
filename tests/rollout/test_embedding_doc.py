"""The embedding example in docs/embedding.md runs as written and prints a rewarded group."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def test_the_documented_example_runs(tmp_path) -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    assert len(code.strip().splitlines()) <= 22  # it is meant to be short
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("p0 [") and line.count("0.0") + line.count("1.0") == 4, line
    assert "failed" not in line
