"""Lazy package exports: a family package names what it exports and loads each submodule on
first use, so importing one light submodule never loads the others (or torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `exports` maps each name to the submodule that
    defines it."""
    def getattr_(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr_
