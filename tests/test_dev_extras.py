"""The task-source packages that the `dev` extra installs (through `test-envs`) are there, so
their tests in `tests/tasks`, which skip without them (a machine with only
the core dependencies, such as a lent GPU machine, collects them without errors), never skip
quietly in CI or on a developer's machine."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("module", ["skyrl_gym", "verifiers.v1", "reasoning_gym"])
def test_the_dev_extras_task_sources_are_installed(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} does not import ({e}): install the dev extra "
                    "(pip install -e '.[dev]')")
