"""The built wheel works on its own: `asyncrl data prepare` runs from an installed wheel.

Everything the package needs at run time must be inside it (no file read from the source tree
beside it). The wheel is built from this checkout and installed into a fresh virtualenv; the
virtualenv sees the site-packages of the interpreter running the tests for the third-party
dependencies (tests may not download them): the system's, or a virtualenv's, as most users
install. Those directories are plain `sys.path` entries, so their `.pth` files (an editable
install of this checkout among them) are not read, and the test checks that `asyncrl` itself is
the wheel's copy, not this checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "fixtures" / "math500.jsonl"


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _site_dirs() -> list[str]:
    """The running interpreter's site-packages directories (virtualenv, user and system)."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")
            and Path(p).is_dir()]


def test_data_prepare_runs_from_an_installed_wheel(tmp_path: Path) -> None:
    if not FIXTURE.is_file():
        pytest.fail(f"fixture missing: {FIXTURE}")
    # built from a copy of what packaging reads, so the build leaves nothing in the checkout
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for pkg in ("asyncrl", "sandbox"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    # no build isolation: the build backend (setuptools) is already installed, and tests
    # download nothing; the C extension is optional and skipped quietly without a compiler
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(dist), str(src)], cwd=tmp_path)
    wheels = list(dist.glob("asyncrl-*.whl"))
    assert len(wheels) == 1, wheels

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # `system_site_packages` would reach the base interpreter's site-packages only, not those
    # of a virtualenv the tests run in (where msgspec and the rest are)
    own = _run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
               cwd=tmp_path).strip()
    (Path(own) / "deps-of-the-test-interpreter.pth").write_text(
        "".join(f"{p}\n" for p in _site_dirs()))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
          str(wheels[0])], cwd=tmp_path, env=env)

    where = _run([str(py), "-c", "import asyncrl, asyncrl.prepare; print(asyncrl.__file__)"],
                 cwd=tmp_path, env=env).strip()
    assert Path(where).is_relative_to(env_dir), f"asyncrl imported from {where}, not the wheel"

    out = tmp_path / "math500.jsonl"
    printed = _run([str(env_dir / "bin" / "asyncrl"), "data", "prepare", "math500", "-i",
                    str(FIXTURE), "-o", str(out)], cwd=tmp_path, env=env)
    assert "math500 ->" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["question"] and r["answer"] for r in rows)
    assert json.loads((tmp_path / "math500.summary.json").read_text())["written"] == len(rows)
