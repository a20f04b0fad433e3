"""The building blocks of every config section: bounded number types and the section bases.

Imports nothing from the project.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(ge=0, le=1)]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: immutable, keyword-only, unknown keys rejected."""


class _Tagged(_Section, frozen=True, kw_only=True):
    """Base of a variant section; its `kind` (the msgspec tag) picks the implementation."""

    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)


def _bad(field: str, message: str) -> ValueError:
    """A cross-field validation error; `load`'s translator turns it into `section.field: message`."""
    return ValueError(f"{field}: {message}")
