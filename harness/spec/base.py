"""What every part of the spec shares: the strict base model and ``SpecError``. Imports nothing of the harness."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict


class SpecError(Exception):
    """A spec that cannot be run. ``str(err)`` is one line: ``FILE: field.path: what is wrong``."""

    def __init__(self, file: str | os.PathLike[str], field: str, message: str):
        self.file = str(file)
        self.field = field
        self.message = message
        where = f"{self.file}: {field}: " if field else f"{self.file}: "
        super().__init__(where + message)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
